"""Triton kernels of sparse attention (the launcher and the why are in ``cuda/attention.py``): the key loops both
paths share, the split path's kernels, and the non-split path's ``prefill_kernel``.

Every kernel takes the three key sources as (pool, rows, row stride, keys, bytes per row). A program covers a block of
heads of one query and makes two passes over its keys, source after source, tile by tile in key order. Pass 1
(``logits_pass``) gathers and decodes every key tile, takes its logits for the whole head block in one dot, writes
them to the program's rows of a logits workspace and raises the maximum. Pass 2 (``sums_pass``) gathers and decodes
the tiles again, reads the logits back instead of recomputing them and sums ``exp(logit − max)`` and the value
products. Keeping the query out of pass 2 is what keeps a 64-head program in registers: a ``[64, 512]`` query
operand needs 32 shared-memory descriptors per dot that the compiler hoists out of the key loop, and next to the
``[64, 512]`` FP32 accumulator they spilled.

Pass 2 runs once per ``BLOCK_V`` value columns (one sweep at the default width); every sweep takes the same logits in
the same order, so the sums of a column are the same additions whatever ``BLOCK_V`` is.

The split path runs the passes as two launches over (query, head block, split), a split being one chunk of one
source's keys: ``split_logits_kernel`` (pass 1 over the split's keys, its maximum into ``part_m``),
``split_sums_kernel`` (pass 2 at the maximum over the sink and every split, from zero, into ``part_acc`` and
``part_l``) and ``combine_kernel`` (the sink's term, then the splits' sums in split order, and the division).
``chunks_kernel`` makes the same additions in one program per (query, head block): pass 1 over all keys, then each
chunk summed from zero and added in chunk order in registers (the batch-invariant mode at many queries).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import await_inputs
from deepinfer_kernels.cuda.row_formats import decode_groups, round_bf16

__all__ = ["chunks_kernel", "combine_kernel", "prefill_kernel", "split_logits_kernel", "split_sums_kernel"]

# Splits whose partial results are loaded together (one memory round trip for them), then taken in split order: a
# one-query decode step has up to about 40 splits, and the combine's sums loaded one split a loop step (its maximum
# four, the compiler's unroll): about 50 dependent round trips, 25 µs a call on the H200
# (profile_step-h200-scaled-7299ced.json). Eight at a time left six round trips for the maximum and six for the sums,
# 13 µs a call (profile_step-h200-scaled-3935c2a.json); sixteen leave three each.
_SPLITS_PER_LOAD: tl.constexpr = tl.constexpr(16)


@triton.jit
def _tile_rows(rows_ptr, stride_rows, token, n, hi):  # type: ignore[no-untyped-def]
    """Whether keys ``n`` [BLOCK_N] of the query hold a row (below ``hi`` and not −1), and their pool rows."""
    idx = tl.load(rows_ptr + token * stride_rows + n, mask=n < hi, other=-1).to(tl.int64)
    return idx >= 0, tl.maximum(idx, 0)


@triton.jit
def _add_value_products(acc, probs, values, BF16_DOT: tl.constexpr, ROUND: tl.constexpr):  # type: ignore[no-untyped-def]
    """``acc`` [BLOCK_H, V] plus ``probs`` [BLOCK_H, BLOCK_N] · ``values`` [BLOCK_N, V] (FP32): the probabilities
    rounded to BF16 first when ROUND, a BF16 tensor-core dot when BF16_DOT (decoded rows are BF16-exact)."""
    if ROUND and BF16_DOT:
        acc += tl.dot(round_bf16(probs), values.to(tl.bfloat16))
    elif ROUND:
        acc += tl.dot(round_bf16(probs).to(tl.float32), values, input_precision="ieee")
    else:
        acc += tl.dot(probs, values, input_precision="ieee")
    return acc


@triton.jit
def logits_pass(  # type: ignore[no-untyped-def]
    m, q, pool_ptr, rows_ptr, stride_rows, lo, hi, row_bytes, token, scale, logits_ptr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Pass 1 over keys [lo, hi) of one source: ``m`` [BLOCK_H] raised to their largest logit; every logit (−inf for
    a missing row) written to ``logits_ptr`` [BLOCK_H, 1] (the program's workspace rows at the source's first key)
    plus the key."""
    valid, idx = _tile_rows(rows_ptr, stride_rows, token, lo + tl.arange(0, BLOCK_N), hi)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        # The next tile's row indices load while this tile's rows are gathered: one dependent round trip a tile.
        next_valid, next_idx = _tile_rows(rows_ptr, stride_rows, token, n + BLOCK_N, hi)
        keys = decode_groups(pool_ptr, idx * row_bytes, valid, 0, BLOCK_D, WIDTH, FMT)
        if BF16_DOT:
            logits = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))
        else:
            logits = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        tl.store(logits_ptr + n[None, :], logits, mask=(n < hi)[None, :])
        m = tl.maximum(m, tl.max(logits, axis=1))
        valid, idx = next_valid, next_idx
    return m


