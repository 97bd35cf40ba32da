"""Tile tables of the grouped MXFP4 GEMM in one Triton launch (docs/design/kernels.md, "GEMM tiles and split-K").

Same tables as ``grouped_gemm.expert_tiles``'s PyTorch ops (a stable sort, a scatter-add, cumulative sums and a
``searchsorted``, about fifteen launches per call) from a single launch, for up to :data:`MAX_ROWS` rows. Every
program counts the rows per expert (a histogram of all the ids; cheap next to a launch) and takes the cumulative
sums; then a row program writes its rows' places in the stable expert-sorted order (its expert's first position
plus the number of earlier rows of the same expert), and a tile program writes its tiles' experts (the number of
experts whose tiles end at or before the tile) and row ranges. The rank is quadratic in the rows (each row program
compares its rows with every earlier one), which is why larger calls keep the PyTorch ops.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import await_inputs, dependent_launch

__all__ = ["MAX_ROWS", "expert_tiles_one_launch"]

MAX_ROWS = 2048
_CHUNK = 64
# Ids a program loads at a time when it counts or ranks rows: each load is a dependent global round trip of the loop,
# and 64 at a time made the 1,536 rows of batch 256 two chains of 24 (about 55 µs a call on the H200,
# profile_step-h200-scaled-acaace5.json).
_SCAN = 256


@triton.jit
def _buckets(ids_ptr, rows, M, E, PAD: tl.constexpr):  # type: ignore[no-untyped-def]
    # An id outside [0, E) goes to bucket E (served by no tile); rows past M get PAD.
    ids = tl.load(ids_ptr + rows, mask=rows < M, other=0)
    bucket = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)
    return tl.where(rows < M, bucket, PAD)


@triton.jit
def _pick(onehot, values):  # type: ignore[no-untyped-def]
    # values[e] for the one e set in each row of onehot [R, BINS].
    return tl.sum(tl.where(onehot, values[None, :], 0), axis=1)


@triton.jit
def _tiles_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    order_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    M,
    E,
    T,
    ROW_PROGRAMS,
    BLOCK_M: tl.constexpr,
    BINS: tl.constexpr,
    CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
    PDL: tl.constexpr,
):
    # Programs [0, ROW_PROGRAMS) own CHUNK rows each, the others CHUNK tiles each; both read the ids SCAN at a time.
    # BINS > E: rows past M count in bin E with the unrouted ones, and no expert's count includes them.
    await_inputs(PDL)
    experts = tl.arange(0, BINS)
    counts = tl.zeros((BINS,), dtype=tl.int32)
    for r0 in range(0, M, SCAN):
        counts += tl.histogram(_buckets(ids_ptr, r0 + tl.arange(0, SCAN), M, E, E), BINS)
    counts = tl.where(experts < E, counts, 0)
    row_end = tl.cumsum(counts, 0)
    row_start = row_end - counts
    pid = tl.program_id(0)
    if pid < ROW_PROGRAMS:
        rows = pid * CHUNK + tl.arange(0, CHUNK)
        bucket = _buckets(ids_ptr, rows, M, E, -1)
        rank = tl.zeros((CHUNK,), dtype=tl.int32)
        for s0 in range(0, pid * CHUNK + CHUNK, SCAN):
            others = s0 + tl.arange(0, SCAN)
            same = (_buckets(ids_ptr, others, M, E, -2)[None, :] == bucket[:, None]) & (others[None, :] < rows[:, None])
            rank += tl.sum(same.to(tl.int32), axis=1)
        first = tl.where(bucket < E, _pick(experts[None, :] == bucket[:, None], row_start), tl.sum(counts, axis=0))
        tl.store(order_ptr + first + rank, rows.to(tl.int64), mask=rows < M)
    else:
        tiles = (counts + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        tile_first = tile_end - tiles
        tile = (pid - ROW_PROGRAMS) * CHUNK + tl.arange(0, CHUNK)
        expert = tl.sum(((tile_end[None, :] <= tile[:, None]) & (experts[None, :] < E)).to(tl.int32), axis=1)
        onehot = experts[None, :] == tl.minimum(expert, E - 1)[:, None]
        start = _pick(onehot, row_start) + (tile - _pick(onehot, tile_first)) * BLOCK_M
        end = tl.minimum(start + BLOCK_M, _pick(onehot, row_end))
        mask = tile < T
        tl.store(tile_expert_ptr + tile, expert.to(tl.int64), mask=mask)
        tl.store(tile_start_ptr + tile, start.to(tl.int64), mask=mask)
        tl.store(tile_end_ptr + tile, end.to(tl.int64), mask=mask)


def expert_tiles_one_launch(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grouped_gemm.expert_tiles`` in one launch, for at most :data:`MAX_ROWS` rows (same outputs for every tile
    that has rows; spare tiles carry ``num_experts`` as their expert)."""
    m = expert_ids.numel()
    if m > MAX_ROWS:
        raise ValueError(f"expert_tiles_one_launch takes at most {MAX_ROWS} rows, got {m}")
    tiles = triton.cdiv(m, block_m) + min(num_experts, m)
    order = torch.empty(m, dtype=torch.int64, device=expert_ids.device)
    tile_expert, tile_start, tile_end = torch.empty((3, tiles), dtype=torch.int64, device=expert_ids.device)
    row_programs = triton.cdiv(m, _CHUNK)
    _tiles_kernel[(row_programs + triton.cdiv(tiles, _CHUNK),)](
        expert_ids,
        order,
        tile_expert,
        tile_start,
        tile_end,
        m,
        num_experts,
        tiles,
        row_programs,
        BLOCK_M=block_m,
        BINS=triton.next_power_of_2(num_experts + 1),
        CHUNK=_CHUNK,
        SCAN=_SCAN,
        num_warps=4,
        **dependent_launch(expert_ids.device),
    )
    return order, tile_expert, tile_start, tile_end
