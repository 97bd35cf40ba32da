"""Triton kernel of sparse attention's non-split path (prefill; the launcher and the why are in ``cuda/attention.py``).

One program per (query, block of heads) makes two passes over the query's keys, source after source. Pass 1 gathers
and decodes every key tile, takes its logits for the whole head block in one dot, writes them to the program's rows
of a logits workspace and raises the maximum. Pass 2 gathers and decodes the tiles again, reads the logits back
instead of recomputing them, and sums ``exp(logit − max)`` and the value products. Keeping the query out of pass 2 is
what keeps the kernel in registers: a ``[64, 512]`` query operand needs 32 shared-memory descriptors per dot that the
compiler hoists out of the key loop, and next to the ``[64, 512]`` FP32 accumulator they spilled.

Pass 2 runs once per ``BLOCK_V`` value columns (one sweep at the default width); every sweep takes the same logits in
the same order, so the sums of a column are the same additions whatever ``BLOCK_V`` is. Batch-invariant mode never
runs this kernel (``cuda/attention.py``).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.cuda.attention_kernels import add_value_products
from deepinfer_kernels.cuda.row_formats import decode_groups

__all__ = ["prefill_kernel"]


@triton.jit
def _tile_rows(rows_ptr, stride_rows, token, n, hi):  # type: ignore[no-untyped-def]
    """Whether keys ``n`` [BLOCK_N] of the query hold a row (below ``hi`` and not −1), and their pool rows."""
    idx = tl.load(rows_ptr + token * stride_rows + n, mask=n < hi, other=-1).to(tl.int64)
    return idx >= 0, tl.maximum(idx, 0)


@triton.jit
def _decode(pool_ptr, idx, valid, row_bytes, FIRST, COLS, WIDTH: tl.constexpr, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Elements ``FIRST … FIRST + COLS − 1`` of the rows ``idx``: FP32 [BLOCK_N, COLS], zero for invalid keys."""
    return decode_groups(pool_ptr, idx * row_bytes, valid, FIRST, COLS, WIDTH, FMT)


@triton.jit
def _source_max(  # type: ignore[no-untyped-def]
    m, q, pool_ptr, rows_ptr, stride_rows, num_keys, row_bytes, token, scale, logits_ptr,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Pass 1 over one source: ``m`` [BLOCK_H] raised to its largest logit; every logit (−inf for a missing row) written
    to ``logits_ptr`` [BLOCK_H, 1] (the program's workspace rows at the source's first key) plus the key."""
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid, idx = _tile_rows(rows_ptr, stride_rows, token, n, num_keys)
        keys = _decode(pool_ptr, idx, valid, row_bytes, 0, BLOCK_D, WIDTH, FMT)
        if BF16_DOT:
            logits = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))
        else:
            logits = tl.dot(q.to(tl.float32), tl.trans(keys), input_precision="ieee")
        logits = tl.where(valid[None, :], logits * scale, float("-inf"))
        tl.store(logits_ptr + n[None, :], logits, mask=(n < num_keys)[None, :])
        m = tl.maximum(m, tl.max(logits, axis=1))
    return m


@triton.jit
def _source_sums(  # type: ignore[no-untyped-def]
    acc, denom, m, pool_ptr, rows_ptr, stride_rows, num_keys, row_bytes, token, V_FIRST, logits_ptr,
    WIDTH: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Pass 2 over one source, tile by tile in key order: ``acc`` [BLOCK_H, BLOCK_V] plus Σ p·k over the value
    columns ``V_FIRST …`` and ``denom`` [BLOCK_H] plus Σ p, p = exp(logit − m) with the logits of pass 1."""
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid, idx = _tile_rows(rows_ptr, stride_rows, token, n, num_keys)
        values = _decode(pool_ptr, idx, valid, row_bytes, V_FIRST, BLOCK_V, WIDTH, FMT)
        logits = tl.load(logits_ptr + n[None, :], mask=(n < num_keys)[None, :], other=float("-inf"))
        probs = tl.exp(logits - m[:, None])
        denom += tl.sum(probs, axis=1)
        acc = add_value_products(acc, probs, values, BF16_DOT, ROUND)
    return acc, denom


@triton.jit
def prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, out_ptr, logits_ptr, num_heads, scale,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
    ROUND: tl.constexpr,
):  # fmt: skip
    """Grid (query, head block): the maximum over the sink and every key (pass 1), then per ``BLOCK_V`` value columns
    the sink's term and every key's sums added in key order (pass 2), and the output. ``logits_ptr``: the workspace
    [queries, head blocks · BLOCK_H, keys0 + keys1 + keys2] fp32, the sources' logits side by side."""
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < num_heads
    d = tl.arange(0, BLOCK_D)
    q_mask = h_mask[:, None] & (d < WIDTH)[None, :]
    q = tl.load(q_ptr + (token * num_heads + h[:, None]) * WIDTH + d[None, :], mask=q_mask, other=0.0)
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    num_keys = keys0 + keys1 + keys2
    block_row = token * tl.num_programs(1) + tl.program_id(1)
    logits0 = logits_ptr + (block_row * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]) * num_keys
    logits1 = logits0 + keys0
    logits2 = logits1 + keys1
    m = _source_max(
        sink, q, pool0, rows0, stride0, keys0, bytes0, token, scale, logits0, WIDTH, BLOCK_D, FMT0, BF16_0, BLOCK_N
    )
    m = _source_max(
        m, q, pool1, rows1, stride1, keys1, bytes1, token, scale, logits1, WIDTH, BLOCK_D, FMT1, BF16_1, BLOCK_N
    )
    m = _source_max(
        m, q, pool2, rows2, stride2, keys2, bytes2, token, scale, logits2, WIDTH, BLOCK_D, FMT2, BF16_2, BLOCK_N
    )
    # Pass 2 reads logits that other threads of the program wrote: a CTA barrier orders the global memory accesses.
    tl.debug_barrier()
    for v in tl.static_range(0, BLOCK_D, BLOCK_V):
        dv = v + tl.arange(0, BLOCK_V)
        # The sink is a logit with a zero value: it enters the denominator only, first, as in the combine.
        denom = tl.exp(sink - m)
        acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
        acc, denom = _source_sums(
            acc, denom, m, pool0, rows0, stride0, keys0, bytes0, token, v, logits0,
            WIDTH, FMT0, BF16_0, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        acc, denom = _source_sums(
            acc, denom, m, pool1, rows1, stride1, keys1, bytes1, token, v, logits1,
            WIDTH, FMT1, BF16_1, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        acc, denom = _source_sums(
            acc, denom, m, pool2, rows2, stride2, keys2, bytes2, token, v, logits2,
            WIDTH, FMT2, BF16_2, ROUND, BLOCK_N, BLOCK_V,
        )  # fmt: skip
        out_offsets = (token * num_heads + h[:, None]) * WIDTH + dv[None, :]
        tl.store(out_ptr + out_offsets, acc / denom[:, None], mask=h_mask[:, None] & (dv < WIDTH)[None, :])