@triton.jit
def sums_pass(  # type: ignore[no-untyped-def]
    acc, denom, m, pool_ptr, rows_ptr, stride_rows, lo, hi, row_bytes, token, V_FIRST, logits_ptr,
    WIDTH: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Pass 2 over keys [lo, hi) of one source, tile by tile in key order: ``acc`` [BLOCK_H, BLOCK_V] plus Σ p·k over
    the value columns ``V_FIRST …`` and ``denom`` [BLOCK_H] plus Σ p, p = exp(logit − m) with the logits of pass 1 (a
    range without a valid key adds exact zeros)."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid, idx = _tile_rows(rows_ptr, stride_rows, token, n, hi)
        values = decode_groups(pool_ptr, idx * row_bytes, valid, V_FIRST, BLOCK_V, WIDTH, FMT)
        logits = tl.load(logits_ptr + n[None, :], mask=(n < hi)[None, :], other=float("-inf"))
        probs = tl.exp(logits - m[:, None])
        denom += tl.sum(probs, axis=1)
        acc = _add_value_products(acc, probs, values, BF16_DOT, ROUND)
    return acc, denom


@triton.jit
def _heads(num_heads, BLOCK_H: tl.constexpr):  # type: ignore[no-untyped-def]
    """The program's heads and their mask."""
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return h, h < num_heads


@triton.jit
def _load_query(q_ptr, token, h, h_mask, num_heads, WIDTH: tl.constexpr, BLOCK_D: tl.constexpr):  # type: ignore[no-untyped-def]
    d = tl.arange(0, BLOCK_D)
    mask = h_mask[:, None] & (d < WIDTH)[None, :]
    return tl.load(q_ptr + (token * num_heads + h[:, None]) * WIDTH + d[None, :], mask=mask, other=0.0)


@triton.jit
def _logits_rows(logits_ptr, token, num_keys, BLOCK_H: tl.constexpr):  # type: ignore[no-untyped-def]
    """The program's rows of the logits workspace [queries, head blocks · BLOCK_H, keys0 + keys1 + keys2]."""
    block_row = token * tl.num_programs(1) + tl.program_id(1)
    return logits_ptr + (block_row * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]) * num_keys


@triton.jit
def _split_range(split, first, count, chunk_keys, num_keys):  # type: ignore[no-untyped-def]
    """Keys [lo, hi) of one source that split ``split`` holds: splits first … first + count − 1 are the source's
    chunks in order; any other split holds none of its keys."""
    local = split - first
    mine = (local >= 0) & (local < count)
    lo = tl.where(mine, local * chunk_keys, 0)
    hi = tl.where(mine, tl.minimum(lo + chunk_keys, num_keys), 0)
    return lo, hi


@triton.jit
def _global_max(sink, part_m_ptr, token, num_maxima, num_heads, h, h_mask):  # type: ignore[no-untyped-def]
    """The softmax maximum: the sink and the maximum of each of pass 1's ``num_maxima`` splits (loaded
    :data:`_SPLITS_PER_LOAD` at a time)."""
    m = sink
    end = (token + 1) * num_maxima * num_heads  # past the query's last split
    for first in range(0, num_maxima, _SPLITS_PER_LOAD):
        for j in tl.static_range(_SPLITS_PER_LOAD):
            part = (token * num_maxima + first + j) * num_heads + h
            m = tl.maximum(m, tl.load(part_m_ptr + part, mask=h_mask & (part < end), other=float("-inf")))
    return m


@triton.jit
def _split_ranges(split, chunk_keys, num_splits, first1, first2, keys0, keys1, keys2):  # type: ignore[no-untyped-def]
    """Keys [lo, hi) of each source that split ``split`` holds (only the source owning the split has a non-empty
    range)."""
    lo0, hi0 = _split_range(split, 0, first1, chunk_keys, keys0)
    lo1, hi1 = _split_range(split, first1, first2 - first1, chunk_keys, keys1)
    lo2, hi2 = _split_range(split, first2, num_splits - first2, chunk_keys, keys2)
    return lo0, hi0, lo1, hi1, lo2, hi2


