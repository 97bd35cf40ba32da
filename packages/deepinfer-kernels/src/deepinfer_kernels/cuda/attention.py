"""Triton sparse attention over up to three key sources read straight from their pools (docs/design/kernels.md,
"sparse_attention"); the kernels are in ``cuda/attention_kernels.py``.

Every probability is taken relative to the final softmax maximum (over the sink and every valid key), not a running
one: that makes its BF16 rounding in exact mode the reference's, so the output differs from the reference only by
FP32 summation order; a running maximum rounds each probability at another scale, a relative error of 2^-9 on every
term that exact mode then turns into BF16/FP8 rounding flips everywhere.

Many queries (prefill): one program per (query, block of heads) makes two passes over the gathered rows (decoded in
registers from FP8 / FP4 / FP32 rows), the first for the maximum, the second for ``Σ exp(logit − max)`` and the
value products. Few queries (decode): each source's key list is cut into chunks from the source's start and every
chunk is a split with its own programs: ``split_max_kernel`` writes each split's maximum of its own keys,
``attend_kernel`` takes the maximum over the sink and all splits' maxima and sums its split's keys at it, and
``combine_kernel`` adds the splits' sums in split order and divides. Every key tile is decoded twice whatever the
split count; the partial sums are O(queries × splits × H × D), bounded because only few queries split.

Batch invariance (docs/design/numerics.md, "Batch invariance"): inside ``batch_invariant_ops`` the chunks are a fixed
:data:`INVARIANT_CHUNK_KEYS` keys counted from each source's start, so a chunk holds the same key positions whatever
the other requests of the step: a source's width (the step's longest list, e.g. the draft block) moves only its own
last chunks, and chunks past a query's own keys hold −1 rows only and add exact zeros. Every chunk is summed from
zero in tile order and the chunk sums are added in chunk order after the sink's term, by the combine when split or by
the single program when not (``FOLD``), so whether the step splits (which follows the number of queries) changes no
bit either; the maximum is exact in any order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import KeySource, RowFormat
from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.cuda.attention_kernels import attend_kernel, combine_kernel, split_max_kernel
from deepinfer_kernels.cuda.row_formats import FORMAT_CODES
from deepinfer_kernels.platform import triton_interpreter_enabled
from deepinfer_kernels.reference import attention as reference

__all__ = ["INVARIANT_CHUNK_KEYS", "MAX_SOURCES", "sparse_attention"]

MAX_SOURCES = 3
# Heads per program and keys per tile (H200 sweep in docs/design/kernels.md, "What ran on the H200").
# target_programs: programs to aim for when splitting the key list (None = twice the multiprocessors).
CONFIG: dict[str, int | None] = {"block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2, "target_programs": None}
# Keys per chunk in batch-invariant mode: four tiles. A split then reads 128 rows (67 KB of FP8 rows at width 512)
# against its 32 KB query block, and a decode query (128 + few + 512 keys) still makes six splits per head block,
# while the partial sums written and read back stay half of what 64-key chunks would cost.
INVARIANT_CHUNK_KEYS = 128


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
    chunk_keys, split_counts = _split_plan(num_tokens * head_blocks, [s.rows.shape[1] for s in sources], q.device)
    counts = split_counts + [0] * (MAX_SOURCES - len(split_counts))
    num_splits = max(sum(counts), 1)
    shared = (num_heads, scale, chunk_keys, num_splits, counts[0], counts[0] + counts[1], *source_args)
    blocks = {"WIDTH": width, "BLOCK_D": max(triton.next_power_of_2(width), 16), "BLOCK_H": CONFIG["block_h"]}
    launch = {"num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"]}
    kernel_args = {**blocks, "BLOCK_N": CONFIG["block_n"], **fmt_args, **launch}
    if not split_counts:
        attend_kernel[(num_tokens, head_blocks)](
            q,
            sink,
            out,
            out,
            out,
            *shared,
            ROUND=round_probs_bf16,
            SPLIT=False,
            FOLD=invariant_kernels(),
            **kernel_args,
        )
        return
    # Buffers sized from T, splits and H only (host shapes), so a captured step replays with the same plan.
    part_m = torch.empty((num_tokens, num_splits, num_heads), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((num_tokens, num_splits, num_heads, width), dtype=torch.float32, device=q.device)
    grid = (num_tokens, head_blocks, num_splits)
    split_max_kernel[grid](q, part_m, *shared, **kernel_args)
    attend_kernel[grid](
        q, sink, part_acc, part_m, part_l, *shared, ROUND=round_probs_bf16, SPLIT=True, FOLD=False, **kernel_args
    )
    combine_kernel[(num_tokens, head_blocks)](
        sink, out, part_m, part_acc, part_l, num_heads, num_splits, **blocks, **launch
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(programs: int, widths: list[int], device: torch.device) -> tuple[int, list[int]]:
    """(keys per chunk, splits per source; an empty list = no split, one program per query and head block).

    Each source's keys are cut into chunks of ``chunk_keys`` from the source's start; with splits, every chunk is one
    split. Splits are taken when the queries alone would leave the device idle (decode): about twice the
    multiprocessors in programs. Default mode sizes the chunks to reach that count. Inside ``batch_invariant_ops``
    the chunks are :data:`INVARIANT_CHUNK_KEYS` keys whatever the batch, and a query's bits do not depend on whether
    its chunks are split over programs (docs/design/numerics.md, "Batch invariance").
    """
    block_n = CONFIG["block_n"]
    tiles = max(triton.cdiv(sum(widths), block_n), 1)
    target = CONFIG["target_programs"] or 2 * _multiprocessors(device)
    wanted = min(tiles, triton.cdiv(target, programs))
    chunk_keys = INVARIANT_CHUNK_KEYS if invariant_kernels() else triton.cdiv(tiles, wanted) * block_n
    counts = [triton.cdiv(width, chunk_keys) for width in widths]
    return chunk_keys, counts if wanted > 1 and sum(counts) > 1 else []
