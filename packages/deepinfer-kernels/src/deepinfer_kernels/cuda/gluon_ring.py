"""Parts the Gluon GEMM kernels share (``cuda.grouped_wgmma``, ``cuda.fp8_wgmma``; docs/design/kernels.md, "The
explicit-layout grouped GEMM"): the transposed tile ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ`` on Hopper's FP8 ``wgmma``, one
MMA per 32-column group, whose K steps travel by ``cp.async`` through a ring of shared-memory slots.

Layouts are written down here: the ``wgmma`` accumulator's, the activation's codes ``[GROUPS·BLOCK_M, 32]`` (group
``g`` of the tile's token ``m`` at slot row ``g·BLOCK_M + m``, each group's slice a K-major ``[BLOCK_M, 32]`` operand),
and the scale bytes of both sides, read from their slots into the accumulator's row and column slices so that a
group's factors need no shuffle. Each group's sum is scaled by the activation's factor, then the weight's, and added
in FP32: the ``swap_fp8`` tile's products, sums and factor order (``cuda.gemm_decodings.group_tiles``).
"""

# Gluon reads parameter annotations as kernel type hints, so @gluon.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = [
    "PIECE",
    "ROWS_PER_WARP",
    "add_group",
    "advance_ring",
    "available",
    "await_gluon_inputs",
    "bits",
    "copy_layout",
    "gluon_supported",
    "group",
    "pow2",
    "shared_layouts",
    "start_ring",
    "tile_constexprs",
    "weight_layouts",
    "weight_pointers",
]

# Rows of the wgmma's first operand per warp (a warpgroup's 4 warps make its 64 rows).
ROWS_PER_WARP = 16
# Bytes of the widest cp.async.
PIECE = 16
# Triton 3.6 names the copy async_copy_global_to_shared; later releases async_load (the old name then raises).
_copy = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


def gluon_supported(version: str) -> bool:
    """Whether Triton ``version`` has the Gluon API these kernels are written against: the 3.6 releases, the ones
    they were compiled and tested with on H100s and H200s (docs/hardware.md). Gluon is experimental and its API moved
    after 3.6 (3.9 has no ``thread_barrier`` and no ``shared_memory_descriptor._reinterpret``), so on other releases
    the launchers take the same sums from the Triton kernels (docs/design/kernels.md, "The explicit-layout grouped
    GEMM")."""
    return version.split(".")[:2] == ["3", "6"]


def available(device: torch.device) -> bool:
    """Whether the Gluon kernels can run on ``device``: compiled (not interpreted) on a Hopper (SM 9.x) GPU, with a
    Triton whose Gluon API they were written against (:func:`gluon_supported`)."""
    return (
        device.type == "cuda"
        and not triton_interpreter_enabled()
        and gluon_supported(triton.__version__)
        and torch.cuda.get_device_capability(device)[0] == 9
    )


@gluon.jit
def await_gluon_inputs(PDL: gl.constexpr):  # type: ignore[no-untyped-def]
    # _launch.await_inputs for the Gluon kernels, which cannot call a triton.jit function: the first statement of
    # every one, waiting for the kernels before it, then letting the next one launch (docs/design/kernels.md,
    # "Dependent launches").
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def bits(n: int) -> list[int]:
    """The powers of two below ``n`` (a power of two): the bases of an axis of length ``n``."""
    return [1 << i for i in range(n.bit_length() - 1)]


