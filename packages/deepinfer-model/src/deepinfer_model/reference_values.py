"""FP32 weight values as a ``WeightSource`` of the reference model: what a trainer hands the oracle forward.

The reference forward normally reads stored tensors (FP8 blocks, MXFP4 experts, FP8 Engram rows) and dequantizes
them. ``ValueWeights`` instead holds one FP32 value per catalogue weight (FP8/MXFP4 weights in their logical
``[out, in]`` shape, the Engram tables ``[rows, d_e]``), for example ``requires_grad`` master parameters, and returns
them as they are, so gradients flow into them. With ``fake_quant=True`` every FP8/MXFP4 weight and Engram row is
read through a quantize-dequantize round trip in its stored format, and every BF16 tensor (``bf16_names``, see
``bf16_weight_names``) through a BF16 rounding, each with a straight-through gradient: the forward sees exactly the
values a written checkpoint will hold (docs/design/numerics.md, "Weight formats"), the gradient passes to the FP32
value unchanged.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import Tensor

from deepinfer_kernels import quantize_fp8_block, quantize_fp8_per_token_group, quantize_mxfp4
from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.reference_formats import _dequantize_fp8_rows, dequantize_fp8_block, dequantize_mxfp4

__all__ = ["ValueWeights", "bf16_weight_names", "values_from_stored"]


def bf16_weight_names(config: ModelConfig) -> frozenset[str]:
    """Names of the catalogue weights stored as BF16 (the ones ``fake_quant`` rounds to BF16)."""
    return frozenset(e.name for e in build_catalogue(config) if e.format is TensorFormat.BF16)


def values_from_stored(config: ModelConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """FP32 values of every catalogue weight read back from stored tensors (``LoadedCheckpoint.tensors``): the
    inverse of the checkpoint writer's quantization, so a trainer can continue from a written checkpoint. FP8/MXFP4
    weights come back in their logical ``[out, in]`` shape; writing the values again stores the same numbers.

    Raises:
        KeyError: a weight or its scale is missing from ``tensors`` (the message names it).
    """

    def stored(name: str) -> Tensor:
        if name not in tensors:
            raise KeyError(f"stored tensor {name!r} is missing")
        return tensors[name]

    values: dict[str, Tensor] = {}
    for entry in build_catalogue(config):
        if entry.format is TensorFormat.SCALE:
            continue
        weight = stored(entry.name)
        scale_name = f"{entry.name.removesuffix('.weight')}.scale"
        if entry.format is TensorFormat.FP8_BLOCK:
            values[entry.name] = dequantize_fp8_block(weight, stored(scale_name))
        elif entry.format is TensorFormat.MXFP4:
            values[entry.name] = dequantize_mxfp4(weight, stored(scale_name))
        elif entry.format is TensorFormat.FP8_ROW:
            values[entry.name] = _dequantize_fp8_rows(weight, stored(scale_name))
        else:
            values[entry.name] = weight.float()
    return values


def _straight_through(value: Tensor, stored: Tensor) -> Tensor:
    """``stored`` in the forward, the identity's gradient to ``value`` in the backward."""
    return value + (stored - value).detach()


class ValueWeights:
    """HF-named FP32 values read by the reference forward (module docstring); names without the ``model.`` prefix.

    Args:
        values: one FP32 tensor per weight name (no ``.scale`` entries).
        fake_quant: read weights through their stored formats (straight-through; module docstring).
        bf16_names: the weights stored as BF16 (``bf16_weight_names``), rounded when ``fake_quant``.
    """

    def __init__(
        self, values: Mapping[str, Tensor], *, fake_quant: bool = False, bf16_names: Collection[str] = ()
    ) -> None:
        self._values = values
        self.fake_quant = fake_quant
        self._bf16_names = bf16_names

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._values:
            raise KeyError(f"weight {name!r} is missing from the values")
        value = self._values[name]
        if not (self.fake_quant and name in self._bf16_names):
            return value
        return _straight_through(value, value.detach().to(torch.bfloat16).float())

    def fp8(self, prefix: str) -> Tensor:
        value = self[f"{prefix}.weight"]
        if not self.fake_quant:
            return value
        with torch.no_grad():
            stored = dequantize_fp8_block(*quantize_fp8_block(value.detach().float()))
        return _straight_through(value, stored)

    def mxfp4(self, prefix: str) -> Tensor:
        value = self[f"{prefix}.weight"]
        if not self.fake_quant:
            return value
        with torch.no_grad():
            stored = dequantize_mxfp4(*quantize_mxfp4(value.detach().float()))
        return _straight_through(value, stored)

    def fp8_rows(self, prefix: str, rows: Tensor) -> Tensor:
        value = self[f"{prefix}.weight"][rows]
        if not self.fake_quant:
            return value
        with torch.no_grad():
            stored = _dequantize_fp8_rows(*quantize_fp8_per_token_group(value.detach().float(), 32))
        return _straight_through(value, stored)
