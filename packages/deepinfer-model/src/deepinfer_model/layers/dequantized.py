"""Dequantized copies of stored FP8 / MXFP4 weights, kept while the stored bytes are unchanged.

Who keeps them:

- FP32 mode, on every device: its definition is "dequantize once, compute in FP32"
  (docs/design/numerics.md, "Compute modes").
- Exact mode, only for weights on the CPU. There the kernels' reference GEMMs serve every call, and they would
  dequantize the whole weight each time (most of a CPU decode step on the tiny checkpoint); the layers instead
  hand the kept copy to ``deepinfer_kernels.dequantized_gemm`` / ``dequantized_grouped_gemm``, which run the same
  arithmetic on it, so results are bit-identical. On CUDA the Triton GEMMs read the stored format directly and
  nothing is kept.

The dequantized weight is a pure function of the stored tensors, so this is a model-layer cache rather than a kernel
concern: the kernels define the math (``dequantize_*`` and the GEMMs), the layers decide what to keep.

Memory: 4 bytes per weight element, i.e. 4x an FP8 weight and 8x a packed MXFP4 one, on top of the stored
tensors. The tiny checkpoint's 5.9 M FP8 and 5.9 M FP4 weight elements take about 47 MB; a full-size checkpoint
is not meant to run on the CPU.

Staleness: an entry remembers, for every stored tensor it was computed from, the tensor's storage address and its
autograd version counter. Any in-place write through the parameter or a view of it (``copy_``, index assignment,
``detach().view(...)`` byte copies such as EPLB's rearrangement) bumps the version, and the entry is recomputed on
its next use. Writes through ``param.data``, and any write to a tensor created under ``torch.inference_mode`` (which
keeps no version counter), go unseen, so the weight loaders and ``set_local_experts`` also call
:meth:`DequantizedCache.clear`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from deepinfer_model.layers.mode import ComputeMode

__all__ = ["DequantizedCache"]

_Stamp = tuple[tuple[int, int], ...]


def _stamp(sources: tuple[torch.Tensor, ...]) -> _Stamp:
    # Inference tensors keep no version counter: for them only the explicit clear() applies.
    return tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in sources)


class DequantizedCache:
    """Dequantized weights of one layer, by key, each valid while its stored tensors keep their stamp.

    Args:
        mode: the layer's compute mode (FP32 keeps on every device, exact only on the CPU).
    """

    def __init__(self, mode: ComputeMode) -> None:
        self.mode = mode
        self._values: dict[Hashable, tuple[_Stamp, torch.Tensor]] = {}

    def keeps(self, device: torch.device) -> bool:
        """Whether weights stored on ``device`` are kept (see the module docstring)."""
        return self.mode is ComputeMode.FP32 or device.type == "cpu"

    def get(
        self, key: Hashable, sources: tuple[torch.Tensor, ...], compute: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The dequantized weight under ``key``: the kept copy if ``sources`` are unchanged since it was computed,
        else ``compute()`` (kept when :meth:`keeps` says so for the sources' device).

        Args:
            key: which weight of the layer.
            sources: the stored tensors ``compute`` reads (parameters, not ``.data`` views).
            compute: dequantizes ``sources``.
        """
        if not self.keeps(sources[0].device):
            return compute()
        stamp = _stamp(sources)
        entry = self._values.get(key)
        if entry is not None and entry[0] == stamp:
            return entry[1]
        value = compute()
        self._values[key] = (stamp, value)
        return value

    def clear(self) -> None:
        """Forget every kept weight (the stored tensors were written through ``.data``)."""
        self._values.clear()