@triton.jit
def _sources_logits(  # type: ignore[no-untyped-def]
    m, q, token, scale, logits0, lo0, hi0, lo1, hi1, lo2, hi2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
):  # fmt: skip
    """``logits_pass`` over keys [lo_i, hi_i) of each source in order, the sources' logits side by side from the
    program's workspace rows ``logits0``."""
    m = logits_pass(
        m, q, pool0, rows0, stride0, lo0, hi0, bytes0, token, scale, logits0, WIDTH, BLOCK_D, FMT0, BF16_0, BLOCK_N
    )
    m = logits_pass(
        m, q, pool1, rows1, stride1, lo1, hi1, bytes1, token, scale, logits0 + keys0, WIDTH, BLOCK_D, FMT1, BF16_1,
        BLOCK_N,
    )  # fmt: skip
    return logits_pass(
        m, q, pool2, rows2, stride2, lo2, hi2, bytes2, token, scale, logits0 + keys0 + keys1, WIDTH, BLOCK_D, FMT2,
        BF16_2, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _sources_sums(  # type: ignore[no-untyped-def]
    acc, denom, m, token, v, logits0, lo0, hi0, lo1, hi1, lo2, hi2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """``sums_pass`` over keys [lo_i, hi_i) of each source in order, value columns ``v …``."""
    acc, denom = sums_pass(
        acc, denom, m, pool0, rows0, stride0, lo0, hi0, bytes0, token, v, logits0,
        WIDTH, FMT0, BF16_0, ROUND, BLOCK_N, BLOCK_V,
    )  # fmt: skip
    acc, denom = sums_pass(
        acc, denom, m, pool1, rows1, stride1, lo1, hi1, bytes1, token, v, logits0 + keys0,
        WIDTH, FMT1, BF16_1, ROUND, BLOCK_N, BLOCK_V,
    )  # fmt: skip
    return sums_pass(
        acc, denom, m, pool2, rows2, stride2, lo2, hi2, bytes2, token, v, logits0 + keys0 + keys1,
        WIDTH, FMT2, BF16_2, ROUND, BLOCK_N, BLOCK_V,
    )  # fmt: skip


@triton.jit
def split_logits_kernel(  # type: ignore[no-untyped-def]
    q_ptr, part_m_ptr, logits_ptr, num_heads, scale, chunk_keys, num_splits, first1, first2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr, LOGITS_BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block, split): pass 1 over the split's keys in tiles of ``LOGITS_BLOCK_N`` (only the source
    owning the split has a non-empty range), their largest logit (−inf when it has none) into ``part_m_ptr``
    [T, splits, H]."""
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    h, h_mask = _heads(num_heads, BLOCK_H)
    q = _load_query(q_ptr, token, h, h_mask, num_heads, WIDTH, BLOCK_D)
    logits0 = _logits_rows(logits_ptr, token, keys0 + keys1 + keys2, BLOCK_H)
    lo0, hi0, lo1, hi1, lo2, hi2 = _split_ranges(split, chunk_keys, num_splits, first1, first2, keys0, keys1, keys2)
    m = _sources_logits(
        tl.full([BLOCK_H], float("-inf"), tl.float32), q, token, scale, logits0, lo0, hi0, lo1, hi1, lo2, hi2,
        pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
        pool2, rows2, stride2, keys2, bytes2,
        WIDTH, BLOCK_D, LOGITS_BLOCK_N, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2,
    )  # fmt: skip
    tl.store(part_m_ptr + (token * num_splits + split) * num_heads + h, m, mask=h_mask)


@triton.jit
def split_sums_kernel(  # type: ignore[no-untyped-def]
    sink_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, logits_ptr, num_heads, num_maxima, chunk_keys, num_splits,
    first1, first2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block, split): pass 2 over the split's keys at the maximum over the sink and every pass-1
    split (``part_m_ptr`` [T, num_maxima, H]), its sums from zero into ``part_acc_ptr`` [T, splits, H, WIDTH] and
    ``part_l_ptr`` [T, splits, H]."""
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    h, h_mask = _heads(num_heads, BLOCK_H)
    m = _global_max(tl.load(sink_ptr + h, mask=h_mask, other=0.0), part_m_ptr, token, num_maxima, num_heads, h, h_mask)
    logits0 = _logits_rows(logits_ptr, token, keys0 + keys1 + keys2, BLOCK_H)
    lo0, hi0, lo1, hi1, lo2, hi2 = _split_ranges(split, chunk_keys, num_splits, first1, first2, keys0, keys1, keys2)
    part_row = (token * num_splits + split) * num_heads + h
    for v in tl.static_range(0, BLOCK_D, BLOCK_V):
        dv = v + tl.arange(0, BLOCK_V)
        acc, denom = _sources_sums(
            tl.zeros([BLOCK_H, BLOCK_V], tl.float32), tl.zeros([BLOCK_H], tl.float32), m, token, v, logits0,
            lo0, hi0, lo1, hi1, lo2, hi2,
            pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
            pool2, rows2, stride2, keys2, bytes2,
            WIDTH, BLOCK_N, BLOCK_V, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2, ROUND,
        )  # fmt: skip
        tl.store(
            part_acc_ptr + part_row[:, None] * WIDTH + dv[None, :], acc, mask=h_mask[:, None] & (dv < WIDTH)[None, :]
        )
        if v == 0:
            tl.store(part_l_ptr + part_row, denom, mask=h_mask)


@triton.jit
def combine_kernel(  # type: ignore[no-untyped-def]
    sink_ptr, out_ptr, part_m_ptr, part_acc_ptr, part_l_ptr, num_heads, num_maxima, num_splits,
    WIDTH: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block, column block): the sink's term, then every split's sums added in split order, and the
    output. Each element is the same additions whatever the blocks. The splits are loaded :data:`_SPLITS_PER_LOAD` at
    a time; those past the last one load as +0.0, which leaves the sums' bits as they are (a sum that starts at +0.0
    is never −0.0, and ``a + 0.0 == a`` for every other ``a``)."""
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    h, h_mask = _heads(num_heads, BLOCK_H)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = h_mask[:, None] & (c < WIDTH)[None, :]
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    denom = tl.exp(sink - _global_max(sink, part_m_ptr, token, num_maxima, num_heads, h, h_mask))
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    end = (token + 1) * num_splits * num_heads  # past the query's last split
    for first in range(0, num_splits, _SPLITS_PER_LOAD):
        for j in tl.static_range(_SPLITS_PER_LOAD):
            part = (token * num_splits + first + j) * num_heads + h
            live = h_mask & (part < end)
            acc += tl.load(part_acc_ptr + part[:, None] * WIDTH + c[None, :], mask=live[:, None] & mask, other=0.0)
            denom += tl.load(part_l_ptr + part, mask=live, other=0.0)
    tl.store(out_ptr + ((token * num_heads + h[:, None]) * WIDTH + c[None, :]), acc / denom[:, None], mask=mask)


@triton.jit
def _whole_logits(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, logits_ptr, num_heads, scale,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, LOGITS_BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
):  # fmt: skip
    """Pass 1 of a program over all its query's keys (grid (query, head block)): (query, heads, head mask, sink
    logits, the program's logits workspace rows, the maximum over the sink and every key), the logits written and
    visible to the whole program."""
    token = tl.program_id(0).to(tl.int64)
    h, h_mask = _heads(num_heads, BLOCK_H)
    q = _load_query(q_ptr, token, h, h_mask, num_heads, WIDTH, BLOCK_D)
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    logits0 = _logits_rows(logits_ptr, token, keys0 + keys1 + keys2, BLOCK_H)
    m = _sources_logits(
        sink, q, token, scale, logits0, 0, keys0, 0, keys1, 0, keys2,
        pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
        pool2, rows2, stride2, keys2, bytes2,
        WIDTH, BLOCK_D, LOGITS_BLOCK_N, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2,
    )  # fmt: skip
    # Pass 2 reads logits that other threads of the program wrote: a CTA barrier orders the global memory accesses.
    tl.debug_barrier()
    return token, h, h_mask, sink, logits0, m


@triton.jit
def prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, out_ptr, logits_ptr, num_heads, scale,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
    ROUND: tl.constexpr, LOGITS_BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block), the non-split path: the maximum over the sink and every key (pass 1, in tiles of
    ``LOGITS_BLOCK_N`` keys), then per ``BLOCK_V`` value columns the sink's term and every key's sums added in key
    order (pass 2, tiles of ``BLOCK_N``), and the output."""
    await_inputs(PDL)
    token, h, h_mask, sink, logits0, m = _whole_logits(
        q_ptr, sink_ptr, logits_ptr, num_heads, scale,
        pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
        pool2, rows2, stride2, keys2, bytes2,
        WIDTH, BLOCK_D, BLOCK_H, LOGITS_BLOCK_N, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2,
    )  # fmt: skip
    for v in tl.static_range(0, BLOCK_D, BLOCK_V):
        dv = v + tl.arange(0, BLOCK_V)
        # The sink is a logit with a zero value: it enters the denominator only, first, as in the combine.
        acc, denom = _sources_sums(
            tl.zeros([BLOCK_H, BLOCK_V], tl.float32), tl.exp(sink - m), m, token, v, logits0,
            0, keys0, 0, keys1, 0, keys2,
            pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
            pool2, rows2, stride2, keys2, bytes2,
            WIDTH, BLOCK_N, BLOCK_V, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2, ROUND,
        )  # fmt: skip
        out_offsets = (token * num_heads + h[:, None]) * WIDTH + dv[None, :]
        tl.store(out_ptr + out_offsets, acc / denom[:, None], mask=h_mask[:, None] & (dv < WIDTH)[None, :])


