"""Grouped MXFP4 GEMM for few rows per expert as a Gluon kernel with explicit layouts (Hopper ``wgmma``).

The same products, group sums and factor order as the ``swap_fp8`` tile of ``cuda.gemm`` (docs/design/kernels.md,
"The explicit-layout grouped GEMM"): the tile is computed transposed, ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ``, one FP8 ``wgmma``
per 32-column group with the weight as its register operand, each group's sum times the activation's factor, then the
weight's, added in FP32. A K step's operands (packed weight bytes, activation codes, both sides' scale bytes) travel
by ``cp.async`` into a ring of ``STAGES`` shared-memory slots, whole 16-byte pieces of each weight row, so that
several K steps are in flight while one is multiplied and no register holds a byte in flight. The weight slot is
swizzled by row (16-byte chunks XOR the row), so that the thread that needs word ``j`` of a group's 16 bytes of rows
``r`` and ``r + 8`` (lane ``j`` of a row: the low nibbles of its four bytes are operand columns ``4j … 4j+3``, the
high nibbles ``16+4j …``, which is the de-interleaved activation order) reads it without bank conflicts; decoding is
then register-local. Each group's scale factors are laid out in the accumulator's row and column slices; the MMAs
run asynchronously one group apart.

Gluon has no interpreter: under ``TRITON_INTERPRET=1``, on GPUs without ``wgmma`` and for shapes the ring cannot
copy in whole pieces the launcher (``cuda.grouped_gemm``) runs the ``swap_fp8`` tile instead (:func:`available`,
:func:`fits`).
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
from deepinfer_kernels.cuda.gemm_operands import _E2M1_E4M3_PTX
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.cuda.gluon_ring import (
    PIECE,
    add_group,
    advance_ring,
    available,
    await_gluon_inputs,
    group,
    shared_layouts,
    start_ring,
    tile_constexprs,
    weight_layouts,
    weight_pointers,
)

__all__ = ["available", "fits", "gluon_constexprs", "grouped_wgmma_launch"]


def fits(k: int, packed: torch.Tensor, scale: torch.Tensor, block_k: int) -> bool:
    """Whether the ring can copy every K step of the experts' operands in whole pieces: K a multiple of ``block_k``,
    the weight scale bytes' row stride a multiple of a step's groups (4-byte pieces at least) and both bases 16-byte
    aligned. The activation's codes and scale bytes are the launcher's own contiguous buffers ([M, K], [M, K/32]),
    which then fit too."""
    return (
        k % block_k == 0
        and scale.stride(1) % (block_k // 32) == 0
        and packed.data_ptr() % PIECE == 0
        and scale.data_ptr() % PIECE == 0
    )


@functools.cache
def _layouts(block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    """The kernel's layouts for its tile (docs/design/kernels.md, "The explicit-layout grouped GEMM")."""
    return {**shared_layouts(block_m, block_k, num_warps), **weight_layouts(block_k, num_warps)}


@gluon.jit
def _weight_operand(raw, g: gl.constexpr, GROUP_BITS: gl.constexpr, OPERAND: gl.constexpr):  # type: ignore[no-untyped-def]
    # Group g's e4m3 codes of the weight values times 2^-6 (cuda.gemm_operands.e2m1_e4m3_codes), low nibbles then
    # high ones, as the wgmma's register operand; the conversion is asserted to move nothing. raw: [rows, GROUPS·16].
    rows: gl.constexpr = raw.shape[0]
    groups: gl.constexpr = raw.shape[1] // 16
    per_group = gl.reshape(raw, (rows, groups, 16))
    packed = gl.reshape(
        group(gl.reshape(gl.permute(per_group, (0, 2, 1)), (rows * 16, groups)), g, GROUP_BITS), (rows, 16)
    )
    low, high = gl.inline_asm_elementwise(
        _E2M1_E4M3_PTX, "=r,=r,r", [packed], dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4
    )
    codes = gl.reshape(gl.permute(gl.join(low, high), (0, 2, 1)), (rows, 32))
    return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), OPERAND, assert_trivial=True)


