"""Triton sparse attention over up to three key sources read straight from their pools (docs/design/kernels.md,
"sparse_attention"); the kernels are in ``cuda/attention_kernels.py``.

Every probability is taken relative to the final softmax maximum (over the sink and every valid key), not a running
one: that makes its BF16 rounding in exact mode the reference's, so the output differs from the reference only by
FP32 summation order; a running maximum rounds each probability at another scale, a relative error of 2^-9 on every
term that exact mode then turns into BF16/FP8 rounding flips everywhere.

A program covers a block of heads of one query (:data:`TILES`: all 64 heads of a V4.1-Flash query, so each key tile
is gathered and decoded once per pass for all of them and both dots are Hopper ``wgmma``) and makes two passes over
its keys: the first writes the logits to a workspace and finds the maximum, the second reads them back and sums.
Many queries (prefill, or a decode batch that fills the device): one program per (query, head block) over all its
keys (``prefill_kernel``). Few queries (decode): each source's key list is cut into chunks from the source's start
and every chunk is a split with its own programs: ``split_logits_kernel`` runs pass 1 over a split and writes its
maximum, ``split_sums_kernel`` takes the maximum over the sink and all splits' maxima and sums its split's keys at
it, and ``combine_kernel`` adds the splits' sums in split order and divides. The partial sums are
O(queries × splits × H × D), bounded by launches of at most :data:`SPLIT_WORKSPACE_BYTES`.

Batch invariance (docs/design/numerics.md, "Batch invariance"): inside ``batch_invariant_ops`` the keys are cut into
chunks of a fixed :data:`INVARIANT_CHUNK_KEYS` keys counted from each source's start, so a chunk holds the same key
positions whatever the other requests of the step: a source's width (the step's longest list, e.g. the draft block)
moves only its own last chunks, and chunks past a query's own keys hold −1 rows only and add exact zeros. Every chunk is
summed from zero in tile order by ``sums_pass`` at the same tiles and the chunk sums are added in chunk order after the
sink's term; the maximum is exact in any order. Few queries take the split path (a chunk a split, the combine adds them;
pass 1, whose logits and maximum do not depend on how it is cut, in one-tile splits); queries that fill the device take
``chunks_kernel``, which makes the same additions in one program per (query, head block) and writes no partial sums (at
batch 256 of the scaled preset they were 200 MB a layer, written and read back). (The non-split ``prefill_kernel`` sums
a query's keys in one run, so its bits differ: the invariant mode never runs it.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import torch
import triton

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import KeySource, RowFormat
from deepinfer_kernels.cuda import flashmla
from deepinfer_kernels.cuda._launch import check_launchable, dependent_launch
from deepinfer_kernels.cuda.attention_kernels import (
    chunks_kernel,
    combine_kernel,
    prefill_kernel,
    split_logits_kernel,
    split_sums_kernel,
)
from deepinfer_kernels.cuda.row_formats import FORMAT_CODES
from deepinfer_kernels.platform import triton_interpreter_enabled
from deepinfer_kernels.reference import attention as reference

__all__ = [
    "COMBINE_TILES",
    "FP32_TILES",
    "INVARIANT_CHUNK_KEYS",
    "MAX_SOURCES",
    "PREFILL_WORKSPACE_BYTES",
    "SPLIT_WORKSPACE_BYTES",
    "TILES",
    "sparse_attention",
    "unwidened_attention",
]

MAX_SOURCES = 3
# Both paths' tiles when every dot is a BF16 tensor-core dot. 64 heads (all of a V4.1-Flash query) per program: each
# key tile is gathered and decoded once per pass for all of them, and M = 64 makes both dots Hopper wgmma. block_v:
# value columns per pass-2 sweep; the whole width in one sweep keeps the [64, 512] FP32 accumulator (128 registers a
# thread at 8 warps) beside 16-key tiles: 253-255 registers at sm_90 and no spill (Triton 3.9; 3.6 spills 8-16 bytes
# when FP4_E4M3 rows meet FP8 rows); wider tiles or 16 warps spill (docs/design/kernels.md, "sparse_attention").
# logits_block_n: keys per pass-1 tile of every kernel (pass 1 holds no accumulator to compete for registers): 32 keys
# halve pass 1's dependent gathers; the non-split kernel then takes 255 registers and 16 bytes of stack at sm_90
# (Triton 3.6: three stores and loads a program, between the key loops, for the next tile's prefetched row indices;
# 64 keys spill in the loops). The split and chunks kernels take it for chunks of at least as many keys, else
# block_n (:func:`_chunk_logits_tile`: a one-query decode splits into 16-key chunks, where a 32-key tile would
# multiply a masked half); both kernels follow the same rule, so their logits are the same.
# chunks_block_v: value columns per pass-2 sweep of the batch-invariant ``chunks_kernel``, which holds two accumulators
# (the running total and the chunk's). One 512-column sweep spills 62 bytes at sm_90 (Triton 3.6), two of 256 16 and
# four of 128 none, yet at 256 decode queries of the scaled preset they took 0.295, 0.356 and 0.452 ms a call
# (kernels_attention-h200-chunksv.json; the normal mode 0.232): each sweep gathers and weighs every key again.
# (Columns are independent sums: the sweep width does not change their bits.)
TILES: dict[str, int] = {
    "block_h": 64,
    "block_n": 16,
    "logits_block_n": 32,
    "block_v": 512,
    "chunks_block_v": 512,
    "num_warps": 8,
    "num_stages": 1,
}
# FP32 dots (FP32 queries or rows, unrounded probabilities, Triton's interpreter): FMA dots hold both operands in
# registers, and 16 heads fit where 64 spill kilobytes.
FP32_TILES: dict[str, int] = {
    "block_h": 16,
    "block_n": 16,
    "logits_block_n": 16,
    "block_v": 512,
    "chunks_block_v": 256,
    "num_warps": 4,
    "num_stages": 1,
}
# The split path's combine: heads and value columns per program (it only adds and divides: small blocks keep its
# [block_h, block_c] FP32 sum and 16 splits' loads of it in registers and give a one-query step several programs).
COMBINE_TILES: dict[str, int] = {"block_h": 16, "block_c": 32, "num_warps": 4}
# Programs the split path aims for (None: the multiprocessors, at least two); a step of at most half as many splits.
# On an H100 (kernels_attention-h100-s37-targets.json, 640 keys a query) 132 programs against the 264 before took 4
# queries from 35.0 to 23.7 µs a call and 64 queries from 130.8 to 110.7 µs (three splits instead of five), one query
# 21.4 against 21.6 µs; a batch-4 decode step 4.178 / 4.161 → 4.077 ms (roofline-h100-s37-split-t*.json).
SPLIT_TARGET_PROGRAMS: int | None = None
# The largest logits workspace of one non-split launch (FP32 [queries, heads, keys]); more queries take more launches.
PREFILL_WORKSPACE_BYTES = 256 << 20
# The largest workspace of one split launch: partial sums (FP32 [queries, splits, heads, width]) and logits.
SPLIT_WORKSPACE_BYTES = 256 << 20
# Keys per chunk in batch-invariant mode: eight tiles. A decode query (128 + few + 512 keys) makes six splits, and the
# partial sums the split path writes and reads back stay a quarter of what 32-key chunks would cost (queries that fill
# the device run ``chunks_kernel``, which writes none).
INVARIANT_CHUNK_KEYS = 128


def unwidened_attention(
    q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float, round_probs_bf16: bool
) -> torch.Tensor:
    """:func:`sparse_attention`'s output as the kernel that runs the call leaves it: FlashMLA's BF16 where it takes
    the call (not widened), else the FP32 output."""
    if _on_flashmla(q, sources, sink, round_probs_bf16):
        return flashmla.attend(q, sources, sink, scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    _attention_into(q, sources, sink, scale, round_probs_bf16, out)
    return out


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    out: torch.Tensor,
) -> None:
    """See ``reference.attention.sparse_attention``; more than :data:`MAX_SOURCES` sources take the reference."""
    if _on_flashmla(q, sources, sink, round_probs_bf16):
        flashmla.sparse_attention(q, sources, sink, scale, out)
        return
    _attention_into(q, sources, sink, scale, round_probs_bf16, out)


def _on_flashmla(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, round_probs_bf16: bool) -> bool:
    return len(sources) <= MAX_SOURCES and q.shape[0] > 0 and flashmla.fits(q, sources, sink, round_probs_bf16)


def _attention_into(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    out: torch.Tensor,
) -> None:
    # The package's kernels (the reference beyond MAX_SOURCES sources) into the FP32 out.
    if len(sources) > MAX_SOURCES:
        reference.sparse_attention(q, sources, sink, scale, round_probs_bf16, out)
        return
    check_launchable(q=q, sink=sink, out=out, **{f"rows{i}": s.rows for i, s in enumerate(sources)})
    num_tokens, num_heads, width = q.shape
    if num_tokens == 0:
        return
    # An empty pool (all its rows −1) is replaced by one zero row: Triton needs a real pointer.
    present = [
        s if s.pool.shape[0] else KeySource(s.pool.new_zeros((1, s.pool.shape[1])), s.rows, s.fmt) for s in sources
    ]
    # An absent source is an empty one (zero keys, its pointers never read) in the first source's pool and format:
    # its loops then repeat code the kernel has anyway (an FP32-row loop beside BF16 dots costs registers).
    if present:
        first = present[0]
    else:
        zero_row = torch.zeros((1, 4 * width), dtype=torch.uint8, device=q.device)
        first = KeySource(
            zero_row, torch.empty((num_tokens, 0), dtype=torch.int64, device=q.device), RowFormat.RAW_FP32
        )
    empty = KeySource(first.pool, first.rows.new_empty((num_tokens, 0)), first.fmt)
    padded = present + [empty] * (MAX_SOURCES - len(sources))
    bf16_dots = q.dtype == torch.bfloat16 and not triton_interpreter_enabled()
    fmt_args: dict[str, object] = {}
    for i, source in enumerate(padded):
        fmt_args[f"FMT{i}"] = FORMAT_CODES[source.fmt]
        # Quantized rows decode to BF16-exact values, so BF16 products with a BF16 query are exact. (Triton's
        # interpreter computes BF16 dots wrongly; there the same products run as FP32 dots.)
        fmt_args[f"BF16_{i}"] = bf16_dots and source.fmt is not RowFormat.RAW_FP32
    # The 64-head tiles when every source's dots are BF16 (the value product is one only with rounded probabilities).
    # The formats decide, not whether a source has keys in this step: a query gets the same tiles, hence the same
    # bits, whatever the other requests hold (batch invariance). (No source at all: the zero row's FP32 tiles.)
    all_bf16 = round_probs_bf16 and all(fmt_args[f"BF16_{i}"] for i in range(max(len(sources), 1)))
    tiles = TILES if all_bf16 else FP32_TILES
    constexprs = {
        "WIDTH": width,
        "BLOCK_D": _block_d(width),
        "BLOCK_H": tiles["block_h"],
        "BLOCK_N": tiles["block_n"],
        **fmt_args,
        "num_warps": tiles["num_warps"],
        "num_stages": tiles["num_stages"],
    }
    programs = num_tokens * triton.cdiv(num_heads, tiles["block_h"])
    chunk_keys, split_counts = _split_plan(programs, [s.rows.shape[1] for s in sources], tiles["block_n"], q.device)
    call = _Call(q, padded, sink, scale, round_probs_bf16, out, tiles, constexprs)
    if split_counts:
        _split(call, chunk_keys, split_counts)
    elif invariant_kernels():
        _chunks(call, chunk_keys)
    else:
        _prefill(call)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One ``sparse_attention`` call as the launchers take it: the sources padded to :data:`MAX_SOURCES`, the tiles
    and the kernels' shared constexprs."""

    q: torch.Tensor
    sources: list[KeySource]
    sink: torch.Tensor
    scale: float
    round_probs_bf16: bool
    out: torch.Tensor
    tiles: dict[str, int]
    constexprs: dict[str, object]


