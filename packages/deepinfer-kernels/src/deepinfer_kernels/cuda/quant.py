"""Triton FP8 / MXFP4 (de)quantization kernels, bit-exact with ``reference.quant``.

FP8 and scale tensors are passed to the kernels as uint8 views; every encode is integer arithmetic on bit patterns
(``cuda._formats``). The FP8 dequantizers decode e4m3 and round to bf16 by the hardware's conversions when compiled
(``NATIVE``: sm_89 and newer, as the GEMMs' ``NATIVE_FP8``), 9–10 SASS instructions an element against 31–33 for the
bit arithmetic the interpreter runs; both give the reference's bits (a NaN stays a NaN, of the platform's payload).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import (
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e4m3_value,
    exp2_int,
    fp8_group_values,
    fp8_token_groups,
    scale_exponent,
    to_output_dtype,
    to_output_dtype_native,
    ue8m0_decode,
)
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.gemm_operands import native_fp8
from deepinfer_kernels.cuda.rope import HeadRotation, rotated_head_tails

__all__ = [
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_mxfp4",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_mxfp4",
    "quantized_values",
    "rotated_copy",
]

_BLOCK = 32
_ROWS_PER_PROGRAM = 16
# Blocks of a 32-row block row per FP8 block dequantizer program (32 x 128 values, 16 a thread with 8 warps).
_BLOCKS_PER_PROGRAM = 4
_WIDE_ROWS = 64
# Warps of a quantized_values program at every tile: on the wide tiles four took 454 against 496 µs for the MoE's
# sorted copy of an 8K prompt (49,152 × 5,120) and 214 against 227 µs at 2,304 columns, the same bits (one H100,
# thirtieth session; benchmarks/kernels_quant.py, "values-sorted", kernels_quant-h100-s30*.json).
_VALUES_WARPS = 4
_WIDE_GROUPS = 8
_FP8_AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-4)
_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
_FP4_AMAX_FLOOR: tl.constexpr = tl.constexpr(6.0 * 2.0**-126)
_E2M1_MAX: tl.constexpr = tl.constexpr(6.0)


@triton.jit
def _quantize_fp8_block_kernel(  # type: ignore[no-untyped-def]
    w_ptr, q_ptr, scale_ptr, rows, cols, stride_w, stride_q, stride_scale, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    await_inputs(PDL)
    block_row = tl.program_id(0)
    block_col = tl.program_id(1)
    r = (block_row * BLOCK + tl.arange(0, BLOCK)[:, None]).to(tl.int64)
    c = block_col * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    w = tl.load(w_ptr + r * stride_w + c, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    exponent = scale_exponent(amax, _FP8_AMAX_FLOOR, _E4M3_MAX)
    tl.store(q_ptr + r * stride_q + c, e4m3_encode(w * exp2_int(-exponent)), mask=mask)
    tl.store(scale_ptr + block_row * stride_scale + block_col, (exponent + 127).to(tl.uint8))


@triton.jit
def _dequantize_fp8_block_kernel(  # type: ignore[no-untyped-def]
    q_ptr, scale_ptr, out_ptr, rows, cols, stride_q, stride_scale, stride_out,
    BLOCK: tl.constexpr, BLOCKS: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One block row and BLOCKS blocks along it: each column takes its own block's factor.
    await_inputs(PDL)
    block_row = tl.program_id(0)
    r = (block_row * BLOCK + tl.arange(0, BLOCK)[:, None]).to(tl.int64)
    c = tl.program_id(1) * BLOCKS * BLOCK + tl.arange(0, BLOCKS * BLOCK)[None, :]
    mask = (r < rows) & (c < cols)
    factor = ue8m0_decode(tl.load(scale_ptr + block_row * stride_scale + c // BLOCK, mask=c < cols, other=127))
    value = e4m3_value(tl.load(q_ptr + r * stride_q + c, mask=mask, other=0), NATIVE) * factor
    tl.store(out_ptr + r * stride_out + c, to_output_dtype_native(value, out_ptr, NATIVE), mask=mask)


@triton.jit
def group_tile(rows, groups, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr):  # type: ignore[no-untyped-def]
    # Rows [R] (int64), groups [G] and columns [G, GROUP] of this program's tile, with the masks of its rows [R] and of
    # its elements [R, G, GROUP].
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    g = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    c = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    row_mask = r < rows
    return r, g, c, row_mask, row_mask[:, None, None] & (g < groups)[None, :, None]


@triton.jit
def _quantize_group_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, scale_ptr, rows, groups, stride_x, stride_q, stride_scale,
    GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # DEINTERLEAVE: each group's codes are stored even columns first, then odd ones
    # (cuda.gemm.deinterleaved_activation). They are reordered in registers so the store stays contiguous: permuted
    # byte addresses made the quantizer 10x slower on the H200 (kernels_quant-h200-dc3a5be.json).
    await_inputs(PDL)
    r, g, c, row_mask, mask = group_tile(rows, groups, GROUP, BLOCK_ROWS, BLOCK_GROUPS)
    x = tl.load(x_ptr + r[:, None, None] * stride_x + c[None, :, :], mask=mask, other=0.0).to(tl.float32)
    q, scale_bytes = fp8_token_groups(tl.reshape(x, (BLOCK_ROWS * BLOCK_GROUPS, GROUP)))
    if DEINTERLEAVE:
        q = tl.reshape(tl.permute(tl.reshape(q, (BLOCK_ROWS * BLOCK_GROUPS, GROUP // 2, 2)), (0, 2, 1)), q.shape)
    tl.store(
        q_ptr + r[:, None, None] * stride_q + c[None, :, :], tl.reshape(q, (BLOCK_ROWS, BLOCK_GROUPS, GROUP)), mask=mask
    )
    scale_mask = row_mask[:, None] & (g < groups)[None, :]
    scale_bytes = tl.reshape(scale_bytes, (BLOCK_ROWS, BLOCK_GROUPS))
    tl.store(scale_ptr + r[:, None] * stride_scale + g[None, :], scale_bytes, mask=scale_mask)


@triton.jit
def _quantized_values_kernel(  # type: ignore[no-untyped-def]
    x_ptr, order_ptr, out_ptr, cos_ptr, sin_ptr, rows, groups, repeats, stride_x, stride_out,
    BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, GATHER: tl.constexpr, WORD_PAIRS: tl.constexpr,
    ROTATE: tl.constexpr, HEAD_WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # out[p, 32g + c] = x̂[source row, 32g + column c]: the source row order[p] // repeats (GATHER) or p, the column c
    # or word_pair_columns(32)[c] (WORD_PAIRS). A group's amax and codes do not depend on the order of its columns, so
    # the group is loaded and stored contiguously and its values reordered in registers (loading the permuted columns
    # took every element as a 2-byte load of its own). ROTATE (rows in order): x̂ of x with the last ROPE_DIM columns
    # of each head of HEAD_WIDTH columns rotated in FP32 first (rope.rotated_head_tails).
    await_inputs(PDL)
    r, _, c, row_mask, mask = group_tile(rows, groups, 32, BLOCK_ROWS, BLOCK_GROUPS)
    source = r
    if GATHER:
        source = tl.load(order_ptr + r, mask=row_mask, other=0).to(tl.int64) // repeats
    x = tl.load(x_ptr + source[:, None, None] * stride_x + c[None, :, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        x = rotated_head_tails(x, r, c, row_mask, cos_ptr, sin_ptr, HEAD_WIDTH, ROPE_DIM)
    value = to_output_dtype(fp8_group_values(tl.reshape(x, (BLOCK_ROWS * BLOCK_GROUPS, 32))), out_ptr)
    if WORD_PAIRS:
        # Column w·8 + o0·4 + p·2 + o1 goes to place o1·16 + o0·8 + w·2 + p (word_pair_columns).
        value = tl.reshape(
            tl.permute(tl.reshape(value, (BLOCK_ROWS * BLOCK_GROUPS, 4, 2, 2, 2)), (0, 4, 2, 1, 3)), value.shape
        )
    tl.store(out_ptr + r[:, None, None] * stride_out + c[None, :, :], tl.reshape(value, x.shape), mask=mask)


@triton.jit
def _rotated_copy_kernel(  # type: ignore[no-untyped-def]
    x_ptr, cos_ptr, sin_ptr, out_ptr, rows, groups, stride_x, stride_out,
    BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, HEAD_WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # out = x in FP32 with each head's tail rotated (rope.rotated_head_tails), the tiles of _quantized_values_kernel.
    await_inputs(PDL)
    r, _, c, row_mask, mask = group_tile(rows, groups, 32, BLOCK_ROWS, BLOCK_GROUPS)
    x = tl.load(x_ptr + r[:, None, None] * stride_x + c[None, :, :], mask=mask, other=0.0).to(tl.float32)
    x = rotated_head_tails(x, r, c, row_mask, cos_ptr, sin_ptr, HEAD_WIDTH, ROPE_DIM)
    tl.store(out_ptr + r[:, None, None] * stride_out + c[None, :, :], x, mask=mask)


@triton.jit
def _dequantize_group_kernel(  # type: ignore[no-untyped-def]
    q_ptr, scale_ptr, out_ptr, rows, groups, stride_q, stride_scale, stride_out,
    GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_GROUPS: tl.constexpr, NATIVE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    r, g, c, row_mask, mask = group_tile(rows, groups, GROUP, BLOCK_ROWS, BLOCK_GROUPS)
    scale_mask = row_mask[:, None] & (g < groups)[None, :]
    factor = ue8m0_decode(tl.load(scale_ptr + r[:, None] * stride_scale + g[None, :], mask=scale_mask, other=127))
    codes = tl.load(q_ptr + r[:, None, None] * stride_q + c[None, :, :], mask=mask, other=0)
    value = e4m3_value(codes, NATIVE) * factor[:, :, None]
    out = to_output_dtype_native(value, out_ptr, NATIVE)
    tl.store(out_ptr + r[:, None, None] * stride_out + c[None, :, :], out, mask=mask)


@triton.jit
def _dequantize_mxfp4_kernel(  # type: ignore[no-untyped-def]
    packed_ptr,
    scale_ptr,
    out_ptr,
    rows,
    stride_packed,
    stride_scale,
    stride_out,
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    group = tl.program_id(1)
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = r < rows
    mask = row_mask[:, None]
    byte_index = group * 16 + tl.arange(0, 16)[None, :]
    raw = tl.load(packed_ptr + r[:, None] * stride_packed + byte_index, mask=mask, other=0).to(tl.int32) & 0xFF
    factor = ue8m0_decode(tl.load(scale_ptr + r * stride_scale + group, mask=row_mask, other=127))[:, None]
    # Interleave (low, high) nibbles in registers so the 32 outputs of a group are stored contiguously.
    values = tl.reshape(tl.join(e2m1_decode(raw & 0xF), e2m1_decode(raw >> 4)), (BLOCK_ROWS, 32)) * factor
    columns = group * 32 + tl.arange(0, 32)[None, :]
    tl.store(out_ptr + r[:, None] * stride_out + columns, to_output_dtype(values, out_ptr), mask=mask)


@triton.jit
def _quantize_mxfp4_kernel(  # type: ignore[no-untyped-def]
    w_ptr,
    packed_ptr,
    scale_ptr,
    rows,
    stride_w,
    stride_packed,
    stride_scale,
    BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    group = tl.program_id(1)
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_mask = r < rows
    mask = row_mask[:, None]
    columns = group * 32 + tl.arange(0, 32)[None, :]
    w = tl.load(w_ptr + r[:, None] * stride_w + columns, mask=mask, other=0.0).to(tl.float32)
    exponent = scale_exponent(tl.max(tl.abs(w), axis=1), _FP4_AMAX_FLOOR, _E2M1_MAX)
    codes = e2m1_encode(w * exp2_int(-exponent)[:, None])
    even, odd = tl.split(tl.reshape(codes, (BLOCK_ROWS, 16, 2)))
    byte_index = group * 16 + tl.arange(0, 16)[None, :]
    tl.store(packed_ptr + r[:, None] * stride_packed + byte_index, (even | (odd << 4)).to(tl.uint8), mask=mask)
    tl.store(scale_ptr + r * stride_scale + group, (exponent + 127).to(tl.uint8), mask=row_mask)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _warps(groups_per_program: int) -> int:
    # 16 values a thread on the wide tiles: the quantizer takes 78 registers a thread (150 with 4 warps; sm_90).
    return 8 if groups_per_program > 1 else 4


def _group_grid(rows: int, groups: int) -> tuple[tuple[int, int], int]:
    """(grid, groups per program) of the per-token-group kernels: one group a program up to
    :data:`_WIDE_ROWS` rows (decode: many small programs), :data:`_WIDE_GROUPS` beyond (an 8K-token activation of
    5,120 columns is then 10,240 programs of 4,096 values instead of 81,920 of 512). The values do not depend on it."""
    per_program = _WIDE_GROUPS if rows > _WIDE_ROWS else 1
    return (triton.cdiv(rows, _ROWS_PER_PROGRAM), triton.cdiv(groups, per_program)), per_program


def quantize_fp8_block(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Triton 32×32-block e4m3 quantization; one program per block (contract of ``reference.quant``).

    Args:
        w: [out, in] bf16/fp16/fp32, contiguous.
        q: [out, in] float8_e4m3fn, contiguous; written.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu, contiguous; written.
    """
    check_launchable(w=w, q=q, scale=scale)
    rows, cols = w.shape
    grid = (scale.shape[0], scale.shape[1])
    _quantize_fp8_block_kernel[grid](
        w,
        _bytes(q),
        _bytes(scale),
        rows,
        cols,
        w.stride(0),
        q.stride(0),
        scale.stride(0),
        BLOCK=_BLOCK,
        **dependent_launch(w.device),
    )


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Triton 32×32-block e4m3 dequantization (contract of ``reference.quant.dequantize_fp8_block``); one program per
    32 rows × 4 blocks.

    Args:
        q: [out, in] float8_e4m3fn, contiguous.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu, contiguous.
        out: [out, in] fp32/bf16/fp16, contiguous; written.
    """
    check_launchable(q=q, scale=scale, out=out)
    rows, cols = q.shape
    grid = (scale.shape[0], triton.cdiv(scale.shape[1], _BLOCKS_PER_PROGRAM))
    _dequantize_fp8_block_kernel[grid](
        _bytes(q), _bytes(scale), out, rows, cols, q.stride(0), scale.stride(0), out.stride(0),
        BLOCK=_BLOCK, BLOCKS=_BLOCKS_PER_PROGRAM, NATIVE=native_fp8(), num_warps=8,
        **dependent_launch(q.device),
    )  # fmt: skip


def quantize_fp8_per_token_group(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, deinterleave: bool = False
) -> None:
    """Triton per-token-group e4m3 activation quantization; one program per 16 rows and one group (8 groups beyond
    64 rows).

    Args:
        x: [num_rows, K] bf16/fp16/fp32, contiguous.
        q: [num_rows, K] float8_e4m3fn, contiguous; written.
        scale: [num_rows, K // group_size] float8_e8m0fnu, contiguous; written.
        deinterleave: store each group's codes even columns first, then odd ones (the order ``cuda.gemm``'s MXFP4
            kernels read; the values are those of the column order).
    """
    check_launchable(x=x, q=q, scale=scale)
    rows, cols = x.shape
    groups = scale.shape[1]
    grid, per_program = _group_grid(rows, groups)
    _quantize_group_kernel[grid](
        x, _bytes(q), _bytes(scale), rows, groups, x.stride(0), q.stride(0), scale.stride(0),
        GROUP=cols // groups, BLOCK_ROWS=_ROWS_PER_PROGRAM, BLOCK_GROUPS=per_program, DEINTERLEAVE=deinterleave,
        num_warps=_warps(per_program),
        **dependent_launch(x.device),
    )  # fmt: skip


def quantized_values(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    order: torch.Tensor | None = None,
    word_pairs: bool = False,
    repeats: int = 1,
    rotation: HeadRotation | None = None,
) -> None:
    """Triton ``x̂``: the per-token 32-column e4m3 quantization of :func:`quantize_fp8_per_token_group` and its exact
    dequantization (``dequantize_fp8_per_token_group``) in one launch, the codes never stored; the tiles of
    :func:`quantize_fp8_per_token_group`.

    Args:
        x: [R, K] bf16/fp16/fp32, unit column stride, ``K % 32 == 0``.
        out: [M, K] bf16/fp32, unit column stride; written. Row p is ``x̂[order[p] // repeats]``, else ``x̂[p]``
            (M = R).
        order: [M] int64 rows of a product whose row i reads x's row ``i // repeats``, or None.
        word_pairs: each 32-column group's columns in ``gemm_operands.word_pair_columns`` order (the ``swap_bf16``
            decoding's), else in column order.
        repeats: product rows per row of x (with ``order``; a MoE's top-k rows of a token).
        rotation: x̂ of x with each head's tail rotated first in FP32, bit for bit ``apply_rope`` into an FP32 copy
            (without ``order``).
    """
    check_launchable(x=x, out=out)
    if rotation is not None and order is not None:
        raise ValueError("quantized_values rotates rows in their own order only: pass rotation or order, not both")
    rows, cols = out.shape
    grid, per_program = _group_grid(rows, cols // 32)
    # The head shape is constexpr (a model has one): a column's place in its head is then constant arithmetic (a mask
    # at a power-of-two width), not a runtime division.
    cos, sin, head_width = rotation if rotation is not None else (x, x, 0)
    _quantized_values_kernel[grid](
        x, order if order is not None else x, out, cos, sin, rows, cols // 32, repeats, x.stride(0), out.stride(0),
        BLOCK_ROWS=_ROWS_PER_PROGRAM, BLOCK_GROUPS=per_program, GATHER=order is not None, WORD_PAIRS=word_pairs,
        ROTATE=rotation is not None, HEAD_WIDTH=head_width, ROPE_DIM=2 * cos.shape[1] if rotation is not None else 0,
        num_warps=_VALUES_WARPS,
        **dependent_launch(x.device),
    )  # fmt: skip


def rotated_copy(x: torch.Tensor, rotation: HeadRotation) -> torch.Tensor:
    """x [M, K] (bf16/fp32, unit column stride, ``K % 32 == 0``) in FP32 with each head's tail rotated, bit for bit
    ``apply_rope`` into an FP32 copy, in one launch (the activation of the tiles that do not read ``x̂``)."""
    check_launchable(x=x, cos=rotation.cos, sin=rotation.sin)
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    # Eight groups a program at every row count, and no more rows than there are: a decode step's wo_a input (one
    # row of 32,768 columns) is then 128 programs, not 1,024 programs of one live row in sixteen.
    block_rows = min(_ROWS_PER_PROGRAM, triton.next_power_of_2(max(rows, 1)))
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols // 32, _WIDE_GROUPS))
    _rotated_copy_kernel[grid](
        x, rotation.cos, rotation.sin, out, rows, cols // 32, x.stride(0), out.stride(0), BLOCK_ROWS=block_rows,
        BLOCK_GROUPS=_WIDE_GROUPS, HEAD_WIDTH=rotation.head_width, ROPE_DIM=2 * rotation.cos.shape[1],
        num_warps=_VALUES_WARPS,
        **dependent_launch(x.device),
    )  # fmt: skip
    return out


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Triton per-token-group e4m3 dequantization (contract of ``reference.quant``); the tiles of
    :func:`quantize_fp8_per_token_group`.

    Args:
        q: [num_rows, K] float8_e4m3fn (or its uint8 view), unit column stride.
        scale: [num_rows, K // group_size] float8_e8m0fnu (or uint8), unit column stride.
        out: [num_rows, K] fp32/bf16/fp16, unit column stride; written.
    """
    check_launchable(q=q, scale=scale, out=out)
    rows, cols = q.shape
    groups = scale.shape[1]
    grid, per_program = _group_grid(rows, groups)
    _dequantize_group_kernel[grid](
        _bytes(q), _bytes(scale), out, rows, groups, q.stride(0), scale.stride(0), out.stride(0),
        GROUP=cols // groups, BLOCK_ROWS=_ROWS_PER_PROGRAM, BLOCK_GROUPS=per_program, NATIVE=native_fp8(),
        num_warps=_warps(per_program),
        **dependent_launch(q.device),
    )  # fmt: skip


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Triton MXFP4 dequantization; one program per (16 rows, 32 columns).

    Args:
        packed: [out, in / 2] int8, contiguous (low nibble = even element).
        scale: [out, in / 32] float8_e8m0fnu, contiguous.
        out: [out, in] fp32/bf16/fp16, contiguous; written.
    """
    check_launchable(packed=packed, scale=scale, out=out)
    rows = packed.shape[0]
    grid = (triton.cdiv(rows, _ROWS_PER_PROGRAM), scale.shape[1])
    _dequantize_mxfp4_kernel[grid](
        _bytes(packed),
        _bytes(scale),
        out,
        rows,
        packed.stride(0),
        scale.stride(0),
        out.stride(0),
        BLOCK_ROWS=_ROWS_PER_PROGRAM,
        **dependent_launch(packed.device),
    )


def quantize_mxfp4(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Triton MXFP4 quantization; one program per (16 rows, 32 columns) (contract of ``reference.quant``).

    Args:
        w: [out, in] bf16/fp16/fp32, contiguous, ``in % 32 == 0``.
        packed: [out, in / 2] int8, contiguous; written (low nibble = even element).
        scale: [out, in / 32] float8_e8m0fnu, contiguous; written.
    """
    check_launchable(w=w, packed=packed, scale=scale)
    rows = w.shape[0]
    grid = (triton.cdiv(rows, _ROWS_PER_PROGRAM), scale.shape[1])
    _quantize_mxfp4_kernel[grid](
        w,
        _bytes(packed),
        _bytes(scale),
        rows,
        w.stride(0),
        packed.stride(0),
        scale.stride(0),
        BLOCK_ROWS=_ROWS_PER_PROGRAM,
        **dependent_launch(w.device),
    )
