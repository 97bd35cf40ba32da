"""Public RMSNorm ops (docs/design/model.md, "RMSNorm"): validation and allocation, then the resolved backend.

``rms_norm_fp8`` also returns the FP8 copy an FP8 GEMM reads (docs/design/kernels.md, "rms_norm_fp8")."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_ndim_at_least, check_same_device, check_tensor

__all__ = ["rms_norm", "rms_norm_fp8"]

_GROUP = 32
_NORM_DTYPES = (torch.bfloat16, torch.float32)


def _check_norm_arguments(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_dtype("x", x.dtype, _NORM_DTYPES)
    check_dtype("weight", weight.dtype, _NORM_DTYPES)
    check_ndim_at_least("x", x, 1)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) to match x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    check_same_device(x=x, weight=weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with FP32 statistics and product, rounded once to ``x``'s dtype.

    ``y = x · ρ · w`` with ``ρ = 1 / sqrt(Σx² / H + eps)``; FP32 throughout, one rounding at the end.

    Args:
        x: [..., H] bf16 or fp32 (any strides; copied to a contiguous layout if needed).
        weight: [H] bf16 or fp32, same device as ``x``.
        eps: positive finite float added to the mean square.

    Returns:
        [..., H] tensor with ``x``'s dtype, contiguous, on ``x``'s device.

    Raises:
        TypeError: ``x`` or ``weight`` is not a tensor or has an unsupported dtype.
        ValueError: shapes disagree, the hidden size is 0, ``eps`` is not positive and finite, or devices differ.
    """
    _check_norm_arguments(x, weight, eps)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    rows = x.reshape(-1, hidden).contiguous()
    _registry.resolve("rms_norm", x.device.type)(rows, weight.contiguous(), float(eps), out.view(-1, hidden))
    return out


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, deinterleaved_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` and the FP8 copy of its result for the FP8 GEMMs that read it, in one pass where the backend
    fuses them: ``y = rms_norm(x, weight, eps)``, ``(q, scale) = quantize_fp8_per_token_group(y)`` (docs/design/
    numerics.md, "Rounding points": the copy quantizes the rounded ``y``). Each output equals its separate op's
    bit for bit on the same backend.

    Args:
        x: [..., H] bf16 or fp32, ``H % 32 == 0``.
        weight: [H] bf16 or fp32, same device.
        eps: positive finite float added to the mean square.
        deinterleaved_out: optional [..., H] float8_e4m3fn, contiguous, same device: written with ``q``'s codes, each
            32-column group stored even columns first, then odd ones (``GroupCodes`` order ``"deinterleaved"``, for
            the grouped MXFP4 GEMM's MMA tiles), in the same launch where the backend fuses them.

    Returns:
        ``(y, q, scale)``: y [..., H] with x's dtype; q [..., H] float8_e4m3fn; scale [..., H/32] float8_e8m0fnu.
    """
    _check_norm_arguments(x, weight, eps)
    hidden = x.shape[-1]
    if hidden % _GROUP:
        raise ValueError(f"the last dimension of x ({hidden}) must be a multiple of {_GROUP} for the FP8 copy")
    if deinterleaved_out is not None:
        check_tensor("deinterleaved_out", deinterleaved_out)
        check_dtype("deinterleaved_out", deinterleaved_out.dtype, (torch.float8_e4m3fn,))
        if deinterleaved_out.shape != x.shape or not deinterleaved_out.is_contiguous():
            raise ValueError(
                f"deinterleaved_out must be contiguous with x's shape {tuple(x.shape)}, got shape "
                f"{tuple(deinterleaved_out.shape)}"
            )
        check_same_device(x=x, deinterleaved_out=deinterleaved_out)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], hidden // _GROUP), dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel():
        _registry.resolve("rms_norm_fp8", x.device.type)(
            x.reshape(-1, hidden).contiguous(),
            weight.contiguous(),
            float(eps),
            out.view(-1, hidden),
            q.view(-1, hidden),
            scale.view(-1, hidden // _GROUP),
            None if deinterleaved_out is None else deinterleaved_out.view(-1, hidden),
        )
    return out, q, scale
