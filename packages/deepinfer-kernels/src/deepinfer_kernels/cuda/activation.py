"""Triton clamped SwiGLU: one program per (row, block of columns); the reference's FP32 operations in its order with
IEEE division and no FMA contraction, so only ``exp`` may differ from the reference (in its last bits)."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import check_launchable

__all__ = ["swiglu_clamped"]

_BLOCK = 1024


@triton.jit
def _swiglu_kernel(  # type: ignore[no-untyped-def]
    t_ptr,
    weight_ptr,
    out_ptr,
    half,
    limit,
    HAS_LIMIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half
    gate = tl.load(t_ptr + row * 2 * half + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(t_ptr + row * 2 * half + half + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    if HAS_WEIGHT:
        act = act * tl.load(weight_ptr + row)
    tl.store(out_ptr + row * half + cols, act, mask=mask)


def swiglu_clamped(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None, out: torch.Tensor) -> None:
    """Triton SwiGLU (arguments as ``reference.activation.swiglu_clamped``; contiguous inputs)."""
    check_launchable(t=t, out=out)
    rows, half = out.shape
    block = min(_BLOCK, triton.next_power_of_2(half))
    _swiglu_kernel[(rows, triton.cdiv(half, block))](
        t,
        out if row_weight is None else row_weight,  # an unread placeholder pointer without weights
        out,
        half,
        0.0 if limit is None else limit,
        HAS_LIMIT=limit is not None,
        HAS_WEIGHT=row_weight is not None,
        BLOCK=block,
        enable_fp_fusion=False,
    )