@gluon.jit
def _group_mma(  # type: ignore[no-untyped-def]
    raw, codes, zero, g: gl.constexpr, GROUP_BITS: gl.constexpr, BLOCK_M: gl.constexpr, OPERAND: gl.constexpr
):
    # Group g's asynchronous wgmma: the decoded weight group times the activation group in its slot, from zero.
    weight = _weight_operand(raw, g, GROUP_BITS, OPERAND)
    return warpgroup_mma(weight, codes.slice(g * BLOCK_M, BLOCK_M).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _tile_rows(  # type: ignore[no-untyped-def]
    order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, LAYOUT: gl.constexpr, SCAN: gl.constexpr,
    BLOCK_M: gl.constexpr, SPAN: gl.constexpr,
):  # fmt: skip
    # (rows [SPAN] int64, row mask, expert) of this program in LAYOUT, the tile's BLOCK_M rows repeated SPAN / BLOCK_M
    # times; an expert < 0 means no work (see cuda.gemm.mxfp4_kernel: SCAN finds the rows of the expert of row pid
    # when pid is its first row; otherwise the tile tables give the expert and the half-open range of positions in the
    # expert-sorted order).
    pid = gl.program_id(0)
    slots = gl.arange(0, SPAN, layout=LAYOUT) % BLOCK_M
    if SCAN:
        ids = gl.load(order_ptr + slots, mask=slots < M, other=-1)
        expert = gl.load(order_ptr + pid)
        first = gl.min(gl.where(ids == expert, slots, BLOCK_M), axis=0)
        mask = ids == expert
        rows = slots.to(gl.int64)
        expert = gl.where(first == pid, expert, -1)
    else:
        expert = gl.load(tile_expert_ptr + pid)
        positions = gl.load(tile_start_ptr + pid) + slots
        mask = positions < gl.load(tile_end_ptr + pid)
        rows = gl.load(order_ptr + positions, mask=mask, other=0).to(gl.int64)
    return rows, mask, expert


@gluon.jit
def _grouped_wgmma_kernel(  # type: ignore[no-untyped-def]
    q_ptr, qs_ptr, packed_ptr, ws_ptr, out_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    M, N, K, num_experts, stride_q, stride_qs, stride_pe, stride_p, stride_se, stride_s, stride_out,
    SCAN: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_BITS: gl.constexpr, ACC: gl.constexpr, WEIGHT: gl.constexpr, WEIGHT_COPY: gl.constexpr,
    WEIGHT_SLOT: gl.constexpr, CODES_COPY: gl.constexpr, CODES_SLOT: gl.constexpr, SCALE_COPY: gl.constexpr,
    CODE_SCALE_COPY: gl.constexpr, SCALE_SLOT: gl.constexpr, WEIGHT_SCALES: gl.constexpr, CODE_SCALES: gl.constexpr,
    REPEATS: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    # K is a multiple of BLOCK_K and the scale strides of GROUPS (grouped_wgmma.fits): only rows need masks.
    await_gluon_inputs(PDL)
    GROUPS: gl.constexpr = BLOCK_K // 32
    ROW_BYTES: gl.constexpr = BLOCK_K // 2
    OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4)
    TOKENS: gl.constexpr = gl.SliceLayout(0, ACC)
    W_ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    rows, row_mask, expert = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, TOKENS, SCAN, BLOCK_M, BLOCK_M
    )
    if (expert < 0) | (expert >= num_experts):
        return
    code_rows, code_mask, _ = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, gl.SliceLayout(1, CODES_COPY), SCAN, BLOCK_M,
        GROUPS * BLOCK_M,
    )  # fmt: skip
    scale_rows, scale_mask, _ = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, gl.SliceLayout(1, CODE_SCALE_COPY), SCAN, BLOCK_M,
        BLOCK_M,
    )  # fmt: skip
    packed_ptr += expert.to(gl.int64) * stride_pe
    ws_ptr += expert.to(gl.int64) * stride_se
    n0 = gl.program_id(1) * BLOCK_N

    # Where K step 0's pieces come from: the weight's (gluon_ring.weight_pointers), the activation's codes and scale
    # bytes.
    w_ptrs, w_in, ws_ptrs, ws_in = weight_pointers(
        packed_ptr, ws_ptr, n0, N, stride_p, stride_s, BLOCK_N, BLOCK_K, WEIGHT_COPY, SCALE_COPY
    )
    # Activation codes [GROUPS·BLOCK_M, 32]: group g of the tile's row m at slot row g·BLOCK_M + m.
    c_g = gl.arange(0, GROUPS * BLOCK_M, layout=gl.SliceLayout(1, CODES_COPY)) // BLOCK_M
    c_k = gl.arange(0, 32, layout=gl.SliceLayout(0, CODES_COPY))
    # Product row r reads the codes of activation row r // REPEATS (a token's top-k rows read the token).
    c_ptrs = q_ptr + ((code_rows // REPEATS) * stride_q + c_g * 32)[:, None] + c_k[None, :]
    c_in = code_mask[:, None]
    # The activation's scale bytes [rows, GROUPS] per token; the row stride is a multiple of GROUPS (its buffer is the
    # launcher's own), told to the compiler so that a row's bytes go as one piece.
    a_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, CODE_SCALE_COPY))
    qs_ptrs = qs_ptr + gl.multiple_of((scale_rows // REPEATS) * stride_qs, GROUPS)[:, None] + a_g[None, :]
    qs_in = scale_mask[:, None]
    n_rows = n0 + gl.arange(0, BLOCK_N, layout=W_ROWS)

    steps = K // BLOCK_K
    weights, codes, w_scales, a_scales = start_ring(
        w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, steps, STAGES, BLOCK_N, ROW_BYTES, ROW_BYTES,
        BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_SLOT, CODES_SLOT, SCALE_SLOT,
    )  # fmt: skip
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    for step in range(0, steps):
        advance_ring(
            step, weights, codes, w_scales, a_scales, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in,
            steps, STAGES, ROW_BYTES, BLOCK_K, GROUPS,
        )  # fmt: skip
        slot = step % STAGES
        raw = weights.index(slot).load(WEIGHT)
        step_w_scales = w_scales.index(slot).load(WEIGHT_SCALES)
        step_a_scales = a_scales.index(slot).load(CODE_SCALES)
        step_codes = codes.index(slot)._reinterpret(gl.float8e4nv, [GROUPS * BLOCK_M, 32], CODES_SLOT)
        # One asynchronous wgmma per group, each group's sum scaled and added while the next group's MMA runs (the
        # assembler keeps an in-flight MMA's register operand until its wait).
        previous = _group_mma(raw, step_codes, zero, 0, GROUP_BITS, BLOCK_M, OPERAND)
        for g in gl.static_range(1, GROUPS):
            pending = _group_mma(raw, step_codes, zero, g, GROUP_BITS, BLOCK_M, OPERAND)
            part = warpgroup_mma_wait(1, deps=[previous])
            total = add_group(total, part, step_a_scales, step_w_scales, g - 1, GROUP_BITS, 6, ACC)
            previous = pending
        part = warpgroup_mma_wait(0, deps=[previous])
        total = add_group(total, part, step_a_scales, step_w_scales, GROUPS - 1, GROUP_BITS, 6, ACC)
    out_ptrs = out_ptr + rows[None, :] * stride_out + n_rows[:, None]
    gl.store(out_ptrs, total.to(gl.bfloat16), mask=row_mask[None, :] & (n_rows < N)[:, None])


def gluon_constexprs(scan: bool, block_m: int, block_k: int, num_warps: int, stages: int) -> dict[str, object]:
    """The kernel's compile-time arguments for a tile (also what ``benchmarks/kernels_sass.py`` compiles)."""
    layouts = _layouts(block_m, block_k, num_warps)
    group_bits = (block_k // 32).bit_length() - 1
    return {"SCAN": scan, "GROUP_BITS": group_bits, **tile_constexprs(layouts, block_m, block_k, num_warps, stages)}


def grouped_wgmma_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor | tuple[torch.Tensor, ...],
    block_m: int,
    cfg: BlockConfig,
    repeats: int = 1,
) -> None:
    """Launch the kernel on de-interleaved activation codes ``q`` [M / repeats, K]
    (``cuda.gemm.deinterleaved_activation``) with their scale bytes, ``packed`` [E, N, K/2] and ``scale`` [E, N, K/32]
    of the experts, into ``out`` [M, N], row r from codes row ``r // repeats`` (``cuda.gemm.mxfp4_launch``'s
    arguments; ``cfg`` a ``gluon_fp8`` tile of ``block_m`` rows whose ring :func:`fits` the operands,
    ``cfg.num_stages`` slots).

    ``rows`` is the expert id per row when every row fits one tile (``M ≤ block_m``: each program scans for its
    expert's rows) or the tile tables of ``cuda.grouped_gemm.expert_tiles`` for tiles of ``block_m`` rows.
    """
    (m, k), (experts, n) = (out.shape[0], q.shape[1]), packed.shape[:2]
    if not fits(k, packed, scale, cfg.block_k):
        raise ValueError(
            f"the gluon_fp8 ring copies whole K steps: K ({k}) a multiple of block_k ({cfg.block_k}), the scale row"
            f" stride ({scale.stride(1)}) of its groups and 16-byte aligned weights"
        )
    tables: tuple[torch.Tensor, ...]
    if isinstance(rows, torch.Tensor):
        scan, tables, tiles = True, (rows, rows, rows, rows), m
    else:
        scan, tables, tiles = False, rows, rows[1].numel()
    _grouped_wgmma_kernel[(tiles, triton.cdiv(n, cfg.block_n))](
        q, q_scale, packed, scale.view(torch.uint8), out, *tables,
        m, n, k, experts, q.stride(0), q_scale.stride(0), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0),
        **gluon_constexprs(scan, block_m, cfg.block_k, cfg.num_warps, cfg.num_stages), REPEATS=repeats,
        num_warps=cfg.num_warps,
        **dependent_launch(out.device),
    )  # fmt: skip
