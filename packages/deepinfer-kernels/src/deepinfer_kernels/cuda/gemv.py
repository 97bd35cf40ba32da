"""Triton GEMV-style quantized GEMMs for few rows (decode): the weight tile is decoded to FP32 in registers and
multiplied with each row by FMAs, no tensor cores (docs/design/kernels.md, "GEMM tiles and split-K").

An MMA needs its weight tile moved into the operand layout and rounded to bf16; for 1 … 16 rows per weight that
costs more than the MMA saves, and the weight stream is what bounds the time. Here each program decodes a
``[BLOCK_N, BLOCK_K]`` weight tile once, then for each of its ``ROWS`` rows multiplies it with the row's decoded
activation, sums every 32-column group, scales the group sums by the weight's power-of-two UE8M0 factor and adds them
up. Every product of an e4m3 activation with an e4m3 or e2m1 weight value is exact in FP32 (at most 8 significant
bits) and power-of-two scaling is exact, so only the FP32 summation order differs from the reference, as in
``cuda.gemm``; tests use the same bound. The order is the same for every row whatever ``ROWS`` and M (the tile's
layout does not depend on ``ROWS``), and K runs in the same fixed chunks as ``cuda.gemm`` (split-K with the same
reduction), so the bits of a row do not depend on the other rows.

FP8 weights and activations use the hardware e4m3 conversion when compiled (``NATIVE_FP8``), MXFP4 weights the PTX
decoding of ``gemm_operands.e2m1_halves`` (the same values as the bit placement); the interpreter decodes
bits (``gemm_operands.e4m3_unscaled``).

``bf16_gemv_kernel`` is the same tile for a BF16 weight (``cuda.bf16_gemm``): the weight widened to FP32, FP32
products with each row (exact for a BF16 row), each thread's running sums reduced once per K chunk, the chunks the
same fixed ones.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import fp8_token_groups
from deepinfer_kernels.cuda._launch import await_inputs
from deepinfer_kernels.cuda.gemm_operands import (
    chunk_range,
    e2m1_halves,
    e4m3_unscaled,
    finish_tile,
    group_activation,
    pow2,
)

__all__ = ["bf16_gemv_kernel", "fp8_gemv_kernel", "mxfp4_gemv_kernel"]


@triton.jit
def _add_row(acc, slots, r, group_sums):  # type: ignore[no-untyped-def]
    # Row slot r of acc [ROWS, BLOCK_N] gets the sum of group_sums [BLOCK_N, G] over its groups.
    return acc + tl.where(slots[:, None] == r, tl.sum(group_sums, axis=1)[None, :], 0.0)


@triton.jit
def _materialized(a):  # type: ignore[no-untyped-def]
    # The identity: a max over a size-1 axis. Without it the compiler derives an activation read from codes anew in
    # the weight tile's layout, so that every thread decodes and scales each code it multiplies (the 1-row 32 × 128
    # FP8 tile: 9.8 against 4.9 SASS instructions a weight element, offline sm_90); a reduction is not re-derived, so
    # the decoded activation is made once and handed over through shared memory.
    return tl.max(tl.reshape(a, (a.shape[0], a.shape[1], 1)), axis=2)


@triton.jit
def _row(order_ptr, start, end, r, groups, GROUPED: tl.constexpr):  # type: ignore[no-untyped-def]
    # Row index of slot r (position start + r of the expert order, or row start + r) and, per group of groups, whether
    # the slot has a row (a vector: the interpreter rejects masks combined from a scalar). A grouped tile always has a
    # row at start, so clamping keeps the index in range.
    valid = groups * 0 + start + r < end
    if GROUPED:
        return tl.load(order_ptr + tl.minimum(start + r, end - 1)).to(tl.int64), valid
    else:
        return (start + r).to(tl.int64), valid


@triton.jit
def fp8_gemv_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_CHUNK,
    N_PER_GROUP,
    stride_q,
    stride_qs,
    stride_w,
    stride_ws,
    stride_out,
    SPLIT_GRID: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    E4M3_BIAS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows ``pid·ROWS …`` times an FP8 32×32-block weight tile (``E4M3_BIAS``: 0 native, 8 from bits); weight rows
    are grouped by ``N_PER_GROUP`` as in ``cuda.gemm._fp8_block_kernel``. ``QUANTIZE``: ``q_ptr`` holds the BF16/FP32
    activation itself, quantized here group by group with the quantizer's code (``_formats.fp8_token_groups``: the
    same codes and scale bytes), so that no quantizer launch precedes the GEMV; ``qs_ptr`` is then not read."""
    await_inputs(PDL)
    q_ptr, qs_ptr = group_activation(q_ptr, qs_ptr, K, N_PER_GROUP, BLOCK_N)
    slots = tl.arange(0, ROWS)
    start = tl.program_id(0) * ROWS
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    groups = tl.arange(0, BLOCK_K // 32)
    within = groups[:, None] * 32 + tl.arange(0, 32)[None, :]
    w_ptrs = w_ptr + n_rows[:, None, None] * stride_w + within[None, :, :]
    ws_ptrs = ws_ptr + (n_rows // 32)[:, None] * stride_ws + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            group_ok = k0 + groups * 32 < k_end
            w_mask = n_mask[:, None] & group_ok[None, :]
            w = e4m3_unscaled(tl.load(w_ptrs + k0, mask=w_mask[:, :, None], other=0), NATIVE_FP8)
            w_factor = pow2(tl.load(ws_ptrs + k0 // 32, mask=w_mask, other=0), E4M3_BIAS)
            for r in tl.static_range(ROWS):
                row, valid = _row(q_ptr, start, M, r, groups, False)
                a_mask = group_ok & valid
                if QUANTIZE:
                    x = tl.load(q_ptr + row * stride_q + k0 + within, mask=a_mask[:, None], other=0.0)
                    codes, a_scale = fp8_token_groups(x.to(tl.float32))
                else:
                    codes = tl.load(q_ptr + row * stride_q + k0 + within, mask=a_mask[:, None], other=0)
                    a_scale = tl.load(qs_ptr + row * stride_qs + k0 // 32 + groups, mask=a_mask, other=0)
                a = e4m3_unscaled(codes, NATIVE_FP8) * pow2(a_scale, E4M3_BIAS)[:, None]
                if not QUANTIZE:
                    a = _materialized(a)
                acc = _add_row(acc, slots, r, tl.sum(w * a[None, :, :], axis=2) * w_factor)
        total += acc
    rows = (start + slots).to(tl.int64)
    finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, rows < M, n_offsets, M, N, stride_out, SPLIT_GRID)


@triton.jit
def bf16_gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_CHUNK,
    stride_x,
    stride_w,
    stride_out,
    SPLIT_GRID: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows ``pid·ROWS …`` (BF16 or FP32) times a BF16 weight tile ``[BLOCK_N, BLOCK_K]``, rounded into ``out``'s
    dtype by ``finish_tile``."""
    await_inputs(PDL)
    slots = tl.arange(0, ROWS)
    start = tl.program_id(0) * ROWS
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n_offsets.to(tl.int64)[:, None] * stride_w + cols[None, :]
    rows = (start + slots).to(tl.int64)
    x_ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        # Each thread keeps its own products' running sums over the chunk's K steps, reduced across threads once a
        # chunk: a reduction per K step cost as many shuffles and additions as FMAs (5.2 against 4.3 SASS
        # instructions a weight element at one row on 32 × 128, offline sm_90).
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            k_ok = k0 + cols < k_end
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs + k0, mask=(rows < M)[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += w[None, :, :] * x[:, None, :]
        total += tl.sum(acc, axis=2)
    finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, rows < M, n_offsets, M, N, stride_out, SPLIT_GRID)


@triton.jit
def mxfp4_gemv_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    packed_ptr,
    ws_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    order_ptr,
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    M,
    N,
    K,
    K_CHUNK,
    num_experts,
    stride_q,
    stride_qs,
    stride_pe,
    stride_p,
    stride_se,
    stride_s,
    stride_out,
    GROUPED: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    E4M3_BIAS: tl.constexpr,
    REPEATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Dense or grouped MXFP4 weight tile times up to ``ROWS`` rows (the tables and ``REPEATS`` as in
    ``cuda.gemm.mxfp4_kernel``)."""
    await_inputs(PDL)
    if GROUPED:
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert >= num_experts:
            return
        start = tl.load(block_start_ptr + tl.program_id(0))
        end = tl.load(block_end_ptr + tl.program_id(0))
        packed_ptr += expert.to(tl.int64) * stride_pe
        ws_ptr += expert.to(tl.int64) * stride_se
    else:
        start = tl.program_id(0) * ROWS
        end = M
    slots = tl.arange(0, ROWS)
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    groups = tl.arange(0, BLOCK_K // 32)
    sixteen = tl.arange(0, 16)
    # Low nibbles hold the even columns of a group, high nibbles the odd ones; the activation is read to match.
    even_columns = groups[:, None] * 32 + 2 * sixteen[None, :]
    p_ptrs = packed_ptr + n_rows[:, None, None] * stride_p + (groups[:, None] * 16 + sixteen[None, :])[None, :, :]
    s_ptrs = ws_ptr + n_rows[:, None] * stride_s + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            group_ok = k0 + groups * 32 < k_end
            w_mask = n_mask[:, None] & group_ok[None, :]
            # e2m1 values times 2^−14 (gemm_operands.e2m1_halves: four bytes per few PTX instructions when compiled);
            # the factor restores 2^14.
            w_even, w_odd = e2m1_halves(tl.load(p_ptrs + k0 // 2, mask=w_mask[:, :, None], other=0), NATIVE_FP8)
            w_even, w_odd = w_even.to(tl.float32), w_odd.to(tl.float32)
            w_factor = pow2(tl.load(s_ptrs + k0 // 32, mask=w_mask, other=0), 14)
            for r in tl.static_range(ROWS):
                row, valid = _row(order_ptr, start, end, r, groups, GROUPED)
                a_mask = (group_ok & valid)[:, None]
                a_row = row // REPEATS
                a_ptrs = q_ptr + a_row * stride_q + k0 + even_columns
                a_even = e4m3_unscaled(tl.load(a_ptrs, mask=a_mask, other=0), NATIVE_FP8)
                a_odd = e4m3_unscaled(tl.load(a_ptrs + 1, mask=a_mask, other=0), NATIVE_FP8)
                a_scale = tl.load(qs_ptr + a_row * stride_qs + k0 // 32 + groups, mask=group_ok & valid, other=0)
                a_even = _materialized(a_even * pow2(a_scale, E4M3_BIAS)[:, None])
                a_odd = _materialized(a_odd * pow2(a_scale, E4M3_BIAS)[:, None])
                pairs = w_even * a_even[None, :, :] + w_odd * a_odd[None, :, :]
                acc = _add_row(acc, slots, r, tl.sum(pairs, axis=2) * w_factor)
        total += acc
    if GROUPED:
        row_ok = start + slots < end
        rows = tl.load(order_ptr + start + slots, mask=row_ok, other=0).to(tl.int64)
    else:
        rows = (start + slots).to(tl.int64)
        row_ok = rows < M
    finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_ok, n_offsets, M, N, stride_out, SPLIT_GRID)