def _block_d(width: int) -> int:
    return max(triton.next_power_of_2(width), 16)


def _value_columns(tiles: dict[str, int], width: int, chunks: bool = False) -> int:
    """Columns of a pass-2 sweep (of ``chunks_kernel`` when ``chunks``): whole scale groups (``decode_groups``), so at
    least 32, the largest group."""
    return min(max(tiles["chunks_block_v" if chunks else "block_v"], 32), _block_d(width))


def _split(call: _Call, chunk_keys: int, split_counts: list[int]) -> None:
    """The split path: pass 1 and pass 2 per (query, head block, split), then the combine, in launches whose partial
    sums and logits stay within :data:`SPLIT_WORKSPACE_BYTES` (few queries: one launch at the preset's shapes). Buffers
    are sized from T, splits and H only (host shapes), so a captured step replays with the same plan.

    Pass 1 splits as pass 2 does, except inside ``batch_invariant_ops``, where each of its splits is one logits tile:
    the logits and the maximum (exact in any order) do not depend on how pass 1 is cut, only pass 2's sums do, and
    a one-query step's pass 1 then has a program per tile instead of one per chunk of several tiles, each tile's
    gather waiting on the last (at batch 1 on the H200 12.3 µs a call against 4.4 in the normal mode's one-tile
    splits, profile_step-h200-scaled-invariant-adf135a.json; not yet timed this way)."""
    q, sources, tiles, constexprs = call.q, call.sources, call.tiles, call.constexprs
    num_tokens, num_heads, width = q.shape
    counts = split_counts + [0] * (MAX_SOURCES - len(split_counts))
    num_splits = max(sum(counts), 1)
    logits_tile = _chunk_logits_tile(tiles, chunk_keys)
    logit_keys = logits_tile if invariant_kernels() else chunk_keys
    logit_counts = [triton.cdiv(s.rows.shape[1], logit_keys) for s in sources]
    logit_counts += [0] * (MAX_SOURCES - len(logit_counts))
    num_maxima = max(sum(logit_counts), 1)
    head_blocks = triton.cdiv(num_heads, tiles["block_h"])
    head_rows = head_blocks * tiles["block_h"]
    num_keys = max(sum(s.rows.shape[1] for s in sources), 1)
    query_bytes = (num_splits * (width + 1) + num_maxima) * num_heads * 4 + head_rows * num_keys * 4
    rows = min(max(1, SPLIT_WORKSPACE_BYTES // query_bytes), num_tokens)
    part_m = torch.empty((rows, num_maxima, num_heads), dtype=torch.float32, device=q.device)
    part_l = torch.empty((rows, num_splits, num_heads), dtype=torch.float32, device=q.device)
    part_acc = torch.empty((rows, num_splits, num_heads, width), dtype=torch.float32, device=q.device)
    logits = torch.empty((rows, head_rows, num_keys), dtype=torch.float32, device=q.device)
    combine = {"BLOCK_H": COMBINE_TILES["block_h"], "BLOCK_C": min(COMBINE_TILES["block_c"], _block_d(width))}
    combine_grid = (triton.cdiv(num_heads, combine["BLOCK_H"]), triton.cdiv(width, combine["BLOCK_C"]))
    for start in range(0, num_tokens, rows):
        stop = min(start + rows, num_tokens)
        keys = _source_args(sources, start, stop)
        logit_plan = (logit_keys, num_maxima, logit_counts[0], logit_counts[0] + logit_counts[1], *keys)
        split_logits_kernel[(stop - start, head_blocks, num_maxima)](
            q[start:stop], part_m, logits, num_heads, call.scale, *logit_plan, LOGITS_BLOCK_N=logits_tile,
            **constexprs,
            **dependent_launch(q.device),
        )  # fmt: skip
        plan = (chunk_keys, num_splits, counts[0], counts[0] + counts[1], *keys)
        split_sums_kernel[(stop - start, head_blocks, num_splits)](
            call.sink, part_acc, part_m, part_l, logits, num_heads, num_maxima, *plan,
            BLOCK_V=_value_columns(tiles, width), ROUND=call.round_probs_bf16, **constexprs,
            **dependent_launch(call.sink.device),
        )  # fmt: skip
        combine_kernel[(stop - start, *combine_grid)](
            call.sink, call.out[start:stop], part_m, part_acc, part_l, num_heads, num_maxima, num_splits, WIDTH=width,
            **combine, num_warps=COMBINE_TILES["num_warps"],
            **dependent_launch(call.sink.device),
        )  # fmt: skip


def _source_args(sources: list[KeySource], start: int, stop: int) -> list[object]:
    """(pool, rows, row stride, keys, bytes per row) of every source for queries ``start … stop − 1``."""
    args: list[object] = []
    for source in sources:
        rows = source.rows[start:stop]
        args += [source.pool, rows, source.rows.stride(0), rows.shape[1], source.pool.shape[1]]
    return args


def _prefill(call: _Call) -> None:
    """The non-split path: one program per (query, head block) over all its keys."""
    for start, stop, logits in _unsplit_launches(call):
        prefill_kernel[(stop - start, logits.shape[1] // call.tiles["block_h"])](
            call.q[start:stop], call.sink, call.out[start:stop], logits, call.q.shape[1], call.scale,
            *_source_args(call.sources, start, stop), BLOCK_V=_value_columns(call.tiles, call.q.shape[2]),
            ROUND=call.round_probs_bf16, LOGITS_BLOCK_N=call.tiles["logits_block_n"], **call.constexprs,
            **dependent_launch(call.q.device),
        )  # fmt: skip


def _chunks(call: _Call, chunk_keys: int) -> None:
    """The batch-invariant mode's unsplit path: one program per (query, head block) making the split path's additions
    over chunks of ``chunk_keys`` keys."""
    for start, stop, logits in _unsplit_launches(call):
        chunks_kernel[(stop - start, logits.shape[1] // call.tiles["block_h"])](
            call.q[start:stop], call.sink, call.out[start:stop], logits, call.q.shape[1], call.scale, chunk_keys,
            *_source_args(call.sources, start, stop), BLOCK_V=_value_columns(call.tiles, call.q.shape[2], chunks=True),
            ROUND=call.round_probs_bf16, LOGITS_BLOCK_N=_chunk_logits_tile(call.tiles, chunk_keys),
            **call.constexprs,
            **dependent_launch(call.q.device),
        )  # fmt: skip


def _chunk_logits_tile(tiles: dict[str, int], chunk_keys: int) -> int:
    """Keys per pass-1 tile over chunks of ``chunk_keys`` keys (split or ``chunks_kernel``)."""
    return tiles["logits_block_n"] if chunk_keys >= tiles["logits_block_n"] else tiles["block_n"]


def _unsplit_launches(call: _Call) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first query, end query, logits workspace) of each launch of a path with one program per (query, head block):
    launches whose FP32 logits workspace [queries, head rows, keys] stays within :data:`PREFILL_WORKSPACE_BYTES`
    (sized from host shapes only, so a captured step replays)."""
    num_tokens, num_heads, _ = call.q.shape
    head_rows = triton.cdiv(num_heads, call.tiles["block_h"]) * call.tiles["block_h"]
    num_keys = sum(source.rows.shape[1] for source in call.sources)
    queries = max(1, PREFILL_WORKSPACE_BYTES // max(head_rows * num_keys * 4, 1))
    logits = torch.empty(
        (min(queries, num_tokens), head_rows, max(num_keys, 1)), dtype=torch.float32, device=call.q.device
    )
    for start in range(0, num_tokens, queries):
        yield start, min(start + queries, num_tokens), logits


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_plan(programs: int, widths: list[int], block_n: int, device: torch.device) -> tuple[int, list[int]]:
    """(keys per chunk, splits per source; an empty list = no split, one program per query and head block).

    Each source's keys are cut into chunks of ``chunk_keys`` (a multiple of the tile's ``block_n`` keys) from the
    source's start; with splits, every chunk is one split. Splits are taken when the ``programs`` of (query, head
    block) alone would leave the device idle (decode): at most half the target of one program a multiprocessor (a
    64-head program holds a whole multiprocessor's registers, so more already fill the device, and two splits would
    only add the partial sums and the combine: 256 queries on the H200 took 0.38 ms a call in two splits, where the
    unsplit kernel's rate at 8,192 queries gives 0.32); the chunks are sized to reach the target. The target is at
    least two, so that one program splits on any device (the CPU's interpreter too).
    Inside ``batch_invariant_ops`` the chunks are :data:`INVARIANT_CHUNK_KEYS` keys whatever the batch, split under
    the same rule or else added in one program by ``chunks_kernel``: the same additions give a query the same bits
    alone and in any batch (docs/design/numerics.md, "Batch invariance").
    """
    target = SPLIT_TARGET_PROGRAMS or max(_multiprocessors(device), 2)
    few = 2 * programs <= target
    if invariant_kernels():
        return INVARIANT_CHUNK_KEYS, [triton.cdiv(width, INVARIANT_CHUNK_KEYS) for width in widths] if few else []
    tiles = max(triton.cdiv(sum(widths), block_n), 1)
    wanted = min(tiles, triton.cdiv(target, programs)) if few else 1
    chunk_keys = triton.cdiv(tiles, wanted) * block_n
    counts = [triton.cdiv(width, chunk_keys) for width in widths]
    return chunk_keys, counts if wanted > 1 and sum(counts) > 1 else []
