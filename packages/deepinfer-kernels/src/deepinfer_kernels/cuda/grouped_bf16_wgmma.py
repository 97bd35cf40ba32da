"""Grouped MXFP4 GEMM for many rows per expert (prefill) as a Gluon kernel: decoding ``"gluon_bf16"``.

The products and sums of the ``swap_bf16`` tile (``cuda.swap_bf16``; docs/design/kernels.md, "The BF16 ring kernel"):
the tile ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ`` is summed over the whole K in the BF16 ``wgmma``'s FP32 accumulator, the
weight decoded and scaled into BF16 (exact) straight into the registers of the MMA's first operand, against the BF16
copy ``x̂`` of the activation's exact dequantization in the tile tables' expert-sorted row order
(``swap_bf16.sorted_bf16_activation``, each 32-column group's columns in ``gemm_operands.word_pair_columns`` order).

What the Triton tile leaves exposed, this kernel overlaps: a K step's packed weight bytes, the weight's scale bytes
and the tile's rows of ``x̂`` travel by ``cp.async`` into a ring of shared-memory slots (``cuda.gluon_ring``), and
each step's ``wgmma`` runs asynchronously while the next step's weight is decoded; only the step before it is waited
for (the ring's ``LAG`` of one). A thread decodes the same 4-byte word of a group that the FP8 Gluon kernel's does
(lane bits 0-1 the word, rows ``r`` and ``r + 8``); with the BF16 operand's two K elements a register, the word's
eight values land in operand columns whose order is exactly ``word_pair_columns``, so the decode is register-local and
the sorted copy is the one the Triton tile reads.

Gluon has no interpreter: under ``TRITON_INTERPRET=1``, on GPUs without ``wgmma`` and for operands the ring cannot
copy in whole pieces the launcher (``cuda.grouped_gemm``) runs the ``swap_bf16`` tile of the same rows instead.
"""

# Gluon reads parameter annotations as kernel type hints, so @gluon.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer_kernels.cuda._launch import dependent_launch
from deepinfer_kernels.cuda.gemm_operands import _E2M1_SCALED_PTX
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.cuda.gluon_ring import (
    PIECE,
    ROWS_PER_WARP,
    advance_ring,
    await_gluon_inputs,
    bits,
    copy_layout,
    shared_layouts,
    start_ring,
    tile_constexprs,
    weight_layouts,
    weight_pointers,
)
from deepinfer_kernels.cuda.grouped_wgmma import fits
from deepinfer_kernels.cuda.swap_bf16 import sorted_bf16_activation

__all__ = ["grouped_bf16_constexprs", "grouped_bf16_launch"]

# BF16 elements a thread copies at a time (one 16-byte cp.async).
_ACT_PIECE = PIECE // 2


@functools.cache
def _layouts(block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    """The kernel's layouts for its tile (docs/design/kernels.md, "The BF16 ring kernel")."""
    block_n, groups = ROWS_PER_WARP * num_warps, block_k // 32
    shared = shared_layouts(block_m, block_k, num_warps)
    # The same bytes as [BLOCK_N, GROUPS, 16], so that a group's scale byte can be broadcast over its 16 bytes.
    weight_groups = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + [[0, g, 0] for g in bits(groups)],
        lane_bases=[[0, 0, 4], [0, 0, 8], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[ROWS_PER_WARP * w, 0, 0] for w in bits(num_warps)],
        block_bases=[],
        shape=[block_n, groups, 16],
    )
    # A BF16 wgmma instruction takes 16 columns: the accumulator's instruction shape differs from the FP8 kernels'.
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])
    return {
        "acc": acc,
        **weight_layouts(block_k, num_warps),
        "weight_groups": weight_groups,
        "scale_copy": shared["scale_copy"],
        "scale_slot": shared["scale_slot"],
        # x̂'s rows of a K step [BLOCK_M, BLOCK_K], the K-major second operand of the wgmma.
        "act_copy": copy_layout(block_m, block_k, _ACT_PIECE, num_warps),
        "act_slot": gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        # The decoded weight [BLOCK_N, BLOCK_K], the K-major first operand.
        "decoded_slot": gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
    }


