"""Compute mode shared by every layer: where activations are rounded and whether they are FP8-quantized.

- ``EXACT``: activations are stored in BF16 at the spec's rounding points and every FP8 GEMM input is quantized per
  token in groups of 32 (docs/design/numerics.md, "Activation quantization", "Rounding points").
- ``FP32``: weights are dequantized exactly, activations stay FP32, no activation or KV quantization. Used to compare
  the layered model against the single-file reference up to FP32 summation order.
"""

from __future__ import annotations

import enum

import torch

from deepinfer_kernels import dequantize_fp8_per_token_group, quantize_fp8_per_token_group

__all__ = ["ComputeMode", "fp8_round_trip", "round_activation"]

FP8_GROUP = 32


class ComputeMode(enum.Enum):
    """Numerics of a model instance (see the module docstring)."""

    EXACT = "exact"
    FP32 = "fp32"

    @property
    def activation_dtype(self) -> torch.dtype:
        """Storage dtype of activations between layers: BF16 (exact) or FP32."""
        return torch.bfloat16 if self is ComputeMode.EXACT else torch.float32


def round_activation(x: torch.Tensor, mode: ComputeMode) -> torch.Tensor:
    """Round ``x`` (any shape) to the mode's activation dtype (BF16 in exact mode, FP32 otherwise)."""
    return x.to(mode.activation_dtype)


def fp8_round_trip(x: torch.Tensor, mode: ComputeMode) -> torch.Tensor:
    """The value an FP8 GEMM sees for activation ``x``.

    Args:
        x: [..., K] bf16/fp32 with ``K % 32 == 0``.
        mode: exact → per-token-group FP8 quantize/dequantize (docs/design/numerics.md, "Activation quantization");
            fp32 → ``x`` as FP32.

    Returns:
        [..., K] fp32.
    """
    if mode is ComputeMode.FP32:
        return x.float()
    q, scale = quantize_fp8_per_token_group(x, FP8_GROUP)
    return dequantize_fp8_per_token_group(q, scale)
