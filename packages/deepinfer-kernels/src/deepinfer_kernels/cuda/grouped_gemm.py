"""Triton grouped MXFP4 GEMM without host synchronization (safe inside CUDA graph capture).

Rows are grouped by expert on the device with fixed-size tensors only (shapes depend on M and E, never on the
ids): a stable sort gives the expert-sorted row order, a scatter-add the per-expert row counts, cumulative sums the
row and tile offsets, and a ``searchsorted`` of every tile index of the worst-case grid gives each tile's expert.
The grid has ``cdiv(M, BLOCK_M) + min(E, M)`` row tiles — the most that ``Σ_e cdiv(count_e, BLOCK_M)`` can be —
and tiles past the real count exit at once. A ``swap_bf16`` tile with ``tail_m`` leaves an expert's last rows past
its whole tiles, when there are at most ``tail_m``, to a second launch of ``tail_m``-row tiles, one an expert
(``tail_tiles``): about half the experts of an 8K prefill have a few rows past 128 (docs/design/kernels.md, "Tail
tiles"). Tiles read their rows through the sort order and write results back to the original rows, so nothing is
permuted in memory. Ids outside ``[0, E)`` (``-1`` included) are put in a bucket
no tile serves; a launch of their own writes those rows' zeros (it reads the ids and stores only there:
zero-filling the whole output first took 2.3 ms of an 8K prefill on the H200, 0.95 GB a layer), unless the caller
knows every id is held (``ExpertRows.all_local``: every expert local, ids from the router). For few rows the K
chunks run as programs of their own (split-K, ``cuda.gemm_tiles``). When every row fits one MMA tile there are no
tables: each program scans the expert ids for its expert's rows.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.gemm import activation_for, codes_in_column_order, gemv_rows, mxfp4_launch
from deepinfer_kernels.cuda.gemm_tiles import (
    GLUON_BLOCK_K,
    GROUPED_SPLIT_MAX_ROWS,
    BlockConfig,
    block_config,
    grouped_tile_rows,
    swap_bf16_tile,
)
from deepinfer_kernels.cuda.grouped_bf16_wgmma import grouped_bf16_launch
from deepinfer_kernels.cuda.grouped_tiles import MAX_ROWS, expert_tiles_one_launch
from deepinfer_kernels.cuda.grouped_wgmma import available, fits, grouped_wgmma_launch
from deepinfer_kernels.cuda.swap_bf16 import swap_bf16_launch
from deepinfer_kernels.grouped_gemm import CodeOrder, GroupCodes

__all__ = ["expert_tiles", "mxfp4_grouped_code_order", "mxfp4_grouped_gemm", "tail_tiles", "tile_code_order"]

_ZERO_ROWS, _ZERO_COLUMNS = 16, 256


@triton.jit
def _zero_unrouted_kernel(  # type: ignore[no-untyped-def]
    ids_ptr, out_ptr, M, N, E, stride_out, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):
    # Zeros into the rows whose id is outside [0, E); every other row is left to the GEMM.
    await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ids = tl.load(ids_ptr + rows, mask=rows < M, other=0)
    unrouted = (rows < M) & ((ids < 0) | (ids >= E))
    columns = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offsets = rows.to(tl.int64)[:, None] * stride_out + columns[None, :]
    zeros = tl.zeros((BLOCK_R, BLOCK_C), dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, zeros, mask=unrouted[:, None] & (columns < N)[None, :])


def _zero_unrouted_rows(expert_ids: torch.Tensor, out: torch.Tensor, experts: int) -> None:
    m, n = out.shape
    grid = (triton.cdiv(m, _ZERO_ROWS), triton.cdiv(n, _ZERO_COLUMNS))
    _zero_unrouted_kernel[grid](
        expert_ids,
        out,
        m,
        n,
        experts,
        out.stride(0),
        BLOCK_R=_ZERO_ROWS,
        BLOCK_C=_ZERO_COLUMNS,
        num_warps=4,
        **dependent_launch(out.device),
    )


def _expert_rows(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's bucket (its expert, ``num_experts`` for ids outside ``[0, num_experts)``), and per expert its row
    count and the end of its rows in the expert-sorted order."""
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    bucket = torch.where(valid, expert_ids, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_experts]
    return bucket, counts, torch.cumsum(counts, 0)


