"""Triton kernels of sparse attention's split path (decode; the launcher and the argument's why are in
``cuda/attention.py``, the non-split path's kernel in ``cuda/attention_prefill_kernels.py``).

Every kernel takes the three key sources as (pool, rows, row stride, keys, bytes per row) and the key range of a
program per source. Keys of a source are summed in chunks of ``chunk_keys`` from the source's start, each chunk from
zero, and the chunk sums are added in key order (docs/design/kernels.md, "sparse_attention").
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda.row_formats import decode_tile, round_bf16

__all__ = ["add_value_products", "attend_kernel", "combine_kernel", "split_max_kernel"]


@triton.jit
def _source_logits(  # type: ignore[no-untyped-def]
    q, pool_ptr, rows_ptr, stride_rows, n, hi, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT
):
    """Scaled logits [BLOCK_H, BLOCK_N] (−inf for missing or out-of-range rows) and the decoded rows of tile ``n``."""
    idx = tl.load(rows_ptr + token * stride_rows + n, mask=n < hi, other=-1).to(tl.int64)
    valid = idx >= 0
    base = tl.maximum(idx, 0) * row_bytes
    keys = decode_tile(pool_ptr, base[:, None], d[None, :], valid[:, None] & d_mask[None, :], WIDTH, FMT)
    if BF16_DOT:
        logits = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))
    else:
        logits = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
    return tl.where(valid[None, :], logits * scale, float("-inf")), keys


@triton.jit
def _range_max(  # type: ignore[no-untyped-def]
    m, q, pool_ptr, rows_ptr, stride_rows, lo, hi, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT, BLOCK_N
):
    """``m`` raised to the largest logit of keys [lo, hi) of one source."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        logits, _ = _source_logits(
            q, pool_ptr, rows_ptr, stride_rows, n, hi, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT
        )
        m = tl.maximum(m, tl.max(logits, axis=1))
    return m


@triton.jit
def add_value_products(acc, probs, values, BF16_DOT: tl.constexpr, ROUND: tl.constexpr):  # type: ignore[no-untyped-def]
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
def _range_sums(  # type: ignore[no-untyped-def]
    acc, denom, m, q, pool_ptr, rows_ptr, stride_rows, lo, hi, row_bytes, token, scale, d, d_mask,
    WIDTH: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``acc`` [BLOCK_H, BLOCK_D] plus Σ p·k and ``denom`` [BLOCK_H] plus Σ exp(s − m) over keys [lo, hi) of one source,
    tile by tile in key order (a range without a valid key adds exact zeros)."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        logits, keys = _source_logits(
            q, pool_ptr, rows_ptr, stride_rows, n, hi, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT
        )
        probs = tl.exp(logits - m[:, None])
        denom += tl.sum(probs, axis=1)
        acc = add_value_products(acc, probs, keys, BF16_DOT, ROUND)
    return acc, denom


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
def _query(q_ptr, num_heads, token, WIDTH, BLOCK_H, BLOCK_D):  # type: ignore[no-untyped-def]
    """The program's heads, element offsets, the head and query masks and the query block."""
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < num_heads
    d_mask = d < WIDTH
    offsets = (token * num_heads + h[:, None]) * WIDTH + d[None, :]
    q_mask = h_mask[:, None] & d_mask[None, :]
    return h, d, h_mask, d_mask, q_mask, tl.load(q_ptr + offsets, mask=q_mask, other=0.0)


@triton.jit
def _global_max(sink, part_m_ptr, token, num_splits, num_heads, h, h_mask):  # type: ignore[no-untyped-def]
    """The softmax maximum: the sink and every split's maximum, read in split order."""
    m = sink
    for s in range(0, num_splits):
        part = (token * num_splits + s) * num_heads + h
        m = tl.maximum(m, tl.load(part_m_ptr + part, mask=h_mask, other=float("-inf")))
    return m