@triton.jit
def _chunk_sums(  # type: ignore[no-untyped-def]
    total, denom, m, pool_ptr, rows_ptr, stride_rows, num_keys, row_bytes, token, v, logits_ptr, chunk_keys,
    WIDTH: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """``total`` and ``denom`` plus each ``chunk_keys``-key chunk of one source's keys, the chunk summed from zero by
    ``sums_pass`` (as ``split_sums_kernel`` sums it) and added in chunk order (as ``combine_kernel`` adds it)."""
    for lo in range(0, num_keys, chunk_keys):
        acc, part = sums_pass(
            tl.zeros_like(total), tl.zeros_like(denom), m, pool_ptr, rows_ptr, stride_rows, lo,
            tl.minimum(lo + chunk_keys, num_keys), row_bytes, token, v, logits_ptr, WIDTH, FMT, BF16_DOT, ROUND,
            BLOCK_N, BLOCK_V,
        )  # fmt: skip
        total += acc
        denom += part
    return total, denom


@triton.jit
def chunks_kernel(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, out_ptr, logits_ptr, num_heads, scale, chunk_keys,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr, ROUND: tl.constexpr,
    LOGITS_BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block): the split path's result in one program. Pass 1 over every key in the split path's
    ``LOGITS_BLOCK_N`` tiles (the same logits; the maximum is exact in any order), then per ``BLOCK_V`` value columns
    the sink's term and each source's chunks, every chunk summed from zero in tile order and added in chunk order: the
    additions of ``split_sums_kernel`` and ``combine_kernel``, without the ``[T, splits, H, WIDTH]`` partial sums
    between them. Two ``[BLOCK_H, BLOCK_V]`` accumulators (the running total and the chunk's): ``BLOCK_V`` is its own
    tile (``TILES["chunks_block_v"]``), weighing their registers against a sweep per ``BLOCK_V`` columns."""
    await_inputs(PDL)
    token, h, h_mask, sink, logits0, m = _whole_logits(
        q_ptr, sink_ptr, logits_ptr, num_heads, scale,
        pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1,
        pool2, rows2, stride2, keys2, bytes2,
        WIDTH, BLOCK_D, BLOCK_H, LOGITS_BLOCK_N, FMT0, FMT1, FMT2, BF16_0, BF16_1, BF16_2,
    )  # fmt: skip
    for v in tl.static_range(0, BLOCK_D, BLOCK_V):
        dv = v + tl.arange(0, BLOCK_V)
        total = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
        denom = tl.exp(sink - m)
        total, denom = _chunk_sums(
            total, denom, m, pool0, rows0, stride0, keys0, bytes0, token, v, logits0, chunk_keys,
            WIDTH, FMT0, BF16_0, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        total, denom = _chunk_sums(
            total, denom, m, pool1, rows1, stride1, keys1, bytes1, token, v, logits0 + keys0, chunk_keys,
            WIDTH, FMT1, BF16_1, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        total, denom = _chunk_sums(
            total, denom, m, pool2, rows2, stride2, keys2, bytes2, token, v, logits0 + keys0 + keys1, chunk_keys,
            WIDTH, FMT2, BF16_2, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        out_offsets = (token * num_heads + h[:, None]) * WIDTH + dv[None, :]
        tl.store(out_ptr + out_offsets, total / denom[:, None], mask=h_mask[:, None] & (dv < WIDTH)[None, :])
