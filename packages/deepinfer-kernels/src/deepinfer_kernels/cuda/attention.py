"""Triton sparse attention over up to three key sources read straight from their pools (docs/design/kernels.md,
"sparse_attention").

One program per (query, block of heads, split of the key list). Two passes over the gathered rows (decoded in
registers from FP8 / FP4 / FP32 rows): the first finds the softmax maximum over the sink and every key of every
source, the second sums ``exp(logit − max)`` and the value products of its split's keys. Taking every probability
relative to the final maximum (rather than a running one) makes its BF16 rounding in exact mode the reference's, so
the output differs from the reference only by FP32 summation order; a running maximum rounds each probability at
another scale, a relative error of 2^-9 on every term that exact mode then turns into BF16/FP8 rounding flips
everywhere. When few queries run (decode), the key list is split over several programs that share the maximum (each
finds it over all keys) and whose sums are added afterwards (flash-decoding); the partial sums are
O(queries × splits × H × D), bounded because only few queries split.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import KeySource, RowFormat
from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.cuda.row_formats import FORMAT_CODES, decode_tile, round_bf16
from deepinfer_kernels.platform import triton_interpreter_enabled
from deepinfer_kernels.reference import attention as reference

__all__ = ["MAX_SOURCES", "sparse_attention"]

MAX_SOURCES = 3
# Heads per program and keys per tile (H200 sweep in docs/design/kernels.md, "What ran on the H200").
# target_programs: programs to aim for when splitting the key list (None = twice the multiprocessors).
CONFIG: dict[str, int | None] = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2, "target_programs": None}


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
def _source_max(  # type: ignore[no-untyped-def]
    m,
    q,
    pool_ptr,
    rows_ptr,
    stride_rows,
    num_keys,
    row_bytes,
    token,
    scale,
    d,
    d_mask,
    WIDTH: tl.constexpr,
    FMT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Every key of the source, whatever the split: all splits must take their probabilities at one maximum.
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        logits, _ = _source_logits(
            q, pool_ptr, rows_ptr, stride_rows, n, num_keys, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT
        )
        m = tl.maximum(m, tl.max(logits, axis=1))
    return m


@triton.jit
def _attend_source(  # type: ignore[no-untyped-def]
    acc,
    denom,
    m,
    q,
    pool_ptr,
    rows_ptr,
    stride_rows,
    num_keys,
    offset,
    split_start,
    split_keys,
    row_bytes,
    token,
    scale,
    d,
    d_mask,
    WIDTH: tl.constexpr,
    FMT: tl.constexpr,
    BF16_DOT: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # This program's share of the source: keys [lo, hi) of the split's range of the concatenated key list.
    lo = tl.minimum(tl.maximum(split_start - offset, 0), num_keys)
    hi = tl.minimum(tl.maximum(split_start + split_keys - offset, 0), num_keys)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        logits, keys = _source_logits(
            q, pool_ptr, rows_ptr, stride_rows, n, hi, row_bytes, token, scale, d, d_mask, WIDTH, FMT, BF16_DOT
        )
        probs = tl.exp(logits - m[:, None])
        denom += tl.sum(probs, axis=1)
        if ROUND and BF16_DOT:
            acc += tl.dot(round_bf16(probs), keys.to(tl.bfloat16))
        elif ROUND:
            acc += tl.dot(round_bf16(probs).to(tl.float32), keys, input_precision="ieee")
        else:
            acc += tl.dot(probs, keys, input_precision="ieee")
    return acc, denom


@triton.jit
def _sparse_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    sink_ptr,
    out_ptr,
    part_l_ptr,
    num_heads,
    scale,
    split_keys,
    pool0,
    rows0,
    stride0,
    keys0,
    bytes0,
    pool1,
    rows1,
    stride1,
    keys1,
    bytes1,
    pool2,
    rows2,
    stride2,
    keys2,
    bytes2,
    WIDTH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr,
    FMT1: tl.constexpr,
    FMT2: tl.constexpr,
    BF16_0: tl.constexpr,
    BF16_1: tl.constexpr,
    BF16_2: tl.constexpr,
    ROUND: tl.constexpr,
    SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    split_start = split * split_keys
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < num_heads
    d_mask = d < WIDTH
    offsets = (token * num_heads + h[:, None]) * WIDTH + d[None, :]
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + offsets, mask=q_mask, other=0.0)
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    # Pass 1: the softmax maximum over the sink and every key.
    m = sink
    m = _source_max(m, q, pool0, rows0, stride0, keys0, bytes0, token, scale, d, d_mask, WIDTH, FMT0, BF16_0, BLOCK_N)
    m = _source_max(m, q, pool1, rows1, stride1, keys1, bytes1, token, scale, d, d_mask, WIDTH, FMT1, BF16_1, BLOCK_N)
    m = _source_max(m, q, pool2, rows2, stride2, keys2, bytes2, token, scale, d, d_mask, WIDTH, FMT2, BF16_2, BLOCK_N)
    # Pass 2: this split's sums at that maximum; the sink (a logit with a zero value) enters once, in split 0.
    denom = tl.where(split == 0, tl.exp(sink - m), 0.0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc, denom = _attend_source(
        acc,
        denom,
        m,
        q,
        pool0,
        rows0,
        stride0,
        keys0,
        0,
        split_start,
        split_keys,
        bytes0,
        token,
        scale,
        d,
        d_mask,
        WIDTH,
        FMT0,
        BF16_0,
        ROUND,
        BLOCK_N,
    )
    acc, denom = _attend_source(
        acc,
        denom,
        m,
        q,
        pool1,
        rows1,
        stride1,
        keys1,
        keys0,
        split_start,
        split_keys,
        bytes1,
        token,
        scale,
        d,
        d_mask,
        WIDTH,
        FMT1,
        BF16_1,
        ROUND,
        BLOCK_N,
    )
    acc, denom = _attend_source(
        acc,
        denom,
        m,
        q,
        pool2,
        rows2,
        stride2,
        keys2,
        keys0 + keys1,
        split_start,
        split_keys,
        bytes2,
        token,
        scale,
        d,
        d_mask,
        WIDTH,
        FMT2,
        BF16_2,
        ROUND,
        BLOCK_N,
    )
    if SPLITS == 1:
        tl.store(out_ptr + offsets, acc / denom[:, None], mask=q_mask)
    else:
        part = (token * SPLITS + split) * num_heads + h
        tl.store(out_ptr + part[:, None] * WIDTH + d[None, :], acc, mask=q_mask)
        tl.store(part_l_ptr + part, denom, mask=h_mask)


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    out: torch.Tensor,
) -> None:
    """See ``reference.attention.sparse_attention``; more than :data:`MAX_SOURCES` sources take the reference."""
    if len(sources) > MAX_SOURCES:
        reference.sparse_attention(q, sources, sink, scale, round_probs_bf16, out)
        return
    check_launchable(q=q, sink=sink, out=out, **{f"rows{i}": s.rows for i, s in enumerate(sources)})
    num_tokens, num_heads, width = q.shape
    if num_tokens == 0:
        return
    # An absent source is an empty one (zero keys); its pointers are never read.
    empty = KeySource(
        torch.zeros((1, 4 * width), dtype=torch.uint8, device=q.device),
        torch.empty((num_tokens, 0), dtype=torch.int64, device=q.device),
        RowFormat.RAW_FP32,
    )
    # An empty pool (all its rows −1) is replaced by one zero row: Triton needs a real pointer.
    present = [
        s if s.pool.shape[0] else KeySource(s.pool.new_zeros((1, s.pool.shape[1])), s.rows, s.fmt) for s in sources
    ]
    padded = present + [empty] * (MAX_SOURCES - len(sources))
    bf16_dots = q.dtype == torch.bfloat16 and not triton_interpreter_enabled()
    source_args: list[object] = []
    fmt_args: dict[str, object] = {}
    for i, source in enumerate(padded):
        source_args += [source.pool, source.rows, source.rows.stride(0), source.rows.shape[1], source.pool.shape[1]]
        fmt_args[f"FMT{i}"] = FORMAT_CODES[source.fmt]
        # Quantized rows decode to BF16-exact values, so BF16 products with a BF16 query are exact. (Triton's
        # interpreter computes BF16 dots wrongly; there the same products run as FP32 dots.)
        fmt_args[f"BF16_{i}"] = bf16_dots and source.fmt is not RowFormat.RAW_FP32
    head_blocks = triton.cdiv(num_heads, CONFIG["block_h"])
    splits, split_keys = _split_plan(num_tokens * head_blocks, sum(s.rows.shape[1] for s in sources), q.device)
    if splits == 1:
        target, part_l = out, out
    else:
        target = torch.empty((num_tokens, splits, num_heads, width), dtype=torch.float32, device=q.device)
        part_l = torch.empty((num_tokens, splits, num_heads), dtype=torch.float32, device=q.device)
    _sparse_attention_kernel[(num_tokens, head_blocks, splits)](
        q,
        sink,
        target,
        part_l,
        num_heads,
        scale,
        split_keys,
        *source_args,
        WIDTH=width,
        BLOCK_D=max(triton.next_power_of_2(width), 16),
        BLOCK_H=CONFIG["block_h"],
        BLOCK_N=CONFIG["block_n"],
        ROUND=round_probs_bf16,
        SPLITS=splits,
        num_warps=CONFIG["num_warps"],
        num_stages=CONFIG["num_stages"],
        **fmt_args,
    )
    if splits > 1:
        # Every split took its probabilities at the same maximum: the sums just add.
        torch.div(target.sum(dim=1), part_l.sum(dim=1)[..., None], out=out)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(programs: int, num_keys: int, device: torch.device) -> tuple[int, int]:
    """(splits of the key list per query, keys per split): enough programs to fill the device when few queries run
    (decode), one split otherwise. Splits hold whole tiles. Inside ``batch_invariant_ops`` always one split: the
    split count follows the number of queries, and a split changes the order of the sums (docs/design/numerics.md,
    "Batch invariance")."""
    block_n = CONFIG["block_n"]
    tiles = max(triton.cdiv(num_keys, block_n), 1)
    if invariant_kernels():
        return 1, tiles * block_n
    target = CONFIG["target_programs"] or 2 * _multiprocessors(device)
    splits = max(1, min(tiles, triton.cdiv(target, programs)))
    split_keys = triton.cdiv(tiles, splits) * block_n
    return triton.cdiv(max(num_keys, 1), split_keys), split_keys
