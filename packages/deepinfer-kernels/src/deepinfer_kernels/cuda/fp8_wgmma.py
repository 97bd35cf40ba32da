"""The FP8 block GEMM for few to a few hundred rows as a Gluon kernel (decoding ``"gluon_fp8"`` of
``fp8_block_gemm``; docs/design/kernels.md, "The explicit-layout grouped GEMM").

The dense ``swap_fp8`` tile's sums (``cuda.gemm_decodings.group_tiles``) with the Gluon ring of ``cuda.grouped_wgmma``:
the tile ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ``, one FP8 ``wgmma`` per 32-column group with both operands in shared memory
(the stored e4m3 weight codes need no decoding), each group's sum times the activation's factor, then the weight
block's, added into the chunk's FP32 sum; K runs in the weight shape's chunks (``gemm_tiles.k_chunk``), each summed
from zero and added in chunk order. These are the additions of a split ``swap_fp8`` launch, so the bits are the same
whatever the tile and the rows (a tile for the batch-invariant mode). A tile either runs every chunk in one program
(weights with rows enough to give the device programs) or, ``split_grid``, one chunk a program with the split-K
protocol of ``gemm_operands.finish_tile`` (the narrow weights of a batch-1 step): the same additions either way.

A K step's operands travel by ``cp.async`` into ``STAGES`` slots: the weight codes group-major (group ``g`` of weight
row ``n`` at slot row ``g·BLOCK_N + n``, so that each group is a K-major ``[BLOCK_N, 32]`` operand), the activation's
codes likewise, both sides' scale bytes (the weight's per row, from its 32-row block).
"""

# Gluon reads parameter annotations as kernel type hints, so @gluon.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from deepinfer_kernels.cuda._launch import dependent_launch
from deepinfer_kernels.cuda.gemm_operands import split_buffers
from deepinfer_kernels.cuda.gemm_tiles import SHARED_PER_PROGRAM, BlockConfig, chunk_length, gluon_shared_bytes
from deepinfer_kernels.cuda.gluon_ring import (
    PIECE,
    ROWS_PER_WARP,
    add_group,
    advance_ring,
    await_gluon_inputs,
    copy_layout,
    shared_layouts,
    start_ring,
    tile_constexprs,
)

__all__ = ["fits", "fp8_wgmma_constexprs", "fp8_wgmma_launch"]


