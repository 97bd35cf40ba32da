"""Triton clamped SwiGLU: one program per tile of rows and columns; the reference's FP32 operations in its order with
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
_MIN_COLUMNS = 128
_GROUP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _swiglu_block(  # type: ignore[no-untyped-def]
    t_ptr, weight_ptr, rows, half, limit, HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    # The program's rows [BLOCK_R], columns [BLOCK_C], tile mask and FP32 products [BLOCK_R, BLOCK_C].
    row = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (row < rows)[:, None] & (cols < half)[None, :]
    offsets = row[:, None] * 2 * half + cols[None, :]
    gate = tl.load(t_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(t_ptr + offsets + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    if HAS_WEIGHT:
        act = act * tl.load(weight_ptr + row, mask=row < rows, other=0.0)[:, None]
    return row, cols, mask, act


@triton.jit
def _swiglu_kernel(  # type: ignore[no-untyped-def]
    t_ptr, weight_ptr, out_ptr, rows, half, limit, HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    row, cols, mask, act = _swiglu_block(t_ptr, weight_ptr, rows, half, limit, HAS_LIMIT, HAS_WEIGHT, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + row[:, None] * half + cols[None, :], act, mask=mask)


@triton.jit
def _swiglu_fp8_kernel(  # type: ignore[no-untyped-def]
    t_ptr, weight_ptr, q_ptr, scale_ptr, rows, half, limit, HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, DEINTERLEAVE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # BLOCK_C is a multiple of 32 and half too, so the program's groups are whole and start at a group boundary.
    # DEINTERLEAVE reorders each group's codes in registers, as cuda.quant's group quantizer does, so the store stays
    # contiguous.
    await_inputs(PDL)
    row, cols, mask, act = _swiglu_block(t_ptr, weight_ptr, rows, half, limit, HAS_LIMIT, HAS_WEIGHT, BLOCK_R, BLOCK_C)
    codes, scale_bytes = fp8_token_groups(tl.reshape(act, (BLOCK_R * BLOCK_C // _GROUP, _GROUP)))
    if DEINTERLEAVE:
        codes = tl.reshape(
            tl.permute(tl.reshape(codes, (BLOCK_R * BLOCK_C // _GROUP, _GROUP // 2, 2)), (0, 2, 1)), codes.shape
        )
    tl.store(q_ptr + row[:, None] * half + cols[None, :], tl.reshape(codes, (BLOCK_R, BLOCK_C)), mask=mask)
    groups = tl.program_id(1) * (BLOCK_C // _GROUP) + tl.arange(0, BLOCK_C // _GROUP)
    scale_mask = (row < rows)[:, None] & (groups * _GROUP < half)[None, :]
    scale_ptrs = scale_ptr + row[:, None] * (half // _GROUP) + groups[None, :]
    tl.store(scale_ptrs, tl.reshape(scale_bytes, (BLOCK_R, BLOCK_C // _GROUP)), mask=scale_mask)


def _tile(rows: int, half: int) -> tuple[tuple[int, int], dict[str, int]]:
    """Grid and tile of up to ``_BLOCK`` values a program: the widest power-of-two column block of at least
    ``_MIN_COLUMNS`` up to ``_BLOCK`` that divides ``half``, else the row in blocks of ``_BLOCK`` (the last one
    masked), and as many rows as fill the rest. The scaled preset's 2,304 columns take 256-column blocks of 4 rows:
    a 1,024-column block left three quarters of every row's third program masked."""
    widest = min(_BLOCK, triton.next_power_of_2(half))
    block_c = next((c for c in (widest >> i for i in range(4)) if c >= _MIN_COLUMNS and half % c == 0), widest)
    block_r = min(_BLOCK // block_c, triton.next_power_of_2(rows))
    return (triton.cdiv(rows, block_r), triton.cdiv(half, block_c)), {"BLOCK_R": block_r, "BLOCK_C": block_c}


def swiglu_clamped(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None, out: torch.Tensor) -> None:
    """Triton SwiGLU (arguments as ``reference.activation.swiglu_clamped``; contiguous inputs)."""
    check_launchable(t=t, out=out)
    rows, half = out.shape
    grid, tile = _tile(rows, half)
    _swiglu_kernel[grid](
        t,
        out if row_weight is None else row_weight,  # an unread placeholder pointer without weights
        out,
        rows,
        half,
        0.0 if limit is None else limit,
        HAS_LIMIT=limit is not None,
        HAS_WEIGHT=row_weight is not None,
        **tile,
        enable_fp_fusion=False,
        **dependent_launch(out.device),
    )


def swiglu_clamped_fp8(
    t: torch.Tensor,
    limit: float | None,
    row_weight: torch.Tensor | None,
    q: torch.Tensor,
    scale: torch.Tensor,
    deinterleave: bool = False,
) -> None:
    """Triton SwiGLU with the FP32 products quantized per token and 32 columns in the same kernel (arguments as
    ``reference.activation.swiglu_clamped_fp8``; contiguous inputs, ``I % 32 == 0``)."""
    check_launchable(t=t, q=q, scale=scale)
    rows, half = q.shape
    grid, tile = _tile(rows, half)
    _swiglu_fp8_kernel[grid](
        t,
        t if row_weight is None else row_weight,  # an unread placeholder pointer without weights
        q.view(torch.uint8),
        scale.view(torch.uint8),
        rows,
        half,
        0.0 if limit is None else limit,
        HAS_LIMIT=limit is not None,
        HAS_WEIGHT=row_weight is not None,
        **tile,
        DEINTERLEAVE=deinterleave,
        enable_fp_fusion=False,
        **dependent_launch(q.device),
    )
