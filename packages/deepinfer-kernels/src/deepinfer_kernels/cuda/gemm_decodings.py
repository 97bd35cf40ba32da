"""The chunk sums of a quantized GEMM's MMA tile for the operand decodings other than the kernels' own scaled-BF16
loop: ``tl.dot_scaled`` (``"dot_scaled"``), unscaled FP16 per 32-column group (``"group_fp16"``), FP8 codes per group
(``"group_fp8"``, and transposed, ``"swap_fp8"``) and the weight-first BF16 MMA (``"swap_ab"``, MXFP4 only).
``cuda.gemm``'s kernels call them with their tile's rows, columns and K chunks (docs/design/kernels.md, "GEMM tiles
and split-K"); each returns the tile's FP32 sum over the program's chunks, the chunks summed from zero and added in
order (``gemm_operands.chunk_range``).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda.gemm_operands import (
    chunk_range,
    e2m1_e4m3_codes,
    e2m1_halves,
    e2m1_word_pairs,
    e4m3_half,
    e4m3_operand,
    e4m3_unscaled,
    operand,
    pow2,
    word_pair_columns,
)

__all__ = ["dot_scaled_tiles", "group_tiles", "swapped_tiles", "swapped_weight", "swapped_weight_pointers"]


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
def column(tile, index, g):  # type: ignore[no-untyped-def]
    # Column g of tile [R, C] (index = arange(0, C)): a masked sum over the few columns a thread holds.
    return tl.sum(tl.where(index[None, :] == g, tile, 0.0), axis=1)


@triton.jit
def group_tiles(  # type: ignore[no-untyped-def]
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
    FP8_MMA: tl.constexpr,
    SWAP: tl.constexpr,
):
    # The chunk sums of a quantized GEMM tile, decodings "group_fp16", "group_fp8" (FP8_MMA) and "swap_fp8" (FP8_MMA
    # and SWAP): per 32-column group one MMA on the unscaled operands, then the group sum times the activation's
    # factor, then times the weight's (in that order: with activation scale bytes in [105, 246] the first product
    # stays inside FP32's normal range, so both are exact wherever the result is a normal number).
    # - group_fp16: FP16 operands (exact products, FP32 sums). W_FORMAT "e4m3": weight codes [BLOCK_N, 32] and
    #   activation codes in column order, one MMA; "e2m1": the group's 16 packed weight bytes and the activation
    #   de-interleaved per group (deinterleaved_activation), an MMA for the even and one for the odd columns.
    # - group_fp8: the stored e4m3 codes feed the FP8 tensor cores as they are; e2m1 codes become e4m3 codes of the
    #   value times 2^-6 (e2m1_e4m3_codes, exact), the low nibbles' codes then the high nibbles' (the activation
    #   de-interleaved per group to match, deinterleaved_activation).
    #   Hopper's FP8 MMA sums a group's 32 exact products in a narrower accumulator than FP32 (docs/design/numerics.md,
    #   "GEMM accumulation"); the groups are added in FP32.
    # - swap_fp8: group_fp8 computed transposed, [BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ with the weight as the MMA's first
    #   operand, so that a tile of fewer than 64 rows still makes a Hopper wgmma (M = BLOCK_N): untransposed, Triton
    #   runs such an FP8 dot as an FP16 mma.sync on converted operands. Same products, group sums and factor order.
    # The interpreter's operands are FP32: e4m3 values times 2^-8 (e4m3_half), e2m1 values times 2^-14 (e2m1_halves),
    # undone by the factors' bias.
    E4M3_BIAS: tl.constexpr = 0 if NATIVE else 8
    E2M1_BIAS: tl.constexpr = (6 if FP8_MMA else 14) if NATIVE else 14
    W_BIAS: tl.constexpr = E2M1_BIAS if W_FORMAT == "e2m1" else E4M3_BIAS
    WIDTH: tl.constexpr = 16 if W_FORMAT == "e2m1" else 32
    A_WIDTH: tl.constexpr = 32 if FP8_MMA else WIDTH
    a_cols = tl.arange(0, A_WIDTH)
    cols = tl.arange(0, WIDTH)
    GROUPS: tl.constexpr = BLOCK_K // 32
    groups = tl.arange(0, GROUPS)
    q_ptrs = q_ptr + rows[:, None] * stride_q + a_cols[None, :]
    w_ptrs = w_ptr + n_rows[:, None] * stride_w + cols[None, :]
    qs_ptrs = qs_ptr + rows[:, None] * stride_qs + groups[None, :]
    ws_ptrs = ws_ptr + scale_rows[:, None] * stride_ws + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    # group_fp8 sums K as one chunk (gemm_tiles.chunk_length): its groups go straight into total, which saves a tile
    # of FP32 registers (its large tiles need them); 0 + chunk sum is the same value. Every other decoding sums each
    # chunk from zero, then adds the chunk sums in order.
    ONE_SUM: tl.constexpr = FP8_MMA and not SWAP
    total = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = total if ONE_SUM else tl.zeros_like(total)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            # The K step's scale factors as [rows, groups] tiles, one load each (a load per group and element of the
            # MMA layout would hold a pointer per element in registers).
            group_in = (k0 + groups * 32 < k_end)[None, :]
            a_factors = pow2(tl.load(qs_ptrs + k0 // 32, mask=row_mask[:, None] & group_in, other=0), E4M3_BIAS)
            w_factors = pow2(tl.load(ws_ptrs + k0 // 32, mask=n_mask[:, None] & group_in, other=0), W_BIAS)
            for g in tl.static_range(GROUPS):
                col = k0 + g * 32
                # K is a multiple of 32, so whole groups are in or out of range (vector masks: see cuda.gemv._row).
                a_mask = row_mask[:, None] & (col + a_cols * 0 < k_end)[None, :]
                w_mask = n_mask[:, None] & (col + cols * 0 < k_end)[None, :]
                raw = tl.load(w_ptrs + col // (32 // WIDTH), mask=w_mask, other=0)
                if FP8_MMA:
                    w = e2m1_e4m3_codes(raw, BLOCK_N, NATIVE) if W_FORMAT == "e2m1" else e4m3_operand(raw, NATIVE)
                    a = e4m3_operand(tl.load(q_ptrs + col, mask=a_mask, other=0), NATIVE)
                    part = tl.dot(w, tl.trans(a)) if SWAP else tl.dot(a, tl.trans(w))
                elif W_FORMAT == "e2m1":
                    w_even, w_odd = e2m1_halves(raw, NATIVE)
                    a_even = e4m3_half(tl.load(q_ptrs + col, mask=a_mask, other=0), NATIVE)
                    a_odd = e4m3_half(tl.load(q_ptrs + col + 16, mask=a_mask, other=0), NATIVE)
                    part = tl.dot(a_odd, tl.trans(w_odd), tl.dot(a_even, tl.trans(w_even)))
                else:
                    part = tl.dot(
                        e4m3_half(tl.load(q_ptrs + col, mask=a_mask, other=0), NATIVE), tl.trans(e4m3_half(raw, NATIVE))
                    )
                if SWAP:
                    acc += part * column(a_factors, groups, g)[None, :] * column(w_factors, groups, g)[:, None]
                else:
                    acc += part * column(a_factors, groups, g)[:, None] * column(w_factors, groups, g)[None, :]
        total = acc if ONE_SUM else total + acc
    return tl.trans(total) if SWAP else total


@triton.jit
def swapped_weight_pointers(w_ptr, ws_ptr, n_rows, stride_w, stride_ws, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    # Pointers of a weight-first tile's first K step: the packed words [BLOCK_N, BLOCK_K/8] (int32, four per 32-column
    # group) and the scale bytes [BLOCK_N, BLOCK_K/32] of the rows n_rows.
    words = tl.arange(0, BLOCK_K // 8)
    groups = tl.arange(0, BLOCK_K // 32)
    w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + n_rows[:, None] * (stride_w // 4) + words[None, :]
    return w_ptrs, ws_ptr + n_rows[:, None] * stride_ws + groups[None, :]


@triton.jit
def swapped_weight(  # type: ignore[no-untyped-def]
    w_ptrs,
    ws_ptrs,
    k0,
    k_end,
    n_mask,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    # The MXFP4 weight's K step at k0 as the first operand of a weight-first MMA, [BLOCK_N, BLOCK_K], scaled: BF16
    # (NATIVE) or FP32 (the interpreter). Each row's packed words are read as 16-byte vectors and decoded by
    # e2m1_word_pairs; the join puts each thread's words where the operand layout wants them, so only packed words,
    # never decoded values, can pass through shared memory. Column k holds the code word_pair_columns names. EVEN:
    # every row and K step of the tile is in range (no masks, so the loads can be vectors).
    GROUPS: tl.constexpr = BLOCK_K // 32
    words = tl.arange(0, BLOCK_K // 8)
    groups = tl.arange(0, GROUPS)
    if EVEN:
        raw = tl.load(w_ptrs + k0 // 8)
        w_scale = tl.load(ws_ptrs + k0 // 32).to(tl.int32)
    else:
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
    return tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))


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
    # being the MMA's first operand (Hopper's wgmma takes it from registers), decoded per K step by swapped_weight.
    # The activation (codes in column order) is read in the same column order (word_pair_columns): the MMA sums the
    # same products.
    E4M3_BIAS: tl.constexpr = 0 if NATIVE else 8
    GROUPS: tl.constexpr = BLOCK_K // 32
    groups = tl.arange(0, GROUPS)
    w_ptrs, ws_ptrs = swapped_weight_pointers(w_ptr, ws_ptr, n_rows, stride_w, stride_ws, BLOCK_K)
    columns = word_pair_columns(BLOCK_K)
    q_ptrs = q_ptr + rows[None, :] * stride_q + columns[:, None]
    qs_ptrs = qs_ptr + rows[None, :] * stride_qs + groups[:, None]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            w = swapped_weight(w_ptrs, ws_ptrs, k0, k_end, n_mask, BLOCK_N, BLOCK_K, NATIVE)
            a_in = row_mask[None, :] & (k0 + 32 * groups < k_end)[:, None]
            a_scale = tl.load(qs_ptrs + k0 // 32, mask=a_in, other=0)
            codes = tl.load(q_ptrs + k0, mask=row_mask[None, :] & (k0 + columns < k_end)[:, None])
            a = tl.reshape(e4m3_unscaled(codes, NATIVE), (GROUPS, 32, BLOCK_M)) * pow2(a_scale, E4M3_BIAS)[:, None, :]
            acc = tl.dot(operand(w, DOT_BF16), operand(tl.reshape(a, (BLOCK_K, BLOCK_M)), DOT_BF16), acc)
        total += acc
    return tl.trans(total)