@gluon.jit
def _weight_values(raw, scale_bytes, WEIGHT_GROUPS: gl.constexpr):  # type: ignore[no-untyped-def]
    # A K step's packed weight bytes raw [rows, GROUPS·16] and scale bytes [rows, GROUPS] → the scaled BF16 values
    # [rows, BLOCK_K], column k holding the code word_pair_columns names, each thread's values decoded from its own
    # words (the conversion is asserted to move nothing). The PTX takes a word (4 bytes of one group) and its factor's
    # BF16 bits, and gives the low nibbles (even elements) and high nibbles (odd) of its bytes
    # (gemm_operands._e2m1_bf16_ptx).
    rows: gl.constexpr = raw.shape[0]
    groups: gl.constexpr = raw.shape[1] // 16
    raw = gl.convert_layout(gl.reshape(raw, (rows, groups, 16)), WEIGHT_GROUPS, assert_trivial=True)
    factor = ((scale_bytes.to(gl.int32) & 0xFF) << 7).to(gl.int16)
    raw, factor = gl.broadcast(raw, gl.expand_dims(factor, 2))
    even, odd = gl.inline_asm_elementwise(
        _E2M1_SCALED_PTX, "=r,=r,=r,=r,r,r,r", [raw, factor], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4
    )
    # Byte b = 4·word + 2·b1 + b0 of a group, nibble n: column 16·n + 8·b1 + 2·word + b0 (in the BF16 wgmma's
    # register operand layout, a thread's own columns).
    values = gl.reshape(gl.join(even, odd), (rows, groups, 4, 2, 2, 2))
    return gl.reshape(gl.permute(values, (0, 1, 5, 3, 2, 4)), (rows, groups * 32))


@gluon.jit
def _decode_step(  # type: ignore[no-untyped-def]
    step, decoded, weights, acts, w_scales, w_ptrs, w_in, a_ptrs, a_in, ws_ptrs, ws_in, steps, STAGES: gl.constexpr,
    BLOCK_K: gl.constexpr, WEIGHT: gl.constexpr, WEIGHT_GROUPS: gl.constexpr,
):  # fmt: skip
    # Wait for K step `step` to land (the ring then refills the slot step − 2 read: LAG one, the MMAs of step − 1 may
    # still run), decode its weight into the shared-memory operand `decoded`, and make the writes visible to the next
    # wgmma (the async proxy) for every thread.
    ROW_BYTES: gl.constexpr = BLOCK_K // 2
    advance_ring(
        step, weights, acts, w_scales, None, w_ptrs, w_in, a_ptrs, a_in, ws_ptrs, ws_in, None, None, steps, STAGES,
        ROW_BYTES, BLOCK_K, BLOCK_K // 32, 1,
    )  # fmt: skip
    slot = step % STAGES
    raw = weights.index(slot).load(WEIGHT)
    scale_bytes = w_scales.index(slot).load(gl.SliceLayout(2, WEIGHT_GROUPS))
    decoded.store(_weight_values(raw, scale_bytes, WEIGHT_GROUPS))