def _accumulator_bases(block_m: int, num_warps: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(register, lane, warp) bases of the wgmma accumulator [16·num_warps, block_m] (Gluon's
    ``to_linear_layout`` of the NVMMA v3 layout with instruction shape [16, block_m, 32])."""
    registers = [[0, 1], [8, 0]] + [[0, 8 * c] for c in bits(block_m // 8)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    return registers, lanes, [[ROWS_PER_WARP * w, 0] for w in bits(num_warps)]


def _scale_layout(bases: tuple[list[list[int]], ...], dim: int, groups: int, rows: int) -> gl.DistributedLinearLayout:
    """Scale bytes [rows, GROUPS] of a K step laid out so that dropping the group axis (the last, held in each
    thread's registers) leaves the accumulator's slice along ``1 - dim``: each thread holds every group of the rows
    (or columns, ``dim`` 1) it multiplies."""
    registers, lanes, warps = ([[b[dim], 0] for b in level] for level in bases)
    return gl.DistributedLinearLayout(
        reg_bases=[[0, g] for g in bits(groups)] + [r for r in registers if r[0]],
        lane_bases=lanes,
        warp_bases=warps,
        block_bases=[],
        shape=[rows, groups],
    )


def copy_layout(rows: int, row_bytes: int, piece: int, num_warps: int) -> gl.BlockedLayout:
    """Global-to-shared copy of [rows, row_bytes] bytes, ``piece`` contiguous bytes a thread (lanes along a row
    first)."""
    across = min(32, row_bytes // piece)
    return gl.BlockedLayout(
        size_per_thread=[1, piece], threads_per_warp=[32 // across, across], warps_per_cta=[num_warps, 1], order=[1, 0]
    )


def shared_layouts(block_m: int, block_k: int, num_warps: int) -> dict[str, object]:
    """The layouts both kernels use for a tile of ``16·num_warps`` weight rows, ``block_m`` tokens and ``block_k``
    columns a K step: the accumulator, the codes' copy and slot, the scale bytes' copies, slot and read layouts."""
    block_n, groups = ROWS_PER_WARP * num_warps, block_k // 32
    bases = _accumulator_bases(block_m, num_warps)
    # A row's scale bytes of a step go as one piece (4 bytes at least: block_k ≥ 128).
    scale_piece = max(4, groups // 2)
    return {
        "acc": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 32]),
        # Activation codes [GROUPS·BLOCK_M, 32] of a K step: 8 bytes a thread.
        "codes_copy": copy_layout(groups * block_m, 32, 8, num_warps),
        "codes_slot": gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8, rank=2),
        "scale_copy": copy_layout(block_n, groups, scale_piece, num_warps),
        "code_scale_copy": copy_layout(block_m, groups, scale_piece, num_warps),
        "scale_slot": gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
        "weight_scales": _scale_layout(bases, 0, groups, block_n),
        "code_scales": _scale_layout(bases, 1, groups, block_m),
    }


def tile_constexprs(
    layouts: dict[str, object], block_m: int, block_k: int, num_warps: int, stages: int
) -> dict[str, object]:
    """The compile-time arguments the Gluon GEMM kernels share for a tile: its ring's slots, sizes and ``layouts``
    (each under its name in capitals)."""
    return {
        "STAGES": stages,
        "BLOCK_M": block_m,
        "BLOCK_N": ROWS_PER_WARP * num_warps,
        "BLOCK_K": block_k,
        **{name.upper(): layout for name, layout in layouts.items()},
    }


def weight_layouts(block_k: int, num_warps: int) -> dict[str, object]:
    """The MXFP4 kernels' layouts of the packed weight bytes [16·num_warps, block_k/2] of a K step: their copy, their
    slot, and how they are read from it, as the wgmma operand wants their decoded values: a thread's 4 consecutive
    bytes (one word) of rows r and r + 8 in each group (16 bytes), lane bits 0-1 the word, lane bits 2-4 and the warps
    the row."""
    block_n, groups, row_bytes = ROWS_PER_WARP * num_warps, block_k // 32, block_k // 2
    chunks = row_bytes // PIECE
    return {
        "weight": gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]] + [[0, PIECE * g] for g in bits(groups)],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[ROWS_PER_WARP * w, 0] for w in bits(num_warps)],
            block_bases=[],
            shape=[block_n, row_bytes],
        ),
        "weight_copy": copy_layout(block_n, row_bytes, PIECE, num_warps),
        # 16-byte chunks XOR (row / per_phase) mod max_phase, 128 bytes a phase, so that the 8 rows a warp's lanes read
        # together (the same word of one group) fall in distinct banks.
        "weight_slot": gl.SwizzledSharedLayout(
            vec=PIECE, per_phase=max(1, 8 // chunks), max_phase=min(8, chunks), order=[1, 0]
        ),
    }


@gluon.jit
def weight_pointers(  # type: ignore[no-untyped-def]
    packed_ptr, ws_ptr, n0, N, stride_p, stride_s, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    WEIGHT_COPY: gl.constexpr, SCALE_COPY: gl.constexpr,
):  # fmt: skip
    # Where K step 0's pieces of an MXFP4 weight's rows n0 … n0 + BLOCK_N − 1 come from, and which rows are in N: the
    # packed bytes [BLOCK_N, BLOCK_K/2] (row n at n·stride_p) and the scale bytes [BLOCK_N, GROUPS], whose row stride
    # is a multiple of GROUPS (the launchers' fits), told to the compiler so that a row's bytes go as one piece.
    GROUPS: gl.constexpr = BLOCK_K // 32
    w_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WEIGHT_COPY))
    w_c = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, WEIGHT_COPY))
    w_ptrs = packed_ptr + (w_n.to(gl.int64) * stride_p)[:, None] + w_c[None, :]
    s_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_COPY))
    s_g = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, SCALE_COPY))
    ws_ptrs = ws_ptr + gl.multiple_of(s_n.to(gl.int64) * stride_s, GROUPS)[:, None] + s_g[None, :]
    return w_ptrs, (w_n < N)[:, None], ws_ptrs, (s_n < N)[:, None]


@gluon.jit
def pow2(scale_bytes, BIAS: gl.constexpr):  # type: ignore[no-untyped-def]
    # 2^(b − 127 + BIAS) from its FP32 bits (cuda.gemm_operands.pow2): exact for the scale bytes the kernels meet.
    return (((scale_bytes.to(gl.int32) & 0xFF) + BIAS) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def group(x, g: gl.constexpr, GROUP_BITS: gl.constexpr):  # type: ignore[no-untyped-def]
    # Group g of x [R, GROUPS] whose groups each thread holds in registers: halving the group axis, lowest index bit
    # first, only renames registers.
    for level in gl.static_range(GROUP_BITS):
        even, odd = gl.split(gl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = odd if (g >> level) & 1 else even
    return gl.reshape(x, (x.shape[0],))


@gluon.jit
def add_group(  # type: ignore[no-untyped-def]
    total,
    part,
    a_scales,
    w_scales,
    g: gl.constexpr,
    GROUP_BITS: gl.constexpr,
    W_BIAS: gl.constexpr,
    ACC: gl.constexpr,
):
    # total + group g's sum times the activation's factor per token (bias 0), then the weight's per row (W_BIAS: 6 for
    # e2m1 codes turned into e4m3 codes of the value times 2^-6, 0 for e4m3), in that order
    # (cuda.gemm_decodings.group_tiles).
    a_factors = pow2(gl.convert_layout(group(a_scales, g, GROUP_BITS), gl.SliceLayout(0, ACC)), 0)
    w_factors = pow2(gl.convert_layout(group(w_scales, g, GROUP_BITS), gl.SliceLayout(1, ACC)), W_BIAS)
    return total + part * a_factors[None, :] * w_factors[:, None]


@gluon.jit
def _copy_step(  # type: ignore[no-untyped-def]
    weights, codes, w_scales, a_scales, slot, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, step,
    W_STEP: gl.constexpr, BLOCK_K: gl.constexpr, GROUPS: gl.constexpr,
):  # fmt: skip
    # Start the copies of K step `step`'s operands into their slots `slot` (a weight row's step is W_STEP bytes; rows
    # outside the tile or N read as zeros; a BF16 activation has no scales, a_scales None).
    _copy(weights.index(slot), w_ptrs + step * W_STEP, mask=w_in)
    _copy(codes.index(slot), c_ptrs + step * BLOCK_K, mask=c_in)
    _copy(w_scales.index(slot), ws_ptrs + step * GROUPS, mask=ws_in)
    if a_scales is not None:
        _copy(a_scales.index(slot), qs_ptrs + step * GROUPS, mask=qs_in)


@gluon.jit
def start_ring(  # type: ignore[no-untyped-def]
    w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, steps, STAGES: gl.constexpr, W_ROWS: gl.constexpr,
    W_BYTES: gl.constexpr, W_STEP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    WEIGHT_SLOT: gl.constexpr, CODES_SLOT: gl.constexpr, SCALE_SLOT: gl.constexpr, LAG: gl.constexpr = 0,
):  # fmt: skip
    # The ring's slots (weight bytes [W_ROWS, W_BYTES], the activation's codes [GROUPS·BLOCK_M, 32] and both sides'
    # scale bytes, or, with no activation scales (qs_ptrs None), its BF16 values [BLOCK_M, BLOCK_K] and the weight's
    # scale bytes), every one but
    # the last LAG + 1 filled ahead: LAG is how many steps' MMAs may still read their slots when the next step starts.
    # One copy group per step, committed even when empty, so that the count of groups still in flight says which step
    # has landed.
    GROUPS: gl.constexpr = BLOCK_K // 32
    weights = gl.allocate_shared_memory(gl.uint8, [STAGES, W_ROWS, W_BYTES], WEIGHT_SLOT)
    w_scales = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, GROUPS], SCALE_SLOT)
    if qs_ptrs is None:
        codes = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], CODES_SLOT)
        a_scales = None
    else:
        codes = gl.allocate_shared_memory(gl.uint8, [STAGES, GROUPS * BLOCK_M, 32], CODES_SLOT)
        a_scales = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_M, GROUPS], SCALE_SLOT)
    for s in gl.static_range(STAGES - 1 - LAG):
        if s < steps:
            _copy_step(
                weights, codes, w_scales, a_scales, s, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, s,
                W_STEP, BLOCK_K, GROUPS,
            )  # fmt: skip
        async_copy.commit_group()
    if qs_ptrs is None:
        return weights, codes, w_scales
    else:
        return weights, codes, w_scales, a_scales


@gluon.jit
def advance_ring(  # type: ignore[no-untyped-def]
    step, weights, codes, w_scales, a_scales, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in, steps,
    STAGES: gl.constexpr, W_STEP: gl.constexpr, BLOCK_K: gl.constexpr, GROUPS: gl.constexpr, LAG: gl.constexpr = 0,
):  # fmt: skip
    # Wait until K step `step` is in its slot (step % STAGES) for every thread, then start the step STAGES − 1 − LAG
    # ahead into the slot step − 1 − LAG used. The fence orders this thread's landed copies before the wgmma's reads
    # (another proxy); the barrier waits for every thread's, and for every thread to be done with the slot refilled
    # (every wgmma but the last LAG steps' was waited for before it).
    async_copy.wait_group(STAGES - 2 - LAG)
    fence_async_shared()
    gl.thread_barrier()
    ahead = step + STAGES - 1 - LAG
    if ahead < steps:
        refill = ahead % STAGES
        _copy_step(
            weights, codes, w_scales, a_scales, refill, w_ptrs, w_in, c_ptrs, c_in, ws_ptrs, ws_in, qs_ptrs, qs_in,
            ahead, W_STEP, BLOCK_K, GROUPS,
        )  # fmt: skip
    async_copy.commit_group()