def fits(
    n: int,
    k: int,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    groups: int,
    cfg: BlockConfig,
) -> bool:
    """Whether the ring can copy these operands in whole pieces and K's chunks are whole K steps: K and its chunk
    length multiples of ``block_k``; the rows of the codes (16 bytes), of both sides' scale bytes (a step's groups)
    and of the weight codes (16 bytes) aligned, every base 16-byte aligned; (grouped) every group of weight rows a
    whole number of tiles."""
    groups_per_step = cfg.block_k // 32
    return (
        k % cfg.block_k == 0
        and chunk_length(n, k, cfg) % cfg.block_k == 0
        and q.stride(0) % PIECE == 0
        and q_scale.stride(0) % groups_per_step == 0
        and w_q.stride(0) % PIECE == 0
        and w_scale.stride(0) % groups_per_step == 0
        and all(t.data_ptr() % PIECE == 0 for t in (q, q_scale, w_q, w_scale))
        and (n // groups) % cfg.block_n == 0
    )


@functools.cache
def _layouts(block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    shared = shared_layouts(block_m, block_k, num_warps)
    block_n, groups = ROWS_PER_WARP * num_warps, block_k // 32
    return {
        **shared,
        # Weight codes [GROUPS·BLOCK_N, 32] of a K step: 16 bytes a thread, the same slot layout as the codes'.
        "weight_copy": copy_layout(groups * block_n, 32, PIECE, num_warps),
        "weight_slot": shared["codes_slot"],
    }


@gluon.jit
def _fp8_wgmma_kernel(  # type: ignore[no-untyped-def]
    q_ptr, qs_ptr, w_ptr, ws_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K, K_CHUNK, N_PER_GROUP, stride_q,
    stride_qs, stride_w, stride_ws, stride_out,
    SPLIT_GRID: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_BITS: gl.constexpr, ACC: gl.constexpr, WEIGHT_COPY: gl.constexpr, WEIGHT_SLOT: gl.constexpr,
    CODES_COPY: gl.constexpr, CODES_SLOT: gl.constexpr, SCALE_COPY: gl.constexpr, CODE_SCALE_COPY: gl.constexpr,
    SCALE_SLOT: gl.constexpr, WEIGHT_SCALES: gl.constexpr, CODE_SCALES: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    # Program (row tile, N tile). K and K_CHUNK are multiples of BLOCK_K (fp8_wgmma.fits): only rows need masks.
    await_gluon_inputs(PDL)
    GROUPS: gl.constexpr = BLOCK_K // 32
    m0 = gl.program_id(0) * BLOCK_M
    n0 = gl.program_id(1) * BLOCK_N
    # Grouped (wo_a): weight rows g·N_PER_GROUP … multiply activation columns g·K …; a tile lies in one group.
    group_of_tile = (n0 // N_PER_GROUP).to(gl.int64)
    if SPLIT_GRID:
        # This program's K chunk only (grid axis 2): the ring starts at the chunk's first column.
        k_first = gl.program_id(2) * K_CHUNK
        steps = gl.minimum(K - k_first, K_CHUNK) // BLOCK_K
    else:
        steps = K // BLOCK_K
    q_ptr += group_of_tile * K
    if SPLIT_GRID:
        q_ptr += k_first
        w_ptr += k_first

    # Where K step 0's pieces come from. Weight codes: group g of row n at slot row g·BLOCK_N + n.
    w_i = gl.arange(0, GROUPS * BLOCK_N, layout=gl.SliceLayout(1, WEIGHT_COPY))
    w_n = n0 + w_i % BLOCK_N
    w_c = gl.arange(0, 32, layout=gl.SliceLayout(0, WEIGHT_COPY))
    w_ptrs = w_ptr + (w_n.to(gl.int64) * stride_w + (w_i // BLOCK_N) * 32)[:, None] + w_c[None, :]
    w_in = (w_n < N)[:, None]
    # Activation codes: group g of the tile's row m at slot row g·BLOCK_M + m.
    c_i = gl.arange(0, GROUPS * BLOCK_M, layout=gl.SliceLayout(1, CODES_COPY))
    c_m = m0 + c_i % BLOCK_M
    c_k = gl.arange(0, 32, layout=gl.SliceLayout(0, CODES_COPY))
    c_ptrs = q_ptr + (c_m.to(gl.int64) * stride_q + (c_i // BLOCK_M) * 32)[:, None] + c_k[None, :]
    c_in = (c_m < M)[:, None]
    # Scale bytes [rows, GROUPS]: the weight's per row (its block row n // 32), the activation's per token; the row
    # strides are multiples of GROUPS (fits), told to the compiler so that a row's bytes go as one piece.
    s_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_COPY))
    s_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, SCALE_COPY))
    ws_rows = (s_n // 32).to(gl.int64) * stride_ws
    a_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, CODE_SCALE_COPY))
    a_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, CODE_SCALE_COPY))
    a_rows = a_m.to(gl.int64) * stride_qs + group_of_tile * (K // 32)
    if SPLIT_GRID:  # (a constant 0 added would be folded away with the multiple_of facts on its sum)
        ws_rows += k_first // 32
        a_rows += k_first // 32
    ws_ptrs = ws_ptr + gl.multiple_of(ws_rows, GROUPS)[:, None] + s_g[None, :]
    ws_in = (s_n < N)[:, None]
    qs_ptrs = qs_ptr + gl.multiple_of(a_rows, GROUPS)[:, None] + a_g[None, :]
    qs_in = (a_m < M)[:, None]

    weights, codes, w_scales, a_scales = start_ring(
        w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, steps, STAGES, GROUPS * BLOCK_N, 32, BLOCK_K,
        BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_SLOT, CODES_SLOT, SCALE_SLOT,
    )  # fmt: skip
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    chunk_steps = K_CHUNK // BLOCK_K
    for chunk_start in range(0, steps, chunk_steps):
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
        for step in range(chunk_start, gl.minimum(chunk_start + chunk_steps, steps)):
            advance_ring(
                step, weights, codes, w_scales, a_scales, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in,
                steps, STAGES, BLOCK_K, BLOCK_K, GROUPS,
            )  # fmt: skip
            slot = step % STAGES
            step_w = weights.index(slot)._reinterpret(gl.float8e4nv, [GROUPS * BLOCK_N, 32], WEIGHT_SLOT)
            step_codes = codes.index(slot)._reinterpret(gl.float8e4nv, [GROUPS * BLOCK_M, 32], CODES_SLOT)
            step_w_scales = w_scales.index(slot).load(WEIGHT_SCALES)
            step_a_scales = a_scales.index(slot).load(CODE_SCALES)
            # One asynchronous wgmma per group, each group's sum scaled and added while the next group's MMA runs.
            previous = warpgroup_mma(
                step_w.slice(0, BLOCK_N), step_codes.slice(0, BLOCK_M).permute((1, 0)), zero, use_acc=False,
                is_async=True,
            )  # fmt: skip
            for g in gl.static_range(1, GROUPS):
                pending = warpgroup_mma(
                    step_w.slice(g * BLOCK_N, BLOCK_N), step_codes.slice(g * BLOCK_M, BLOCK_M).permute((1, 0)), zero,
                    use_acc=False, is_async=True,
                )  # fmt: skip
                part = warpgroup_mma_wait(1, deps=[previous])
                acc = add_group(acc, part, step_a_scales, step_w_scales, g - 1, GROUP_BITS, 0, ACC)
                previous = pending
            part = warpgroup_mma_wait(0, deps=[previous])
            acc = add_group(acc, part, step_a_scales, step_w_scales, GROUPS - 1, GROUP_BITS, 0, ACC)
        total = total + acc
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    n_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    mask = (rows < M)[None, :] & (n_rows < N)[:, None]
    out_ptrs = out_ptr + rows.to(gl.int64)[None, :] * stride_out + n_rows[:, None]
    if SPLIT_GRID:
        _finish_split(out_ptrs, partial_ptr, counter_ptr, total, rows, n_rows, mask, M, N)
    else:
        gl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _finish_split(out_ptrs, partial_ptr, counter_ptr, total, rows, n_rows, mask, M, N):  # type: ignore[no-untyped-def]
    # The split-K protocol of gemm_operands.finish_tile: the chunk's sum to partial[chunk, row, column]; the tile's
    # last program (a ticket per tile, acquire-release) adds every chunk's sum from zero in chunk order, the additions
    # of the one-program path, rounds them into out and resets the ticket for the next launch.
    offsets = rows.to(gl.int64)[None, :] * N + n_rows[:, None]
    gl.store(partial_ptr + gl.program_id(2).to(gl.int64) * M * N + offsets, total, mask=mask)
    gl.thread_barrier()
    ticket = counter_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
    chunks = gl.num_programs(2)
    if gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == chunks - 1:
        total = gl.zeros_like(total)
        at = partial_ptr + offsets
        for _ in range(0, chunks):
            total += gl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            at += M * N
        gl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")


def fp8_wgmma_constexprs(block_m: int, block_k: int, num_warps: int, stages: int) -> dict[str, object]:
    """The kernel's compile-time arguments for a tile (also what ``benchmarks/kernels_sass.py`` compiles)."""
    layouts = _layouts(block_m, block_k, num_warps)
    group_bits = (block_k // 32).bit_length() - 1
    return {"GROUP_BITS": group_bits, **tile_constexprs(layouts, block_m, block_k, num_warps, stages)}


def fp8_wgmma_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    cfg: BlockConfig,
) -> None:
    """Launch the kernel (``cuda.gemm.fp8_block_launch``'s arguments: q [M, groups·K] e4m3 codes in column order and
    q_scale [M, groups·K/32] UE8M0 bytes, w_q [N, K] e4m3, w_scale [N/32, K/32] UE8M0, out [M, N] bf16 or fp32 with
    unit column stride) on a ``gluon_fp8`` tile whose ring :func:`fits` them."""
    (m, n), k = out.shape, w_q.shape[1]
    if gluon_shared_bytes(cfg, weight_bits=8) > SHARED_PER_PROGRAM:
        raise ValueError(
            f"a gluon_fp8 tile's ring for e4m3 weights takes {gluon_shared_bytes(cfg, weight_bits=8)} bytes of shared"
            f" memory, more than the {SHARED_PER_PROGRAM} a Hopper program can have: fewer slots, rows or K columns,"
            f" got {cfg}"
        )
    if not fits(n, k, q, q_scale, w_q, w_scale, groups, cfg):
        raise ValueError(
            f"the gluon_fp8 ring copies whole K steps: K ({k}) and its chunk multiples of block_k ({cfg.block_k}),"
            f" scale row strides ({q_scale.stride(0)}, {w_scale.stride(0)}) multiples of its groups, 16-byte aligned"
            f" codes and rows, whole tiles of each of the {groups} groups of weight rows"
        )
    chunk = chunk_length(n, k, cfg)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), triton.cdiv(k, chunk) if cfg.split_grid else 1)
    partial, counters = split_buffers(m, n, cfg, grid, out.device)
    _fp8_wgmma_kernel[grid](
        q, q_scale, w_q.view(torch.uint8), w_scale.view(torch.uint8), out, partial, counters, m, n, k, chunk,
        n // groups, q.stride(0), q_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        SPLIT_GRID=cfg.split_grid, **fp8_wgmma_constexprs(cfg.block_m, cfg.block_k, cfg.num_warps, cfg.num_stages),
        num_warps=cfg.num_warps,
        **dependent_launch(out.device),
    )  # fmt: skip