def expert_tiles(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tile tables of the grouped GEMM, built with device ops of fixed output sizes (no host sync).

    Args:
        expert_ids: [M] int64; ids outside ``[0, num_experts)`` are served by no tile.
        num_experts: E.
        block_m: rows per tile.
        tail_m: an expert's last rows past its whole tiles, if at most ``tail_m``, are left to :func:`tail_tiles`.

    Returns:
        order: [M] int64, the stable expert-sorted order of the rows (position → original row);
        tile_expert: [T] int64, each tile's expert, ``num_experts`` for a tile with no work;
        tile_start, tile_end: [T] int64, the tile's half-open range of positions in ``order``;
        where ``T = cdiv(M, block_m) + min(E, M)``.
    """
    m = expert_ids.numel()
    bucket, counts, row_end = _expert_rows(expert_ids, num_experts)
    order = torch.sort(bucket, stable=True).indices
    tiles = counts // block_m + (counts % block_m > tail_m)
    tile_end_per_expert = torch.cumsum(tiles, 0)
    tile = torch.arange(triton.cdiv(m, block_m) + min(num_experts, m), dtype=torch.int64, device=expert_ids.device)
    tile_expert = torch.searchsorted(tile_end_per_expert, tile, right=True)
    expert = tile_expert.clamp(max=num_experts - 1)
    first_tile = tile_end_per_expert[expert] - tiles[expert]
    tile_start = row_end[expert] - counts[expert] + (tile - first_tile) * block_m
    return order, tile_expert, tile_start, torch.minimum(tile_start + block_m, row_end[expert])


def tail_tiles(
    expert_ids: torch.Tensor, num_experts: int, block_m: int, tail_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles :func:`expert_tiles` with ``tail_m`` leaves out, one per expert, over the same order: tile e holds
    expert e's last ``count_e mod block_m`` positions if that is 1 … ``tail_m`` (tile_expert, tile_start, tile_end
    [E] as there; ``num_experts`` for an expert with no tail)."""
    _, counts, row_end = _expert_rows(expert_ids, num_experts)
    rest = counts % block_m
    experts = torch.arange(num_experts, dtype=torch.int64, device=expert_ids.device)
    tile_expert = torch.where((rest > 0) & (rest <= tail_m), experts, num_experts)
    return tile_expert, row_end - rest, row_end


def _grouped_config(
    m: int, packed: torch.Tensor, scale: torch.Tensor, device: torch.device, config: BlockConfig | None = None
) -> BlockConfig:
    """The tiles of ``m`` product rows over these experts: ``config`` or ``gemm_tiles.block_config``'s, unsplit past
    ``GROUPED_SPLIT_MAX_ROWS`` rows, the Gluon tiles fitted to the operands."""
    experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    cfg = config or block_config("mxfp4_grouped_gemm", grouped_tile_rows(m, experts), n, k)
    if m > GROUPED_SPLIT_MAX_ROWS:
        cfg = dataclasses.replace(cfg, split_grid=False)
    if cfg.decoding in ("gluon_fp8", "gluon_bf16"):
        cfg = _gluon_tile(cfg, packed, scale, device)
    return cfg


def tile_code_order(cfg: BlockConfig) -> CodeOrder | None:
    """The order of the codes tiles ``cfg`` read (``cuda.gemm.activation_for``); None for the sorted-copy decodings,
    which read the activation's values."""
    if cfg.decoding in ("swap_bf16", "gluon_bf16"):
        return None
    return "columns" if codes_in_column_order(cfg) else "deinterleaved"


def mxfp4_grouped_code_order(rows: int, packed: torch.Tensor, scale: torch.Tensor) -> CodeOrder | None:
    """The order of the codes that :func:`mxfp4_grouped_gemm` of ``rows`` product rows reads (contract of
    ``deepinfer_kernels.grouped_gemm.mxfp4_grouped_code_order``)."""
    if rows == 0 or packed.shape[0] == 0:
        return None
    return tile_code_order(_grouped_config(rows, packed, scale, packed.device))


def _values(x: torch.Tensor | GroupCodes) -> torch.Tensor:
    """The activation's values: codes as exact FP32, which the tiles quantize back to the same codes' values."""
    return x.values() if isinstance(x, GroupCodes) else x


def _activation_codes(x: torch.Tensor | GroupCodes, cfg: BlockConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes tiles ``cfg`` read: given codes in their order as they are, else quantized from the values."""
    if isinstance(x, GroupCodes) and x.order == tile_code_order(cfg):
        return x.q.view(torch.uint8), x.scale.view(torch.uint8)
    return activation_for(_values(x), cfg)


def mxfp4_grouped_gemm(
    x: torch.Tensor | GroupCodes,
    expert_ids: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    config: BlockConfig | None = None,
    derived: dict[Hashable, Any] | None = None,
    repeats: int = 1,
    all_local: bool = False,
) -> None:
    """Triton ``out[m] = bf16(x̂[m // repeats] · Ŵ[expert_ids[m]]ᵀ)`` (contract of ``reference.grouped_gemm``),
    sync-free.

    Args:
        x: [M / repeats, K] bf16/fp32, contiguous, ``K % 32 == 0``; or its codes, read as they are where the tiles
            read codes in their order, else multiplied as their values (the same product).
        expert_ids: [M] int64; rows with an id outside ``[0, E)`` get zeros.
        packed: [E, N, K/2] int8, contiguous (low nibble = even element).
        scale: [E, N, K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written (every row).
        config: tiles to use instead of ``gemm_tiles.block_config``'s (tuning).
        derived: an ``ExpertRows``'s store: the tile tables for these ids are taken from it when an earlier call
            over the same rows built them (same expert count and rows per tile), else built and kept there.
        repeats: product rows per row of x. ``swap_bf16``'s sorted copy reads x's rows directly; the other
            decodings quantize x once and read row ``m // repeats`` of its codes (no copy per choice).
        all_local: every id is in ``[0, E)`` (``ExpertRows.all_local``): every row has a tile, so the zero-row
            launch is left out.
    """
    rows_of_x = x.q if isinstance(x, GroupCodes) else x
    check_launchable(x=rows_of_x, expert_ids=expert_ids, packed=packed, scale=scale, out=out)
    m, experts = expert_ids.shape[0], packed.shape[0]
    if not (all_local and experts):
        _zero_unrouted_rows(expert_ids, out, experts)
    if experts == 0:
        return  # no local experts: every row is zero
    mean_rows = triton.cdiv(m, experts)
    cfg = _grouped_config(m, packed, scale, rows_of_x.device, config)
    launch = grouped_wgmma_launch if cfg.decoding == "gluon_fp8" else mxfp4_launch
    sorted_copy = cfg.decoding in ("swap_bf16", "gluon_bf16")
    if not cfg.gemv and m <= cfg.block_m and not sorted_copy:
        # Every row fits one MMA tile: each program finds its expert's rows itself (mxfp4_kernel's SCAN), which saves
        # the tile-table launch (about 33 µs at batch 1 on the H200, longer than the GEMM's own share of a weight).
        launch(*_activation_codes(x, cfg), packed, scale, out, expert_ids, cfg.block_m, cfg, repeats)
        return
    # FMA tiles take up to twice the mean rows, so that an expert with a few more rows than the mean is still read
    # once rather than once per tile.
    rows = gemv_rows(2 * mean_rows, cfg) if cfg.gemv else cfg.block_m
    tables, tails = _tables(derived, expert_ids, experts, rows, cfg.tail_m)
    # The sorted-copy decodings quantize x into a BF16 copy in the tables' row order (cuda.swap_bf16).
    if cfg.decoding == "swap_bf16":
        swap_bf16_launch(_values(x), packed, scale, out, tables, cfg, repeats, tails)
    elif cfg.decoding == "gluon_bf16":
        grouped_bf16_launch(_values(x), packed, scale, out, tables, cfg, repeats)
    else:
        launch(*_activation_codes(x, cfg), packed, scale, out, tables, rows, cfg, repeats)


def _tables(
    derived: dict[Hashable, Any] | None, expert_ids: torch.Tensor, experts: int, rows: int, tail_m: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...] | None]:
    """The tile tables of ``rows``-row tiles and, under ``tail_m``, of the tail tiles (else None): from ``derived``
    when an earlier call over the same rows built them (same expert count, tile rows and tail), else built and kept
    there."""
    key = ("mxfp4_grouped_gemm tiles", experts, rows, tail_m)
    tables = None if derived is None else derived.get(key)
    if tables is None:
        if tail_m:
            tiles = expert_tiles(expert_ids, experts, rows, tail_m)
            tables = (tiles, tail_tiles(expert_ids, experts, rows, tail_m))
        else:
            one_launch = expert_ids.numel() <= MAX_ROWS
            tables = ((expert_tiles_one_launch if one_launch else expert_tiles)(expert_ids, experts, rows), None)
        if derived is not None:
            derived[key] = tables
    return tables


def _gluon_tile(cfg: BlockConfig, packed: torch.Tensor, scale: torch.Tensor, device: torch.device) -> BlockConfig:
    """``cfg``, its K step shortened to one that divides K where ``cfg``'s does not (the same sums in the same order:
    a step only batches groups), or, where the Gluon kernels cannot run or their ring cannot copy these operands, the
    same sums from Triton: for ``gluon_fp8`` the ``swap_fp8`` tile (the narrowest FP8 wgmma tile), for ``gluon_bf16``
    the ``swap_bf16`` tile of the same rows. The grouped kernels sum K in one program, so ``split_grid`` is off (the
    same bits: one chunk)."""
    k = packed.shape[-1] * 2
    block_k = max((b for b in GLUON_BLOCK_K if b <= cfg.block_k and k % b == 0), default=cfg.block_k)
    if available(device) and fits(k, packed, scale, block_k):
        return dataclasses.replace(cfg, block_k=block_k, split_grid=False)
    if cfg.decoding == "gluon_bf16":
        return swap_bf16_tile(cfg.block_m, cfg.block_n, cfg.num_warps)
    return dataclasses.replace(cfg, decoding="swap_fp8", block_m=max(16, cfg.block_m), split_grid=False)
