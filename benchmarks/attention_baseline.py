"""The non-split sparse-attention path as it was before the prefill kernel (``prefill_kernel`` in
``cuda/attention_kernels.py``), kept only so that ``kernels_attention.py`` times the old and the new path in one
process.

Grid (query, block of 32 heads); pass 1 takes the maximum over every key, pass 2 recomputes every logit and sums
``exp(logit − max)`` and the value products (the device functions of the 32-head split kernels of that time, kept
here with it; tiles: 32 heads, 32 keys, 8 warps, 2 stages). At sm_90 it spilled: 255 registers, about 500 bytes of
stack, mma.sync (HMMA) dots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import KeySource, RowFormat
from deepinfer_kernels.cuda.attention import INVARIANT_CHUNK_KEYS, _source_args
from deepinfer_kernels.cuda.attention_kernels import _add_value_products
from deepinfer_kernels.cuda.row_formats import FORMAT_CODES, decode_tile
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = ["TILES", "sparse_attention_before"]

TILES = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2}


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
        acc = _add_value_products(acc, probs, keys, BF16_DOT, ROUND)
    return acc, denom


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
def _source_sums(  # type: ignore[no-untyped-def]
    acc, denom, m, q, pool_ptr, rows_ptr, stride_rows, num_keys, chunk_keys, row_bytes, token, scale, d, d_mask,
    WIDTH: tl.constexpr, FMT: tl.constexpr, BF16_DOT: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    if FOLD:
        for lo in range(0, num_keys, chunk_keys):
            part, part_l = _range_sums(
                tl.zeros([BLOCK_H, BLOCK_D], tl.float32), tl.zeros([BLOCK_H], tl.float32), m, q, pool_ptr, rows_ptr,
                stride_rows, lo, tl.minimum(lo + chunk_keys, num_keys), row_bytes, token, scale, d, d_mask,
                WIDTH, FMT, BF16_DOT, ROUND, BLOCK_N,
            )  # fmt: skip
            acc += part
            denom += part_l
    else:
        acc, denom = _range_sums(
            acc, denom, m, q, pool_ptr, rows_ptr, stride_rows, 0, num_keys, row_bytes, token, scale, d, d_mask,
            WIDTH, FMT, BF16_DOT, ROUND, BLOCK_N,
        )  # fmt: skip
    return acc, denom


@triton.jit
def attend_before_kernel(  # type: ignore[no-untyped-def]
    q_ptr, sink_ptr, out_ptr, num_heads, scale, chunk_keys,
    pool0, rows0, stride0, keys0, bytes0, pool1, rows1, stride1, keys1, bytes1, pool2, rows2, stride2, keys2, bytes2,
    WIDTH: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT0: tl.constexpr, FMT1: tl.constexpr, FMT2: tl.constexpr,
    BF16_0: tl.constexpr, BF16_1: tl.constexpr, BF16_2: tl.constexpr,
    ROUND: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h, d, h_mask, d_mask, q_mask, q = _query(q_ptr, num_heads, token, WIDTH, BLOCK_H, BLOCK_D)
    sink = tl.load(sink_ptr + h, mask=h_mask, other=0.0)
    m = sink
    m = _range_max(m, q, pool0, rows0, stride0, 0, keys0, bytes0, token, scale, d, d_mask, WIDTH, FMT0, BF16_0, BLOCK_N)
    m = _range_max(m, q, pool1, rows1, stride1, 0, keys1, bytes1, token, scale, d, d_mask, WIDTH, FMT1, BF16_1, BLOCK_N)
    m = _range_max(m, q, pool2, rows2, stride2, 0, keys2, bytes2, token, scale, d, d_mask, WIDTH, FMT2, BF16_2, BLOCK_N)
    denom = tl.exp(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    acc, denom = _source_sums(
        acc, denom, m, q, pool0, rows0, stride0, keys0, chunk_keys, bytes0, token, scale, d, d_mask,
        WIDTH, FMT0, BF16_0, ROUND, BLOCK_H, BLOCK_D, BLOCK_N, FOLD,
    )  # fmt: skip
    acc, denom = _source_sums(
        acc, denom, m, q, pool1, rows1, stride1, keys1, chunk_keys, bytes1, token, scale, d, d_mask,
        WIDTH, FMT1, BF16_1, ROUND, BLOCK_H, BLOCK_D, BLOCK_N, FOLD,
    )  # fmt: skip
    acc, denom = _source_sums(
        acc, denom, m, q, pool2, rows2, stride2, keys2, chunk_keys, bytes2, token, scale, d, d_mask,
        WIDTH, FMT2, BF16_2, ROUND, BLOCK_H, BLOCK_D, BLOCK_N, FOLD,
    )  # fmt: skip
    offsets = (token * num_heads + h[:, None]) * WIDTH + d[None, :]
    tl.store(out_ptr + offsets, acc / denom[:, None], mask=q_mask)


def sparse_attention_before(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    out: torch.Tensor,
) -> None:
    """The old non-split launch on CUDA tensors: q [T, H, D] bf16, at most three sources with non-empty pools, out
    [T, H, D] fp32 written."""
    num_tokens, num_heads, width = q.shape
    empty = KeySource(
        torch.zeros((1, 4 * width), dtype=torch.uint8, device=q.device),
        torch.empty((num_tokens, 0), dtype=torch.int64, device=q.device),
        RowFormat.RAW_FP32,
    )
    padded = list(sources) + [empty] * (3 - len(sources))
    bf16_dots = q.dtype == torch.bfloat16 and not triton_interpreter_enabled()
    fmt_args: dict[str, object] = {}
    for i, source in enumerate(padded):
        fmt_args[f"FMT{i}"] = FORMAT_CODES[source.fmt]
        fmt_args[f"BF16_{i}"] = bf16_dots and source.fmt is not RowFormat.RAW_FP32
    attend_before_kernel[(num_tokens, triton.cdiv(num_heads, TILES["block_h"]))](
        q, sink, out, num_heads, scale, INVARIANT_CHUNK_KEYS, *_source_args(padded, 0, num_tokens),
        WIDTH=width, BLOCK_D=max(triton.next_power_of_2(width), 16), BLOCK_H=TILES["block_h"],
        BLOCK_N=TILES["block_n"], **fmt_args, ROUND=round_probs_bf16, FOLD=invariant_kernels(),
        num_warps=TILES["num_warps"], num_stages=TILES["num_stages"],
    )  # fmt: skip
