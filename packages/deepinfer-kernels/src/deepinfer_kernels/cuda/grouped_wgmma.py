"""Grouped MXFP4 GEMM for few rows per expert as a Gluon kernel with explicit layouts (Hopper ``wgmma``).

The same products, group sums and factor order as the ``swap_fp8`` tile of ``cuda.gemm`` (docs/design/kernels.md,
"The explicit-layout grouped GEMM"): the tile is computed transposed, ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ``, one FP8 ``wgmma``
per 32-column group with the weight as its register operand, each group's sum times the activation's factor, then the
weight's, added in FP32. What Triton could not be told, the layouts say here: each thread loads the packed weight words
that its part of the ``wgmma`` operand needs (lane ``j`` of a row the group's word ``j``: the low nibbles of its four
bytes are operand columns ``4j … 4j+3``, the high nibbles ``16+4j …``, which is the de-interleaved activation order), so
decoding is register-local and the operand needs no shuffle or shared-memory pass; the activation's K step is staged
once in shared memory (double-buffered, one barrier a step); a K step's scale bytes come in one vector load per row,
laid out so that each group's factors are already in the accumulator's row and column slices; the MMAs run
asynchronously one group apart.

Gluon has no interpreter: under ``TRITON_INTERPRET=1`` and on GPUs without ``wgmma`` the launcher
(``cuda.grouped_gemm``) runs the ``swap_fp8`` tile instead (:func:`available`).
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

from deepinfer_kernels.cuda.gemm_operands import _E2M1_E4M3_PTX
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = ["available", "gluon_constexprs", "grouped_wgmma_launch"]

# Rows of the wgmma's first operand per warp (a warpgroup's 4 warps make its 64 rows).
_ROWS_PER_WARP = 16


def available(device: torch.device) -> bool:
    """Whether the Gluon kernel can run on ``device``: compiled (not interpreted) on a Hopper (SM 9.x) GPU."""
    return (
        device.type == "cuda" and not triton_interpreter_enabled() and torch.cuda.get_device_capability(device)[0] == 9
    )


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def _accumulator_bases(block_m: int, num_warps: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(register, lane, warp) bases of the wgmma accumulator [16·num_warps, block_m] (Gluon's
    ``to_linear_layout`` of the NVMMA v3 layout with instruction shape [16, block_m, 32])."""
    registers = [[0, 1], [8, 0]] + [[0, 8 * c] for c in _bits(block_m // 8)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    return registers, lanes, [[_ROWS_PER_WARP * w, 0] for w in _bits(num_warps)]


def _scale_layout(bases: tuple[list[list[int]], ...], dim: int, groups: int, rows: int) -> gl.DistributedLinearLayout:
    """Scale bytes [rows, GROUPS] of a K step laid out so that dropping the group axis (the last, held in each
    thread's registers, lowest register bits first for vector loads) leaves the accumulator's slice along
    ``1 - dim``: each thread holds every group of the rows (or columns, ``dim`` 1) it multiplies."""
    registers, lanes, warps = ([[b[dim], 0] for b in level] for level in bases)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, g] for g in _bits(groups)] + [r for r in registers if r[0]],
        lane_bases=lanes,
        warp_bases=warps,
        block_bases=[],
        shape=[rows, groups],
    )


@functools.cache
def _layouts(block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    """The kernel's distributed layouts for its tile (docs/design/kernels.md, "The explicit-layout grouped GEMM")."""
    block_n, groups = _ROWS_PER_WARP * num_warps, block_k // 32
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 32])
    bases = _accumulator_bases(block_m, num_warps)
    # Packed weight bytes [BLOCK_N, GROUPS, 16] of a K step, placed as the wgmma operand wants their decoded values:
    # a thread's 4 consecutive bytes (one word) of rows r and r + 8 in each group, lane bits 0-1 the word, lane bits
    # 2-4 and the warps the row.
    weight = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]] + [[0, g, 0] for g in _bits(groups)],
        lane_bases=[[0, 0, 4], [0, 0, 8], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[w[0], 0, 0] for w in bases[2]],
        block_bases=[],
        shape=[block_n, groups, 16],
    )
    # Activation codes [GROUPS, BLOCK_M, 32] of a K step on their way to shared memory: 8 bytes a thread.
    codes = gl.BlockedLayout(
        size_per_thread=[1, 1, 8], threads_per_warp=[1, 8, 4], warps_per_cta=[num_warps, 1, 1], order=[2, 1, 0]
    )
    staged = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2)
    return {
        "acc": acc,
        "weight": weight,
        "codes": codes,
        "staged": staged,
        "weight_scales": _scale_layout(bases, 0, groups, block_n),
        "code_scales": _scale_layout(bases, 1, groups, block_m),
    }


