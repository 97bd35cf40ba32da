"""Public MoE combine op (docs/design/model.md, "MoE combine"): validation and allocation, then the resolved backend
(docs/design/kernels.md, "moe_combine")."""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import FLOAT_DTYPES, OUT_DTYPES, check_dtype, check_same_device, check_tensor

__all__ = ["moe_combine"]


def moe_combine(routed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``out = round(((b + routed[:, 0]) + routed[:, 1]) + … + routed[:, k−1])``: every term widened to FP32 (exact),
    added in this order in FP32, rounded once to ``out_dtype`` (nearest even). ``b`` is ``bias`` or +0.

    Args:
        routed: [n, k, H] bf16, fp16 or fp32, the chosen experts' outputs in top-k order.
        bias: [n, H] bf16, fp16 or fp32 added first (the shared expert's output), or None.
        out_dtype: float32, bfloat16 or float16.

    Returns:
        [n, H] tensor of ``out_dtype``, contiguous.

    Raises:
        TypeError: a tensor or dtype is not allowed.
        ValueError: shapes disagree or devices differ.
    """
    check_tensor("routed", routed)
    check_dtype("routed", routed.dtype, FLOAT_DTYPES)
    check_dtype("out_dtype", out_dtype, OUT_DTYPES)
    if routed.dim() != 3:
        raise ValueError(f"routed must have shape [n, k, H], got {tuple(routed.shape)}")
    n, _, hidden = routed.shape
    if bias is not None:
        check_tensor("bias", bias)
        check_dtype("bias", bias.dtype, FLOAT_DTYPES)
        if tuple(bias.shape) != (n, hidden):
            raise ValueError(
                f"bias must have shape {(n, hidden)} to match routed {tuple(routed.shape)}, got {tuple(bias.shape)}"
            )
        check_same_device(routed=routed, bias=bias)
    out = torch.empty((n, hidden), dtype=out_dtype, device=routed.device)
    if out.numel() == 0:
        return out
    _registry.resolve("moe_combine", routed.device.type)(
        routed.contiguous(), None if bias is None else bias.contiguous(), out
    )
    return out
