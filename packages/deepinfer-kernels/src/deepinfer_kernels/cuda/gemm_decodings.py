"""The chunk sums of a quantized GEMM's MMA tile for the operand decodings other than the kernels' own scaled-BF16
loop: ``tl.dot_scaled`` (``"dot_scaled"``), unscaled FP16 per 32-column group (``"group_fp16"``) and the weight-first
MMA (``"swap_ab"``, MXFP4 only). ``cuda.gemm``'s kernels call them with their tile's rows, columns and K chunks
(docs/design/kernels.md, "GEMM tiles and split-K"); each returns the tile's FP32 sum over the program's chunks, the
chunks summed from zero and added in order (``gemm_operands.chunk_range``).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda.gemm_operands import (
    chunk_range,
    e2m1_halves,
    e2m1_word_pairs,
    e4m3_half,
    e4m3_unscaled,
    operand,
    pow2,
    word_pair_columns,
)

__all__ = ["dot_scaled_tiles", "group_fp16_tiles", "swapped_tiles"]


@triton.jit
def dot_scaled_tiles(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    rows,
    row_mask,
    n_rows,
    n_mask,
    scale_rows,
    groups,
    K,
    K_CHUNK,
    stride_q,
    stride_qs,
    stride_w,
    PER_BYTE: tl.constexpr,
    stride_ws,
    W_FORMAT: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The chunk sums of a quantized GEMM tile through tl.dot_scaled: activation [BLOCK_M, BLOCK_K] e4m3 codes in
    # column order; weight [BLOCK_K / PER_BYTE, BLOCK_N] bytes of W_FORMAT ("e4m3", or "e2m1" packed two per byte
    # along K, low nibble first, as stored); UE8M0 scales per row and 32 columns (the weight's from row scale_rows).
    cols = tl.arange(0, BLOCK_K)
    w_cols = tl.arange(0, BLOCK_K // PER_BYTE)
    q_ptrs = q_ptr + rows[:, None] * stride_q + cols[None, :]
    qs_ptrs = qs_ptr + rows[:, None] * stride_qs + groups[None, :]
    w_ptrs = w_ptr + n_rows[None, :] * stride_w + w_cols[:, None]
    ws_ptrs = ws_ptr + scale_rows[:, None] * stride_ws + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            group_in = (k0 + groups * 32 < k_end)[None, :]
            a = tl.load(q_ptrs + k0, mask=row_mask[:, None] & (k0 + cols < k_end)[None, :], other=0)
            a_scale = tl.load(qs_ptrs + k0 // 32, mask=row_mask[:, None] & group_in, other=0)
            w_in = (k0 + PER_BYTE * w_cols < k_end)[:, None] & n_mask[None, :]
            w = tl.load(w_ptrs + k0 // PER_BYTE, mask=w_in, other=0)
            w_scale = tl.load(ws_ptrs + k0 // 32, mask=n_mask[:, None] & group_in, other=0)
            acc = tl.dot_scaled(a, a_scale, "e4m3", w, w_scale, W_FORMAT, acc)
        total += acc
    return total


@triton.jit
def group_fp16_tiles(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    rows,
    row_mask,
    n_rows,
    n_mask,
    scale_rows,
    K,
    K_CHUNK,
    stride_q,
    stride_qs,
    stride_w,
    stride_ws,
    W_FORMAT: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,
):
    # The chunk sums of a quantized GEMM tile, decoding "group_fp16": per 32-column group one MMA on the unscaled
    # FP16 operands (exact products, FP32 sum), then the group sum times the activation's factor, then times the
    # weight's (in that order: with activation scale bytes in [105, 246] the first product stays inside FP32's normal
    # range, so both are exact wherever the result is a normal number). W_FORMAT "e4m3": weight codes [BLOCK_N, 32]
    # and activation codes in column order, one MMA; "e2m1": the group's 16 packed weight bytes and the activation
    # de-interleaved per group (deinterleaved_activation), an MMA for the even and one for the odd columns.
    # The interpreter's operands are FP32 with the e4m3 values times 2^−8 (e4m3_half), undone by the factors' bias.
    E4M3_BIAS: tl.constexpr = 0 if NATIVE else 8
    W_BIAS: tl.constexpr = 14 if W_FORMAT == "e2m1" else E4M3_BIAS
    WIDTH: tl.constexpr = 16 if W_FORMAT == "e2m1" else 32
    cols = tl.arange(0, WIDTH)
    q_ptrs = q_ptr + rows[:, None] * stride_q + cols[None, :]
    w_ptrs = w_ptr + n_rows[:, None] * stride_w + cols[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            for g in tl.static_range(BLOCK_K // 32):
                col = k0 + g * 32
                # K is a multiple of 32, so whole groups are in or out of range (vector masks: see cuda.gemv._row).
                a_mask = row_mask[:, None] & (col + cols * 0 < k_end)[None, :]
                w_mask = n_mask[:, None] & (col + cols * 0 < k_end)[None, :]
                if W_FORMAT == "e2m1":
                    w_even, w_odd = e2m1_halves(tl.load(w_ptrs + col // 2, mask=w_mask, other=0), NATIVE)
                    a_even = e4m3_half(tl.load(q_ptrs + col, mask=a_mask, other=0), NATIVE)
                    a_odd = e4m3_half(tl.load(q_ptrs + col + 16, mask=a_mask, other=0), NATIVE)
                    part = tl.dot(a_odd, tl.trans(w_odd), tl.dot(a_even, tl.trans(w_even)))
                else:
                    w = e4m3_half(tl.load(w_ptrs + col, mask=w_mask, other=0), NATIVE)
                    part = tl.dot(e4m3_half(tl.load(q_ptrs + col, mask=a_mask, other=0), NATIVE), tl.trans(w))
                a_scale = tl.load(qs_ptr + rows * stride_qs + col // 32, mask=row_mask & (col + rows * 0 < k_end))
                w_scale = tl.load(ws_ptr + scale_rows * stride_ws + col // 32, mask=n_mask & (col + n_rows * 0 < k_end))
                acc += part * pow2(a_scale, E4M3_BIAS)[:, None] * pow2(w_scale, W_BIAS)[None, :]
        total += acc
    return total


@triton.jit
def swapped_tiles(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    rows,
    row_mask,
    n_rows,
    n_mask,
    K,
    K_CHUNK,
    stride_q,
    stride_qs,
    stride_w,
    stride_ws,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
    NATIVE: tl.constexpr,
):
    # The chunk sums of an MXFP4 GEMM tile, decoding "swap_ab", transposed: [BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ, the weight
    # being the MMA's first operand (Hopper's wgmma takes it from registers). Per K step each weight row's packed
    # words (four per 32-column group, read as 16-byte vectors) are decoded by e2m1_word_pairs, scaled into BF16,
    # and joined into the [BLOCK_N, BLOCK_K] operand; the join puts each thread's words where the operand layout wants
    # them, so only packed words, never decoded values, can pass through shared memory. The activation (codes in
    # column order) is read in the same column order (word_pair_columns): the MMA sums the same products.
    E4M3_BIAS: tl.constexpr = 0 if NATIVE else 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    words = tl.arange(0, BLOCK_K // 8)
    groups = tl.arange(0, GROUPS)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + n_rows[:, None] * (stride_w // 4) + words[None, :]
    ws_ptrs = ws_ptr + n_rows[:, None] * stride_ws + groups[None, :]
    columns = word_pair_columns(BLOCK_K)
    q_ptrs = q_ptr + rows[None, :] * stride_q + columns[:, None]
    qs_ptrs = qs_ptr + rows[None, :] * stride_qs + groups[:, None]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            # K is a multiple of 32, so whole groups are in or out of range.
            raw = tl.load(w_ptrs + k0 // 8, mask=n_mask[:, None] & (k0 + 8 * words < k_end)[None, :], other=0)
            w_in = n_mask[:, None] & (k0 + 32 * groups < k_end)[None, :]
            w_scale = tl.load(ws_ptrs + k0 // 32, mask=w_in, other=0).to(tl.int32)
            raw = tl.reshape(raw, (BLOCK_N, GROUPS, 4))
            pairs = e2m1_word_pairs(
                tl.join(raw, raw), tl.broadcast_to(w_scale[:, :, None, None], (BLOCK_N, GROUPS, 4, 2)), NATIVE
            )
            # [BLOCK_N, group, word, pair element, o % 2, o // 2] → k = 32·group + 8·o + 2·word + pair element
            w = tl.join(tl.join(pairs[0], pairs[1]), tl.join(pairs[2], pairs[3]))
            w = tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))
            a_in = row_mask[None, :] & (k0 + 32 * groups < k_end)[:, None]
            a_scale = tl.load(qs_ptrs + k0 // 32, mask=a_in, other=0)
            codes = tl.load(q_ptrs + k0, mask=row_mask[None, :] & (k0 + columns < k_end)[:, None])
            a = tl.reshape(e4m3_unscaled(codes, NATIVE), (GROUPS, 32, BLOCK_M)) * pow2(a_scale, E4M3_BIAS)[:, None, :]
            acc = tl.dot(operand(w, DOT_BF16), operand(tl.reshape(a, (BLOCK_K, BLOCK_M)), DOT_BF16), acc)
        total += acc
    return tl.trans(total)
