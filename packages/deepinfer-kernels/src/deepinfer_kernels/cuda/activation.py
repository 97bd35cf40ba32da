"""Triton clamped SwiGLU: one program per (row, block of columns); the reference's FP32 operations in its order with
IEEE division and no FMA contraction, so only ``exp`` may differ from the reference (in its last bits). The FP8
variant quantizes the FP32 products per 32 columns in the same program (docs/design/kernels.md,
"swiglu_clamped_fp8")."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import fp8_token_groups
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch

__all__ = ["swiglu_clamped", "swiglu_clamped_fp8"]

_BLOCK = 1024
_GROUP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _swiglu_block(  # type: ignore[no-untyped-def]
    t_ptr, weight_ptr, half, limit, HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr
):
    # The program's row, columns, column mask and FP32 products.
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
    return row, cols, mask, act


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
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row, cols, mask, act = _swiglu_block(t_ptr, weight_ptr, half, limit, HAS_LIMIT, HAS_WEIGHT, BLOCK)
    tl.store(out_ptr + row * half + cols, act, mask=mask)


@triton.jit
def _swiglu_fp8_kernel(  # type: ignore[no-untyped-def]
    t_ptr,
    weight_ptr,
    q_ptr,
    scale_ptr,
    half,
    limit,
    HAS_LIMIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # BLOCK is a multiple of 32 and half too, so the program's groups are whole and start at a group boundary.
    await_inputs(PDL)
    row, cols, mask, act = _swiglu_block(t_ptr, weight_ptr, half, limit, HAS_LIMIT, HAS_WEIGHT, BLOCK)
    codes, scale_bytes = fp8_token_groups(tl.reshape(act, (BLOCK // _GROUP, _GROUP)))
    tl.store(q_ptr + row * half + cols, tl.reshape(codes, (BLOCK,)), mask=mask)
    groups = tl.program_id(1) * (BLOCK // _GROUP) + tl.arange(0, BLOCK // _GROUP)
    tl.store(scale_ptr + row * (half // _GROUP) + groups, scale_bytes, mask=groups * _GROUP < half)


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
        **dependent_launch(out.device),
    )


def swiglu_clamped_fp8(
    t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None, q: torch.Tensor, scale: torch.Tensor
) -> None:
    """Triton SwiGLU with the FP32 products quantized per token and 32 columns in the same kernel (arguments as
    ``reference.activation.swiglu_clamped_fp8``; contiguous inputs, ``I % 32 == 0``)."""
    check_launchable(t=t, q=q, scale=scale)
    rows, half = q.shape
    block = min(_BLOCK, triton.next_power_of_2(half))
    _swiglu_fp8_kernel[(rows, triton.cdiv(half, block))](
        t,
        t if row_weight is None else row_weight,  # an unread placeholder pointer without weights
        q.view(torch.uint8),
        scale.view(torch.uint8),
        half,
        0.0 if limit is None else limit,
        HAS_LIMIT=limit is not None,
        HAS_WEIGHT=row_weight is not None,
        BLOCK=block,
        enable_fp_fusion=False,
        **dependent_launch(q.device),
    )
