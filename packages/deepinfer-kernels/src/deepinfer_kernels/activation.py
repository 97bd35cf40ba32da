"""Public clamped SwiGLU (docs/design/model.md, "Routed experts"): validation and allocation, then the resolved
backend (one Triton kernel on NVIDIA where PyTorch launches about ten)."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["swiglu_clamped", "swiglu_clamped_fp8"]

_GROUP = 32


def _check_swiglu_arguments(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None) -> None:
    check_tensor("t", t)
    check_dtype("t", t.dtype, (torch.bfloat16, torch.float32))
    if t.dim() != 2 or t.shape[1] % 2:
        raise ValueError(f"t must be [n, 2I] with an even width, got shape {tuple(t.shape)}")
    if limit is not None and not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
        raise ValueError(f"limit must be a positive finite float or None, got {limit!r}")
    if row_weight is not None:
        check_tensor("row_weight", row_weight)
        check_dtype("row_weight", row_weight.dtype, (torch.float32,))
        if tuple(row_weight.shape) != (t.shape[0],):
            raise ValueError(f"row_weight must have shape ({t.shape[0]},), got {tuple(row_weight.shape)}")
        check_same_device(t=t, row_weight=row_weight)


def swiglu_clamped(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(min(g, λ)) · clamp(u, −λ, λ) [· w]`` with ``[g | u]`` the two halves of the last dimension, FP32.

    Args:
        t: [n, 2I] bf16/fp32, gate half first (rows from ``w1``), up half second (``w3``).
        limit: ``swiglu_limit`` λ (finite, > 0), or None for no clamping.
        row_weight: optional [n] fp32 routing weight multiplied in last, same device.

    Returns:
        [n, I] fp32.

    Raises:
        TypeError: a tensor is not a tensor or has an unsupported dtype.
        ValueError: ``t`` is not 2-D with an even width, ``row_weight`` has the wrong shape, ``limit`` is not positive
            and finite, or devices differ.
    """
    _check_swiglu_arguments(t, limit, row_weight)
    out = torch.empty((t.shape[0], t.shape[1] // 2), dtype=torch.float32, device=t.device)
    if out.numel():
        weight = None if row_weight is None else row_weight.contiguous()
        _registry.resolve("swiglu_clamped", t.device.type)(
            t.contiguous(), None if limit is None else float(limit), weight, out
        )
    return out


def swiglu_clamped_fp8(
    t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None = None, *, deinterleave: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 copy of :func:`swiglu_clamped`'s FP32 result, quantized per token and 32 columns
    (``quantize_fp8_per_token_group``) in the same kernel where the backend fuses them, for the FP8 GEMM that reads it
    (docs/design/numerics.md, "Rounding points"). Equal bit for bit to the two ops in sequence on the same backend.

    Args:
        t: [n, 2I] bf16/fp32, gate half first, ``I % 32 == 0``.
        limit: ``swiglu_limit`` λ (finite, > 0), or None for no clamping.
        row_weight: optional [n] fp32 routing weight multiplied in last, same device.
        deinterleave: store each group's codes even columns first, then odd ones (``GroupCodes`` order
            ``"deinterleaved"``, the order the grouped MXFP4 GEMM's MMA tiles read; ``mxfp4_grouped_code_order``).

    Returns:
        ``(q [n, I] float8_e4m3fn, scale [n, I/32] float8_e8m0fnu)``.
    """
    _check_swiglu_arguments(t, limit, row_weight)
    if not isinstance(deinterleave, bool):
        raise TypeError(f"deinterleave must be a bool, got {deinterleave!r}")
    half = t.shape[1] // 2
    if half % _GROUP:
        raise ValueError(f"the SwiGLU width I = {half} must be a multiple of {_GROUP} for the FP8 copy")
    q = torch.empty((t.shape[0], half), dtype=torch.float8_e4m3fn, device=t.device)
    scale = torch.empty((t.shape[0], half // _GROUP), dtype=torch.float8_e8m0fnu, device=t.device)
    if q.numel():
        weight = None if row_weight is None else row_weight.contiguous()
        _registry.resolve("swiglu_clamped_fp8", t.device.type)(
            t.contiguous(), None if limit is None else float(limit), weight, q, scale, deinterleave
        )
    return q, scale
