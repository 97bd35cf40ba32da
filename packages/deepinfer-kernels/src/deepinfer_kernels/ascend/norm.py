"""Ascend RMSNorm through ``torch_npu.npu_rms_norm``."""

from __future__ import annotations

import torch

from deepinfer_kernels.ascend._npu import torch_npu

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """RMSNorm with ``torch_npu.npu_rms_norm(self, gamma, epsilon)``.

    ``npu_rms_norm`` needs ``gamma`` in ``self``'s dtype. When the dtypes already match it runs directly (the
    NPU kernel accumulates in FP32 and rounds once); otherwise both are widened to FP32 (exact) and the FP32
    result is rounded once to ``x``'s dtype. ``rstd`` (the second output) is discarded. Within 1 ulp of the
    output dtype of the reference (the NPU's rsqrt and sum order differ from it).

    Args:
        x: [num_rows, hidden_size] bf16 or fp32 on the NPU, contiguous.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square.
        out: [num_rows, hidden_size], x's dtype; written.
    """
    npu = torch_npu()
    if weight.dtype == x.dtype:
        y, _ = npu.npu_rms_norm(x, weight, epsilon=float(eps))
    else:
        y, _ = npu.npu_rms_norm(x.float(), weight.float(), epsilon=float(eps))
    out.copy_(y)