@gluon.jit
def _pow2(scale_bytes, BIAS: gl.constexpr):  # type: ignore[no-untyped-def]
    # 2^(b − 127 + BIAS) from its FP32 bits (cuda.gemm_operands.pow2): exact for the scale bytes the kernels meet.
    return (((scale_bytes.to(gl.int32) & 0xFF) + BIAS) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _group(x, g: gl.constexpr, GROUP_BITS: gl.constexpr):  # type: ignore[no-untyped-def]
    # Group g of x [R, GROUPS] whose groups each thread holds in registers: halving the group axis, lowest index bit
    # first, only renames registers.
    for level in gl.static_range(GROUP_BITS):
        even, odd = gl.split(gl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = odd if (g >> level) & 1 else even
    return gl.reshape(x, (x.shape[0],))


@gluon.jit
def _weight_operand(raw, g: gl.constexpr, GROUP_BITS: gl.constexpr, OPERAND: gl.constexpr):  # type: ignore[no-untyped-def]
    # Group g's e4m3 codes of the weight values times 2^-6 (cuda.gemm_operands.e2m1_e4m3_codes), low nibbles then
    # high ones, as the wgmma's register operand; the conversion is asserted to move nothing.
    rows: gl.constexpr = raw.shape[0]
    packed = gl.reshape(
        _group(gl.reshape(gl.permute(raw, (0, 2, 1)), (rows * 16, raw.shape[1])), g, GROUP_BITS), (rows, 16)
    )
    low, high = gl.inline_asm_elementwise(
        _E2M1_E4M3_PTX, "=r,=r,r", [packed], dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4
    )
    codes = gl.reshape(gl.permute(gl.join(low, high), (0, 2, 1)), (rows, 32))
    return gl.convert_layout(codes.to(gl.float8e4nv, bitcast=True), OPERAND, assert_trivial=True)


@gluon.jit
def _group_mma(  # type: ignore[no-untyped-def]
    raw, buffer, zero, g: gl.constexpr, GROUP_BITS: gl.constexpr, BLOCK_M: gl.constexpr, OPERAND: gl.constexpr
):
    # Group g's asynchronous wgmma: the decoded weight group times the staged activation group, from zero.
    weight = _weight_operand(raw, g, GROUP_BITS, OPERAND)
    codes = buffer.slice(g * BLOCK_M, BLOCK_M).permute((1, 0))
    return warpgroup_mma(weight, codes, zero, use_acc=False, is_async=True)


@gluon.jit
def _add_group(  # type: ignore[no-untyped-def]
    total,
    part,
    a_scales,
    w_scales,
    g: gl.constexpr,
    GROUP_BITS: gl.constexpr,
    TOKENS: gl.constexpr,
    W_ROWS: gl.constexpr,
):
    # total + group g's sum times the activation's factor per token (bias 0), then the weight's per row (bias 6: its
    # codes are the values times 2^-6), in that order (cuda.gemm_decodings.group_tiles).
    a_factors = _pow2(gl.convert_layout(_group(a_scales, g, GROUP_BITS), TOKENS), 0)
    w_factors = _pow2(gl.convert_layout(_group(w_scales, g, GROUP_BITS), W_ROWS), 6)
    return total + part * a_factors[None, :] * w_factors[:, None]


@gluon.jit
def _tile_rows(  # type: ignore[no-untyped-def]
    order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, LAYOUT: gl.constexpr, SCAN: gl.constexpr,
    BLOCK_M: gl.constexpr,
):  # fmt: skip
    # (rows [BLOCK_M] int64, row mask, expert) of this program in LAYOUT; an expert < 0 means no work (see
    # cuda.gemm.mxfp4_kernel: SCAN finds the rows of the expert of row pid when pid is its first row; otherwise the
    # tile tables give the expert and the half-open range of positions in the expert-sorted order).
    pid = gl.program_id(0)
    slots = gl.arange(0, BLOCK_M, layout=LAYOUT)
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
    SCAN: gl.constexpr, EVEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_BITS: gl.constexpr, ACC: gl.constexpr, WEIGHT: gl.constexpr, CODES: gl.constexpr, STAGED: gl.constexpr,
    WEIGHT_SCALES: gl.constexpr, CODE_SCALES: gl.constexpr,
):  # fmt: skip
    # EVEN: N a multiple of BLOCK_N, K of BLOCK_K and the scales' row strides of GROUPS: only the tile's rows need
    # masks.
    GROUPS: gl.constexpr = BLOCK_K // 32
    OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=4)
    TOKENS: gl.constexpr = gl.SliceLayout(0, ACC)
    W_ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    CODE_ROWS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, CODES))
    rows, row_mask, expert = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, TOKENS, SCAN, BLOCK_M
    )
    if (expert < 0) | (expert >= num_experts):
        return
    code_rows, code_mask, _ = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, CODE_ROWS, SCAN, BLOCK_M
    )
    scale_rows, scale_mask, _ = _tile_rows(
        order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, M, gl.SliceLayout(1, CODE_SCALES), SCAN, BLOCK_M
    )
    packed_ptr += expert.to(gl.int64) * stride_pe
    ws_ptr += expert.to(gl.int64) * stride_se
    n0 = gl.program_id(1) * BLOCK_N

    # Weight bytes [BLOCK_N, GROUPS, 16] of the K step at k0: row n, group g, byte b at n·stride_p + k0/2 + 16g + b.
    w_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, WEIGHT)))
    w_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, WEIGHT)))
    w_b = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, WEIGHT)))
    w_ptrs = packed_ptr + (w_n.to(gl.int64) * stride_p)[:, None, None] + (w_g * 16)[None, :, None] + w_b[None, None, :]
    # Activation codes [GROUPS, BLOCK_M, 32] (already de-interleaved per group) of the tile's rows.
    c_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, CODES)))
    c_k = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, CODES)))
    c_ptrs = q_ptr + (code_rows * stride_q)[None, :, None] + (c_g * 32)[:, None, None] + c_k[None, None, :]
    c_rows_in = code_mask[None, :, None]
    # Scale bytes [rows, GROUPS] of a K step: the weight's per row, the activation's per token.
    # EVEN: both row strides are multiples of GROUPS, told to the compiler (vector loads).
    s_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WEIGHT_SCALES))
    s_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, WEIGHT_SCALES))
    a_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, CODE_SCALES))
    if EVEN:
        ws_ptrs = ws_ptr + gl.multiple_of(s_n.to(gl.int64) * stride_s, GROUPS)[:, None] + s_g[None, :]
        qs_ptrs = qs_ptr + gl.multiple_of(scale_rows * stride_qs, GROUPS)[:, None] + a_g[None, :]
    else:
        ws_ptrs = ws_ptr + (s_n.to(gl.int64) * stride_s)[:, None] + s_g[None, :]
        qs_ptrs = qs_ptr + (scale_rows * stride_qs)[:, None] + a_g[None, :]
    n_rows = n0 + gl.arange(0, BLOCK_N, layout=W_ROWS)

    staged = gl.allocate_shared_memory(gl.float8e4nv, [2, GROUPS * BLOCK_M, 32], STAGED)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC)
    for step in range(0, gl.cdiv(K, BLOCK_K)):
        k0 = step * BLOCK_K
        # K is a multiple of 32, so whole groups are in or out of range.
        if EVEN:
            raw = gl.load(w_ptrs + k0 // 2)
            w_scales = gl.load(ws_ptrs + step * GROUPS)
            codes = gl.load(c_ptrs + k0, mask=c_rows_in, other=0)
            a_scales = gl.load(qs_ptrs + step * GROUPS, mask=scale_mask[:, None], other=0)
        else:
            w_in = (w_n < N)[:, None, None] & (k0 + 32 * w_g < K)[None, :, None]
            raw = gl.load(w_ptrs + k0 // 2, mask=w_in, other=0)
            w_scales = gl.load(ws_ptrs + step * GROUPS, mask=(s_n < N)[:, None] & (k0 + 32 * s_g < K)[None, :], other=0)
            codes = gl.load(c_ptrs + k0, mask=c_rows_in & (k0 + 32 * c_g < K)[:, None, None], other=0)
            a_in = scale_mask[:, None] & (k0 + 32 * a_g < K)[None, :]
            a_scales = gl.load(qs_ptrs + step * GROUPS, mask=a_in, other=0)
        buffer = staged.index(step % 2)
        buffer.store(gl.reshape(codes, (GROUPS * BLOCK_M, 32)).to(gl.float8e4nv, bitcast=True))
        fence_async_shared()
        gl.thread_barrier()
        # One asynchronous wgmma per group, each group's sum scaled and added while the next group's MMA runs (the
        # assembler keeps an in-flight MMA's register operand until its wait).
        previous = _group_mma(raw, buffer, zero, 0, GROUP_BITS, BLOCK_M, OPERAND)
        for g in gl.static_range(1, GROUPS):
            pending = _group_mma(raw, buffer, zero, g, GROUP_BITS, BLOCK_M, OPERAND)
            part = warpgroup_mma_wait(1, deps=[previous])
            total = _add_group(total, part, a_scales, w_scales, g - 1, GROUP_BITS, TOKENS, W_ROWS)
            previous = pending
        part = warpgroup_mma_wait(0, deps=[previous])
        total = _add_group(total, part, a_scales, w_scales, GROUPS - 1, GROUP_BITS, TOKENS, W_ROWS)
    out_ptrs = out_ptr + rows[None, :] * stride_out + n_rows[:, None]
    gl.store(out_ptrs, total.to(gl.bfloat16), mask=row_mask[None, :] & (n_rows < N)[:, None])


def gluon_constexprs(scan: bool, even: bool, block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    """The kernel's compile-time arguments for a tile (also what ``benchmarks/kernels_sass.py`` compiles)."""
    layouts = _layouts(block_m, block_k, num_warps)
    return {
        "SCAN": scan,
        "EVEN": even,
        "BLOCK_M": block_m,
        "BLOCK_N": _ROWS_PER_WARP * num_warps,
        "BLOCK_K": block_k,
        "GROUP_BITS": (block_k // 32).bit_length() - 1,
        "ACC": layouts["acc"],
        "WEIGHT": layouts["weight"],
        "CODES": layouts["codes"],
        "STAGED": layouts["staged"],
        "WEIGHT_SCALES": layouts["weight_scales"],
        "CODE_SCALES": layouts["code_scales"],
    }


def grouped_wgmma_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor | tuple[torch.Tensor, ...],
    block_m: int,
    cfg: BlockConfig,
) -> None:
    """Launch the kernel on de-interleaved activation codes ``q`` [M, K] (``cuda.gemm.deinterleaved_activation``)
    with their scale bytes, ``packed`` [E, N, K/2] and ``scale`` [E, N, K/32] of the experts, into ``out`` [M, N]
    (``cuda.gemm.mxfp4_launch``'s arguments; ``cfg`` a ``gluon_fp8`` tile of ``block_m`` rows).

    ``rows`` is the expert id per row when every row fits one tile (``M ≤ block_m``: each program scans for its
    expert's rows) or the tile tables of ``cuda.grouped_gemm.expert_tiles`` for tiles of ``block_m`` rows.
    """
    (m, k), (experts, n) = q.shape, packed.shape[:2]
    block_n, block_k, groups = cfg.block_n, cfg.block_k, cfg.block_k // 32
    even = n % block_n == 0 and k % block_k == 0 and scale.stride(1) % groups == 0 and q_scale.stride(0) % groups == 0
    tables: tuple[torch.Tensor, ...]
    if isinstance(rows, torch.Tensor):
        scan, tables, tiles = True, (rows, rows, rows, rows), m
    else:
        scan, tables, tiles = False, rows, rows[1].numel()
    _grouped_wgmma_kernel[(tiles, triton.cdiv(n, block_n))](
        q, q_scale, packed, scale.view(torch.uint8), out, *tables,
        m, n, k, experts, q.stride(0), q_scale.stride(0), packed.stride(0), packed.stride(1),
        scale.stride(0), scale.stride(1), out.stride(0),
        **gluon_constexprs(scan, even, block_m, block_k, cfg.num_warps), num_warps=cfg.num_warps,
    )  # fmt: skip