@gluon.jit
def _grouped_bf16_kernel(  # type: ignore[no-untyped-def]
    xs_ptr, packed_ptr, ws_ptr, out_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, num_experts, stride_xs, stride_pe, stride_p, stride_se, stride_s, stride_out,
    STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, ACC: gl.constexpr,
    WEIGHT: gl.constexpr, WEIGHT_GROUPS: gl.constexpr, WEIGHT_COPY: gl.constexpr, WEIGHT_SLOT: gl.constexpr,
    SCALE_COPY: gl.constexpr, SCALE_SLOT: gl.constexpr, ACT_COPY: gl.constexpr, ACT_SLOT: gl.constexpr,
    DECODED_SLOT: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    # Program (N block, tile) owns positions [tile_start, tile_end) of the sorted order, all of expert tile_expert (a
    # spare tile of the worst-case grid has an expert ≥ num_experts and exits); x̂'s row p is the activation of
    # product row order[p]. The N blocks of a tile are consecutive programs, so that a tile's rows of x̂ are read
    # from memory about once and its expert's weight while the expert's next tile runs (tile-major, every N block
    # re-read x̂ whole: 36 times for w13 at an 8K-token prefill, 18 GB). K is a multiple of BLOCK_K and the scale
    # row stride of GROUPS (grouped_wgmma.fits): only rows need masks.
    await_gluon_inputs(PDL)
    ROW_BYTES: gl.constexpr = BLOCK_K // 2
    tile = gl.program_id(1)
    expert = gl.load(tile_expert_ptr + tile)
    if expert >= num_experts:
        return
    start = gl.load(tile_start_ptr + tile)
    end = gl.load(tile_end_ptr + tile)
    packed_ptr += expert.to(gl.int64) * stride_pe
    ws_ptr += expert.to(gl.int64) * stride_se
    n0 = gl.program_id(0) * BLOCK_N

    # Where K step 0's pieces come from: the weight's (gluon_ring.weight_pointers) and the tile's rows of x̂.
    w_ptrs, w_in, ws_ptrs, ws_in = weight_pointers(
        packed_ptr, ws_ptr, n0, N, stride_p, stride_s, BLOCK_N, BLOCK_K, WEIGHT_COPY, SCALE_COPY
    )
    # The tile's rows of x̂ [BLOCK_M, BLOCK_K]: consecutive positions of the sorted copy.
    a_p = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ACT_COPY))
    a_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, ACT_COPY))
    a_ptrs = xs_ptr + (a_p * stride_xs)[:, None] + a_k[None, :]
    a_in = (a_p < end)[:, None]

    steps = K // BLOCK_K
    weights, acts, w_scales = start_ring(
        w_ptrs, w_in, a_ptrs, a_in, ws_ptrs, ws_in, None, None, steps, STAGES, BLOCK_N, ROW_BYTES, ROW_BYTES,
        BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_SLOT, ACT_SLOT, SCALE_SLOT, 1,
    )  # fmt: skip
    # The decoded weight of two steps: one read by the running MMAs, the other being written.
    decoded = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_K], DECODED_SLOT)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    _decode_step(
        0, decoded.index(0), weights, acts, w_scales, w_ptrs, w_in, a_ptrs, a_in, ws_ptrs, ws_in, steps, STAGES,
        BLOCK_K, WEIGHT, WEIGHT_GROUPS,
    )  # fmt: skip
    fence_async_shared()
    gl.thread_barrier()
    for step in range(0, steps):
        # Step `step`'s MMAs run while the next step is waited for and its weight decoded into the other buffer (past
        # the last step, a slot's stale bytes that no MMA reads). Both operands are in shared memory: a register
        # operand would keep the decode waiting for the MMA that reads its registers (the assembler reuses them).
        acc = warpgroup_mma(decoded.index(step % 2), acts.index(step % STAGES).permute((1, 0)), acc, is_async=True)
        _decode_step(
            step + 1, decoded.index((step + 1) % 2), weights, acts, w_scales, w_ptrs, w_in, a_ptrs, a_in, ws_ptrs,
            ws_in, steps, STAGES, BLOCK_K, WEIGHT, WEIGHT_GROUPS,
        )  # fmt: skip
        acc = warpgroup_mma_wait(0, deps=[acc])
        fence_async_shared()
        # Every thread's decoded values are written before the next MMAs read them, and every warpgroup's MMAs are
        # done with the buffer the next decode overwrites.
        gl.thread_barrier()
    positions = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    in_tile = positions < end
    rows = gl.load(order_ptr + positions, mask=in_tile, other=0).to(gl.int64)
    n_rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    out_ptrs = out_ptr + rows[None, :] * stride_out + n_rows[:, None]
    gl.store(out_ptrs, acc.to(gl.bfloat16), mask=in_tile[None, :] & (n_rows < N)[:, None])


def grouped_bf16_constexprs(block_m: int, block_k: int, num_warps: int, stages: int) -> dict[str, object]:
    """The kernel's compile-time arguments for a tile (also what ``benchmarks/kernels_sass.py`` compiles)."""
    return tile_constexprs(_layouts(block_m, block_k, num_warps), block_m, block_k, num_warps, stages)


def grouped_bf16_launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: BlockConfig,
    repeats: int = 1,
) -> None:
    """The grouped MXFP4 GEMM on a ``gluon_bf16`` tile ``cfg`` (``swap_bf16.swap_bf16_launch``'s arguments): x
    [M / repeats, K] the unquantized activation (product row i reads row ``i // repeats``), packed [E, N, K/2] and
    scale [E, N, K/32] of the experts, out [M, N], ``tables`` of ``cuda.grouped_gemm.expert_tiles`` for tiles of
    ``cfg.block_m`` rows; the ring must :func:`~deepinfer_kernels.cuda.grouped_wgmma.fits` the weights."""
    if cfg.decoding != "gluon_bf16":
        raise ValueError(f"grouped_bf16_launch takes gluon_bf16 tiles, got {cfg}")
    (experts, n), k = packed.shape[:2], x.shape[1]
    if not fits(k, packed, scale, cfg.block_k):
        raise ValueError(
            f"the gluon_bf16 ring copies whole K steps: K ({k}) a multiple of block_k ({cfg.block_k}), the scale row"
            f" stride ({scale.stride(1)}) of its groups and 16-byte aligned weights"
        )
    order, tile_expert, tile_start, tile_end = tables
    xs = sorted_bf16_activation(x, order, repeats)
    _grouped_bf16_kernel[(triton.cdiv(n, cfg.block_n), tile_expert.numel())](
        xs, packed.view(torch.uint8), scale.view(torch.uint8), out, order, tile_expert, tile_start, tile_end,
        n, k, experts, xs.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0),
        **grouped_bf16_constexprs(cfg.block_m, cfg.block_k, cfg.num_warps, cfg.num_stages),
        num_warps=cfg.num_warps,
        **dependent_launch(out.device),
    )  # fmt: skip