@triton.jit
def split_max_kernel(  # type: ignore[no-untyped-def]
    q_ptr, part_m_ptr, num_heads, scale, chunk_keys, num_splits, first1, first2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block, split): the largest logit of the split's own keys, −inf when it has none."""
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    h, d, h_mask, d_mask, _, q = _query(q_ptr, num_heads, token, WIDTH, BLOCK_H, BLOCK_D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lo, hi = _split_range(split, 0, first1, chunk_keys, keys0)
    m = _range_max(m, q, pool0, rows0, stride0, lo, hi, bytes0, token, scale, d, d_mask, WIDTH, FMT0, BF16_0, BLOCK_N)
    lo, hi = _split_range(split, first1, first2 - first1, chunk_keys, keys1)
    m = _range_max(m, q, pool1, rows1, stride1, lo, hi, bytes1, token, scale, d, d_mask, WIDTH, FMT1, BF16_1, BLOCK_N)
    lo, hi = _split_range(split, first2, num_splits - first2, chunk_keys, keys2)
    m = _range_max(m, q, pool2, rows2, stride2, lo, hi, bytes2, token, scale, d, d_mask, WIDTH, FMT2, BF16_2, BLOCK_N)
    tl.store(part_m_ptr + (token * num_splits + split) * num_heads + h, m, mask=h_mask)


@triton.jit
def attend_kernel(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_heads, scale, chunk_keys, num_splits, first1, first2,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block, split): the split's (one chunk's) sums at the maximum of ``split_max_kernel``'s results
    into ``part_acc_ptr`` [T, splits, H, D] and ``part_l_ptr`` [T, splits, H]."""
    token = tl.program_id(0).to(tl.int64)
    h, d, h_mask, d_mask, q_mask, q = _query(q_ptr, num_heads, token, WIDTH, BLOCK_H, BLOCK_D)
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    split = tl.program_id(2)
    m = _global_max(sink, part_m_ptr, token, num_splits, num_heads, h, h_mask)
    # Only the source owning the split has a non-empty range: the split's sums start from zero.
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    lo, hi = _split_range(split, 0, first1, chunk_keys, keys0)
    acc, denom = _range_sums(
        acc, denom, m, q, pool0, rows0, stride0, lo, hi, bytes0, token, scale, d, d_mask,
        WIDTH, FMT0, BF16_0, ROUND, BLOCK_N,
    )  # fmt: skip
    lo, hi = _split_range(split, first1, first2 - first1, chunk_keys, keys1)
    acc, denom = _range_sums(
        acc, denom, m, q, pool1, rows1, stride1, lo, hi, bytes1, token, scale, d, d_mask,
        WIDTH, FMT1, BF16_1, ROUND, BLOCK_N,
    )  # fmt: skip
    lo, hi = _split_range(split, first2, num_splits - first2, chunk_keys, keys2)
    acc, denom = _range_sums(
        acc, denom, m, q, pool2, rows2, stride2, lo, hi, bytes2, token, scale, d, d_mask,
        WIDTH, FMT2, BF16_2, ROUND, BLOCK_N,
    )  # fmt: skip
    part_row = (token * num_splits + split) * num_heads + h
    tl.store(part_acc_ptr + part_row[:, None] * WIDTH + d[None, :], acc, mask=q_mask)
    tl.store(part_l_ptr + part_row, denom, mask=h_mask)


@triton.jit
def combine_kernel(  # type: ignore[no-untyped-def]
    sink_ptr, out_ptr, part_m_ptr, part_acc_ptr, part_l_ptr, num_heads, num_splits,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block): the sink's term, then every split's sums added in split order, and the output."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < num_heads
    mask = h_mask[:, None] & (d < WIDTH)[None, :]
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    denom = tl.exp(sink - _global_max(sink, part_m_ptr, token, num_splits, num_heads, h, h_mask))
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        part = (token * num_splits + s) * num_heads + h
        acc += tl.load(part_acc_ptr + part[:, None] * WIDTH + d[None, :], mask=mask, other=0.0)
        denom += tl.load(part_l_ptr + part, mask=h_mask, other=0.0)
    tl.store(out_ptr + ((token * num_heads + h[:, None]) * WIDTH + d[None, :]), acc / denom[:, None], mask=mask)
