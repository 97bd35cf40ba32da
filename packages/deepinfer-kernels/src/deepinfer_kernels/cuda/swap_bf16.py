"""Quantized GEMMs on BF16 operands for many rows per weight: decoding ``"swap_bf16"``, grouped MXFP4 (prefill) and
dense FP8 block (docs/design/kernels.md, "GEMM tiles and split-K").

The activation's exact dequantization ``x̂`` is a BF16 copy. For the grouped GEMM one launch
(``quant.quantized_values``) quantizes the activation as for every decoding and writes ``x̂`` in the expert-sorted row
order of the tile tables, each 32-column group's columns in the order the MXFP4 weight operand's decoding produces
them (``gemm_operands.word_pair_columns``); the codes never reach memory. For the dense FP8 GEMM ``x̂`` comes in row
and column order from the same launch, or from the dequantizer when a producer already quantized the activation.
A tile's rows are then consecutive rows of that copy, read without a gather or any decoding.

The weight is decoded per K step into scaled BF16 values straight in the registers of the MMA's first operand:
MXFP4 words by ``gemm_decodings.swapped_weight`` (the ``swap_ab`` decoding's), e4m3 codes times their 32×32 block's
power-of-two factor by ``gemm_operands.e4m3_tile``. The tile ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ`` sums the whole K in the
MMA's FP32 accumulator. So there is no per-group scaling, which ``group_fp8`` pays for with two FP32 operations per
output and 32 columns, and every sum is FP32 (no 13-bit FP8 group sums). Products are exact, so only the FP32
summation order differs from the reference. The cost: the BF16 copy of the activation (2 bytes per row and column,
written once and read once per N tile) and BF16 instead of FP8 MMAs. Unlike ``dequant_bf16`` the weight is read once
as stored (1 byte an element for FP8 instead of 5 for its BF16 copy written, then read by cuBLAS).

Under ``TRITON_INTERPRET=1`` the weight decodes to FP32 and the copy is widened to FP32 for the dot: the same values.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cuda._launch import await_inputs, dependent_launch
from deepinfer_kernels.cuda.gemm_decodings import swapped_weight, swapped_weight_pointers
from deepinfer_kernels.cuda.gemm_operands import (
    chunk_range,
    dot_in_bf16,
    e4m3_tile,
    finish_tile,
    launch_grid,
    native_fp8,
    operand,
    settled,
    split_buffers,
)
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.cuda.quant import quantized_values

__all__ = ["fp8_swap_bf16_launch", "sorted_bf16_activation", "swap_bf16_launch"]


@triton.jit
def _e4m3_weight(w_ptrs, ws_ptrs, k0, K, n_mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE, EVEN):  # type: ignore[no-untyped-def]
    # The FP8 block weight's K step at k0 as the first operand, [BLOCK_N, BLOCK_K]: e4m3 codes times their block's
    # factor, FP32 (exact; the caller's operand() rounds nothing).
    GROUPS: tl.constexpr = BLOCK_K // 32
    if EVEN:
        raw = tl.load(w_ptrs + k0)
        w_scale = tl.load(ws_ptrs + k0 // 32)
    else:
        # K is a multiple of 32, so whole groups are in or out of range.
        in_k = (k0 + tl.arange(0, BLOCK_K) < K)[None, :]
        raw = tl.load(w_ptrs + k0, mask=n_mask[:, None] & in_k, other=0)
        in_group = (k0 + 32 * tl.arange(0, GROUPS) < K)[None, :]
        w_scale = tl.load(ws_ptrs + k0 // 32, mask=n_mask[:, None] & in_group, other=0)
    return e4m3_tile(tl.reshape(raw, (BLOCK_N, GROUPS, 32)), w_scale, BLOCK_N, BLOCK_K, NATIVE)


@triton.jit
def _k_run(  # type: ignore[no-untyped-def]
    acc, w_ptrs, ws_ptrs, a_ptrs, k_start, k_end, K, n_mask, in_tile, GROUPED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    # acc + the tile's products over columns [k_start, k_end), one BLOCK_K step at a time in the MMA's accumulator.
    k = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        if GROUPED:
            w = swapped_weight(w_ptrs, ws_ptrs, k0, K, n_mask, BLOCK_N, BLOCK_K, NATIVE, EVEN)
        else:
            w = _e4m3_weight(w_ptrs, ws_ptrs, k0, K, n_mask, BLOCK_N, BLOCK_K, NATIVE, EVEN)
        if EVEN:
            a = tl.load(a_ptrs + k0, mask=in_tile[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs + k0, mask=in_tile[None, :] & (k0 + k < K)[:, None], other=0.0)
        if not DOT_BF16:
            a = a.to(tl.float32)
        acc = settled(tl.dot(operand(w, DOT_BF16), a, acc), DOT_BF16)
    return acc


@triton.jit
def _swap_bf16_kernel(  # type: ignore[no-untyped-def]
    xs_ptr, w_ptr, ws_ptr, out_ptr, partial_ptr, counter_ptr, order_ptr, tile_expert_ptr, tile_start_ptr,
    tile_end_ptr, M, N, K, K_CHUNK, num_experts, N_PER_GROUP, stride_xs, stride_we, stride_w, stride_se, stride_s,
    stride_out,
    GROUPED: tl.constexpr, SPLIT_GRID: tl.constexpr, CHUNK_SUMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr, NATIVE: tl.constexpr, EVEN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # GROUPED (MXFP4 experts): program (N block, tile) owns positions [tile_start, tile_end) of the sorted order, all
    # of expert tile_expert (a spare tile of the worst-case grid has an expert ≥ num_experts and exits); the copy's
    # row p holds the activation row order[p]. A tile's N blocks are consecutive programs, so that its rows of the
    # copy are read from memory about once (cuda.grouped_bf16_wgmma says why). Dense (FP8 block weight): program (row
    # block, N block[, K chunk]), the copy in row order; weight rows g·N_PER_GROUP … multiply the copy's columns
    # g·K … (the launcher keeps a tile in one group).
    # SPLIT_GRID (dense): program (…, chunk) sums the chunk's K_CHUNK columns (fixed by the weight's shape) from zero
    # and finish_tile adds the chunks in order. CHUNK_SUMS (dense, unsplit): the program makes the same additions, each
    # chunk from zero, added in order into the total (the bits of the split launch, for the batch-invariant mode; a
    # second FP32 tile of registers). Otherwise K is one run of the accumulator.
    # EVEN: N and K multiples of the tile's (the model's shapes): the weight and activation loads need only the tile's
    # row mask.
    await_inputs(PDL)
    if GROUPED:
        tile = tl.program_id(1)
        n_block = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= num_experts:
            return
        positions = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
        in_tile = positions < tl.load(tile_end_ptr + tile)
        w_ptr += expert.to(tl.int64) * stride_we
        ws_ptr += expert.to(tl.int64) * stride_se
    else:
        n_block = tl.program_id(1)
        positions = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        in_tile = positions < M
        xs_ptr += (n_block * BLOCK_N) // N_PER_GROUP * K
    n_offsets = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_rows = n_offsets.to(tl.int64)
    n_mask = n_rows < N
    k = tl.arange(0, BLOCK_K)
    if GROUPED:
        w_ptrs, ws_ptrs = swapped_weight_pointers(w_ptr, ws_ptr, n_rows, stride_w, stride_s, BLOCK_K)
    else:
        w_ptrs = w_ptr + n_rows[:, None] * stride_w + k[None, :]
        ws_ptrs = ws_ptr + (n_rows // 32)[:, None] * stride_s + tl.arange(0, BLOCK_K // 32)[None, :]
    a_ptrs = xs_ptr + positions.to(tl.int64)[None, :] * stride_xs + k[:, None]
    # Chunk starts and, but for K, ends are multiples of BLOCK_K, so only K needs masks.
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if SPLIT_GRID or CHUNK_SUMS:
        first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
        for chunk in range(first, last):
            k_start = chunk * K_CHUNK
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc = _k_run(acc, w_ptrs, ws_ptrs, a_ptrs, k_start, tl.minimum(k_start + K_CHUNK, K), K, n_mask, in_tile,
                         GROUPED, BLOCK_N, BLOCK_K, DOT_BF16, NATIVE, EVEN)  # fmt: skip
            total += acc
    else:
        total = _k_run(total, w_ptrs, ws_ptrs, a_ptrs, 0, K, K, n_mask, in_tile, GROUPED, BLOCK_N, BLOCK_K, DOT_BF16,
                       NATIVE, EVEN)  # fmt: skip
    rows = tl.load(order_ptr + positions, mask=in_tile, other=0) if GROUPED else positions
    finish_tile(
        out_ptr, partial_ptr, counter_ptr, tl.trans(total), rows.to(tl.int64), in_tile, n_offsets, M, N, stride_out,
        SPLIT_GRID,
    )  # fmt: skip


def sorted_bf16_activation(x: torch.Tensor, order: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """The BF16 copy grouped ``swap_bf16`` tiles read: row ``p`` is ``x̂[order[p] // repeats]`` (x [M / repeats, K]
    bf16/fp32 with unit column stride, quantized per token and 32 columns and dequantized exactly,
    ``quant.quantized_values``) with each 32-column group's columns in ``word_pair_columns`` order; order [M] from
    the tile tables."""
    xs = torch.empty((order.shape[0], x.shape[1]), dtype=torch.bfloat16, device=x.device)
    quantized_values(x, xs, order=order, word_pairs=True, repeats=repeats)
    return xs


def _check_tile(cfg: BlockConfig) -> None:
    if cfg.decoding != "swap_bf16":
        raise ValueError(f"the swap_bf16 launchers take swap_bf16 tiles, got {cfg}")


def swap_bf16_launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: BlockConfig,
    repeats: int = 1,
    tails: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """The grouped MXFP4 GEMM on a ``swap_bf16`` tile ``cfg``: x [M / repeats, K] the unquantized activation (product
    row i reads row ``i // repeats``), packed [E, N, K/2] and scale [E, N, K/32] of the experts, out [M, N],
    ``tables`` of ``cuda.grouped_gemm.expert_tiles`` for tiles of ``cfg.block_m`` rows; under ``cfg.tail_m``, ``tails``
    of ``cuda.grouped_gemm.tail_tiles``, run as a second launch of ``cfg.tail_m``-row tiles on the same copy."""
    _check_tile(cfg)
    if packed.data_ptr() % 4 or packed.stride(-2) % 4:
        raise ValueError(
            "decoding 'swap_bf16' reads the packed weight in 4-byte words: its rows must be 4-byte aligned"
        )
    if cfg.split_grid:
        raise ValueError(f"the grouped swap_bf16 GEMM sums K in one program: no split_grid, got {cfg}")
    if (tails is None) != (cfg.tail_m == 0):
        raise ValueError(f"tail tables go with a tile's tail_m and only then, got {cfg} with tails={tails is not None}")
    order = tables[0]
    xs = sorted_bf16_activation(x, order, repeats)
    _grouped_launch(xs, packed, scale, out, order, tables[1:], cfg.block_m, cfg)
    if tails is not None:
        _grouped_launch(xs, packed, scale, out, order, tails, cfg.tail_m, cfg)


def _grouped_launch(
    xs: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    order: torch.Tensor,
    tiles: tuple[torch.Tensor, ...],
    block_m: int,
    cfg: BlockConfig,
) -> None:
    # One launch over the tiles (tile_expert, tile_start, tile_end) of block_m rows of the sorted copy xs.
    tile_expert, tile_start, tile_end = tiles
    (experts, n), k = packed.shape[:2], xs.shape[1]
    _swap_bf16_kernel[(triton.cdiv(n, cfg.block_n), tile_expert.numel())](
        xs, packed.view(torch.uint8), scale.view(torch.uint8), out, out, out, order, tile_expert, tile_start,
        tile_end, xs.shape[0], n, k, k, experts, n, xs.stride(0), packed.stride(0), packed.stride(1), scale.stride(0),
        scale.stride(1), out.stride(0),
        GROUPED=True, SPLIT_GRID=False, CHUNK_SUMS=False, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_BF16=dot_in_bf16(), NATIVE=native_fp8(), EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent_launch(out.device),
    )  # fmt: skip


def fp8_swap_bf16_launch(
    x_hat: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, groups: int, cfg: BlockConfig
) -> None:
    """The FP8 block GEMM on a ``swap_bf16`` tile ``cfg``: x_hat [M, G·K] the activation's BF16 dequantization (unit
    column stride), w_q [N, K] e4m3 and w_scale [N/32, K/32] UE8M0 (uint8 views or their dtypes), out [M, N] bf16 or
    fp32 (unit column stride); ``groups`` G > 1: weight rows ``g·N/G …`` multiply columns ``g·K …`` of x_hat. Under
    ``cfg.split_grid`` each chunk of ``gemm_tiles.chunk_length`` columns (fixed by N and K) is a program of its own,
    the chunk sums added in chunk order; inside ``batch_invariant_ops`` an unsplit program makes the same additions
    (the same bits whatever the tile, rows or split), else it sums K in one run."""
    _check_tile(cfg)
    (m, n), k = out.shape, w_q.shape[1]
    block_n = cfg.block_n
    if groups > 1 and (n // groups) % block_n:  # a tile must not straddle two groups
        raise ValueError(f"a grouped swap_bf16 tile's block_n must divide N/groups = {n // groups}, got {block_n}")
    grid, chunk = launch_grid(triton.cdiv(m, cfg.block_m), n, k, cfg)
    partial, counters = split_buffers(m, n, cfg, grid, out.device)
    chunk_sums = invariant_kernels() and not cfg.split_grid and chunk < k
    _swap_bf16_kernel[grid](
        x_hat, w_q.view(torch.uint8), w_scale.view(torch.uint8), out, partial, counters, out, out, out, out,
        m, n, k, chunk, 1, n // groups, x_hat.stride(0), 0, w_q.stride(0), 0, w_scale.stride(0), out.stride(0),
        GROUPED=False, SPLIT_GRID=cfg.split_grid, CHUNK_SUMS=chunk_sums, BLOCK_M=cfg.block_m, BLOCK_N=block_n,
        BLOCK_K=cfg.block_k, DOT_BF16=dot_in_bf16(), NATIVE=native_fp8(),
        EVEN=n % block_n == 0 and k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **dependent_launch(out.device),
    )  # fmt: skip
