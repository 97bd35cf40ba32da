"""Triton device functions shared by the quantized GEMM kernels: operand decoding, K-chunk ranges, split-K partials
and their reduction (docs/design/numerics.md, "GEMM accumulation"; docs/design/kernels.md, "GEMM tiles and split-K").

Decoding places a code's bits into an fp16 (the e4m3 magnitude bits at bits 7–13 give the value times 2^−8, the e2m1
bits at 9–11 the value times 2^−14, subnormal codes included, since fp16 keeps subnormals), widens it to FP32 and
multiplies by ``2^(b − 127 + 8)`` resp. ``2^(b − 127 + 14)`` built from its bits; see ``cuda.gemm`` for why every
step is exact. The FP16 operands of the ``group_fp16`` decoding stop before the widening: the e2m1 fp16 bits are
built four bytes at a time by a few PTX integer instructions (``e2m1_halves``), the e4m3 ones by the hardware
conversion (``e4m3_half``), and the scales are applied to the group sums instead.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.branch_streams import stream_lane
from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, chunk_length
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = [
    "CHUNKS_PER_LOAD",
    "chunk_range",
    "dot_in_bf16",
    "e2m1_e4m3_codes",
    "e2m1_half_bits",
    "e2m1_halves",
    "e2m1_tiles",
    "e2m1_word_pairs",
    "e4m3_half",
    "e4m3_operand",
    "e4m3_tile",
    "e4m3_unscaled",
    "finish_tile",
    "group_activation",
    "half_to_float",
    "launch_grid",
    "native_fp8",
    "operand",
    "pow2",
    "settled",
    "split_buffers",
    "split_counters",
    "word_pair_columns",
]


def dot_in_bf16() -> bool:
    """Value of the kernels' ``DOT_BF16``: bf16 MMA operands when compiled, FP32 in the interpreter."""
    return not triton_interpreter_enabled()


def native_fp8() -> bool:
    """Value of the kernels' ``NATIVE_FP8``: hardware e4m3 conversion when compiled; bit decoding in the interpreter,
    whose e4m3 cast turns the NaN codes into 480."""
    return not triton_interpreter_enabled()


@triton.jit
def operand(value, DOT_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    if DOT_BF16:
        return value.to(tl.bfloat16)
    else:
        return value


@triton.jit
def settled(acc, COMPILED: tl.constexpr):  # type: ignore[no-untyped-def]
    # The accumulator through an identity Triton cannot see into. A dot whose first operand is in registers runs as
    # one wgmma per 16 columns of K; pipelined, Triton retires all but the last of them at the end of the loop body,
    # and ptxas may then give the next K step's operand values the registers those wgmma still read (undefined in PTX;
    # triton-lang/triton issue 9433; garbage columns on the H200, docs/design/kernels.md, "GEMM tiles and split-K").
    # Using the accumulator inside the loop makes Triton retire every wgmma of the step first.
    if COMPILED:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return acc


@triton.jit
def pow2(scale_bytes, bias: tl.constexpr):  # type: ignore[no-untyped-def]
    # 2^(b − 127 + bias) built from its FP32 bits; a normal number for scale bytes b ≤ 254 − bias.
    return (((scale_bytes.to(tl.int32) & 0xFF) + bias) << 23).to(tl.float32, bitcast=True)


@triton.jit
def half_to_float(bits):  # type: ignore[no-untyped-def]
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_unscaled(raw, NATIVE_FP8: tl.constexpr):  # type: ignore[no-untyped-def]
    # The e4m3 values of the bytes raw as FP32, exact, NaN codes NaN: the values themselves with the hardware
    # conversion (NATIVE_FP8), the values times 2^−8 from the fp16 bit placement otherwise (scale with bias 8).
    if NATIVE_FP8:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        c = raw.to(tl.int32) & 0xFF
        magnitude = c & 0x7F
        value = half_to_float((magnitude << 7) | ((c & 0x80) << 8))
        return tl.where(magnitude == 0x7F, (0x7FC00000 + c * 0).to(tl.float32, bitcast=True), value)


@triton.jit
def e4m3_tile(raw, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # raw [ROWS, G, W] e4m3 bytes (W bytes of each of G scale groups), scale_bytes [ROWS, G] → [ROWS, COLS = G·W]
    # FP32 values (the hardware conversion when NATIVE, else the bits times 2^−8, undone by the factor's bias).
    if NATIVE:
        value = e4m3_unscaled(raw, True) * pow2(scale_bytes, 0)[:, :, None]
    else:
        value = e4m3_unscaled(raw, False) * pow2(scale_bytes, 8)[:, :, None]
    return tl.reshape(value, (ROWS, COLS))


@triton.jit
def e2m1_half_bits(code):  # type: ignore[no-untyped-def]
    # An e2m1 code's exponent and mantissa bits placed at fp16's bits 9–11 give the value times 2^−14 (code 1 = 0.5
    # becomes an fp16 subnormal); its sign bit goes to bit 15.
    return ((code & 0x7) << 9) | ((code & 0x8) << 12)


# Four packed e2m1 bytes ($4) → the fp16 bits of their low nibbles ($0: bytes 0, 1; $1: bytes 2, 3) and high nibbles
# ($2, $3), each value times 2^−14 as in e2m1_half_bits. prmt spreads two bytes to bits 0–7 and 16–23; per nibble the
# magnitude bits are shifted to 9–11 and 25–27 and the sign bit to 15 and 31 (lop3 0xF8: a | (b & c)). The bytes
# prmt leaves beside them land outside both masks.
_E2M1_HALVES_PTX = tl.constexpr(
    """
{
.reg .b32 x, m, s;
prmt.b32 x, $4, $4, 0x3120;
shl.b32 m, x, 9;
and.b32 m, m, 0x0E000E00;
shl.b32 s, x, 12;
lop3.b32 $0, m, s, 0x80008000, 0xF8;
shl.b32 m, x, 5;
and.b32 m, m, 0x0E000E00;
shl.b32 s, x, 8;
lop3.b32 $2, m, s, 0x80008000, 0xF8;
prmt.b32 x, $4, $4, 0x3322;
shl.b32 m, x, 9;
and.b32 m, m, 0x0E000E00;
shl.b32 s, x, 12;
lop3.b32 $1, m, s, 0x80008000, 0xF8;
shl.b32 m, x, 5;
and.b32 m, m, 0x0E000E00;
shl.b32 s, x, 8;
lop3.b32 $3, m, s, 0x80008000, 0xF8;
}
"""
)


@triton.jit
def e2m1_halves(raw, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # Packed e2m1 bytes raw (uint8) → (low-nibble, high-nibble) values times 2^−14: fp16 from the PTX above when
    # compiled (NATIVE), FP32 from the same bit placement in the interpreter (no inline assembly there).
    if NATIVE:
        return tl.inline_asm_elementwise(
            _E2M1_HALVES_PTX, "=r,=r,=r,=r,r", [raw], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        b = raw.to(tl.int32) & 0xFF
        return half_to_float(e2m1_half_bits(b & 0xF)), half_to_float(e2m1_half_bits(b >> 4))


# Four packed e2m1 bytes ($2) → the e4m3 codes of their low nibbles ($0) and of their high nibbles ($1), byte for
# byte, each the e2m1 value times 2^-6: a nibble's magnitude bits go to e4m3 bits 2–4 (exponent bits 3–4, mantissa
# bit 2; code 1 = 0.5 becomes the e4m3 subnormal 2^-7) and its sign to bit 7. Bits shifted in from neighbouring
# nibbles land outside both masks.
_E2M1_E4M3_PTX = tl.constexpr(
    """
{
.reg .b32 t, m, s;
shl.b32 t, $2, 2;
and.b32 m, t, 0x1C1C1C1C;
shl.b32 s, $2, 4;
lop3.b32 $0, m, s, 0x80808080, 0xF8;
shr.b32 t, $2, 2;
and.b32 m, t, 0x1C1C1C1C;
lop3.b32 $1, m, $2, 0x80808080, 0xF8;
}
"""
)


@triton.jit
def e2m1_e4m3_codes(raw, ROWS: tl.constexpr, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # raw [ROWS, 16] packed e2m1 bytes of one 32-column group → its [ROWS, 32] FP8 MMA operand in the order of
    # deinterleaved_activation (element j the low nibble of byte j, element 16 + j its high nibble): float8e4nv codes
    # of the values times 2^-6 when compiled (NATIVE), FP32 values times 2^-14 (e2m1_halves) in the interpreter. The
    # PTX's outputs are already the two halves, so no byte is moved (interleaving them back into column order took
    # about 0.25 PRMT per weight element, kernels_sass.py).
    if NATIVE:
        low, high = tl.inline_asm_elementwise(
            _E2M1_E4M3_PTX, "=r,=r,r", [raw], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
        return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (ROWS, 32)).to(tl.float8e4nv, bitcast=True)
    else:
        low, high = e2m1_halves(raw, False)
        return tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (ROWS, 32))


@triton.jit
def e4m3_operand(raw, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # e4m3 bytes as an FP8 MMA operand: the codes themselves when compiled (NATIVE), else their FP32 values times
    # 2^-8 (e4m3_unscaled).
    if NATIVE:
        return raw.to(tl.float8e4nv, bitcast=True)
    else:
        return e4m3_unscaled(raw, False)


def _e2m1_bf16_ptx(factor_01: str, factor_23: str) -> str:
    """PTX: four packed e2m1 bytes ($4) → four BF16 pairs, the low nibbles of bytes 0, 1 ($0) and of bytes 2, 3 ($1),
    the high nibbles of bytes 0, 1 ($2) and of bytes 2, 3 ($3), each value times a power-of-two factor whose BF16
    bits the operands ``factor_01`` (pairs of bytes 0, 1) and ``factor_23`` hold in both halves.

    prmt spreads two bytes to the two halves as in _E2M1_HALVES_PTX; each nibble's magnitude bits go to BF16 bits
    6–8 (the value times 2^−126, code 1 a BF16 subnormal) and its sign to bit 15; one multiply by 2^126 (0x7E80)
    makes the value normal, a second applies the factor. Both products are exact: powers of two, normal results for
    factor bytes in [2, 252]."""
    pairs = []
    for out, (select, factor) in enumerate((("0x3120", factor_01), ("0x3322", factor_23))):
        pairs.append(f"prmt.b32 x, $4, $4, {select};")
        for low_nibble, target in ((True, out), (False, out + 2)):
            magnitude, sign = (6, 12) if low_nibble else (2, 8)
            pairs += [
                f"shl.b32 m, x, {magnitude};",
                "and.b32 m, m, 0x01C001C0;",
                f"shl.b32 s, x, {sign};",
                "lop3.b32 m, m, s, 0x80008000, 0xF8;",
                "mul.rn.bf16x2 m, m, c;",
                f"mul.rn.bf16x2 ${target}, m, {factor};",
            ]
    return "\n".join(["{", ".reg .b32 x, m, s, c;", "mov.b32 c, 0x7E807E80;", *pairs, "}"])


# e2m1_word_pairs: the word in $4 (and again in $5), its group's factor bits in $6 (and $7).
_E2M1_WORD_PTX = tl.constexpr(_e2m1_bf16_ptx("$6", "$6"))
# e2m1_tiles: the factor bits of bytes 0, 1 in $5, of bytes 2, 3 in $6 (16-bit operands, packed two per register).
_E2M1_SCALED_PTX = tl.constexpr(_e2m1_bf16_ptx("$5", "$6"))


@triton.jit
def e2m1_word_pairs(words, scale_bytes, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # words [R, G, C, 2] int32 packed e2m1 words (each repeated along the last axis), scale_bytes [R, G, C, 2] their
    # groups' UE8M0 bytes → four [R, G, C, 2] tensors of scaled values, pair element j of output o of word c being
    # the code word_pair_columns places at 8·o + 2·c + j: BF16 from the PTX above when NATIVE, FP32 from the bit
    # placement of e2m1_half_bits otherwise (the interpreter).
    if NATIVE:
        factor = ((scale_bytes & 0xFF) << 7) * 0x10001
        return tl.inline_asm_elementwise(
            _E2M1_WORD_PTX,
            "=r,=r,=r,=r,r,r,r,r",
            [words, factor],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=2,
        )
    else:
        factor = pow2(scale_bytes, 14)
        pair = tl.arange(0, 2)[None, None, None, :]
        low_bytes = (words >> (8 * pair)) & 0xFF
        high_bytes = (words >> (8 * pair + 16)) & 0xFF
        return (
            half_to_float(e2m1_half_bits(low_bytes & 0xF)) * factor,
            half_to_float(e2m1_half_bits(high_bytes & 0xF)) * factor,
            half_to_float(e2m1_half_bits(low_bytes >> 4)) * factor,
            half_to_float(e2m1_half_bits(high_bytes >> 4)) * factor,
        )


@triton.jit
def word_pair_columns(BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    # The column of each k of a "swap_ab" MMA's K step: k = 32·g + 8·o + 2·c + j holds pair element j of output o of
    # e2m1_word_pairs on word c of group g (codes 8c … 8c+7 of the group; low nibbles are the even columns).
    k = tl.arange(0, BLOCK_K)
    o = (k % 32) // 8
    return 32 * (k // 32) + 8 * ((k % 8) // 2) + 4 * (o % 2) + o // 2 + 2 * (k % 2)


@triton.jit
def e4m3_half(raw, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # e4m3 bytes → their values as fp16 by the hardware conversion (NATIVE; exact, e4m3 ⊂ fp16), else the values
    # times 2^−8 as FP32 from the bits (e4m3_unscaled).
    if NATIVE:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        return e4m3_unscaled(raw, False)


@triton.jit
def e2m1_tiles(raw, scale_bytes, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # raw [ROWS, BLOCK_K/32, 16] packed bytes, scale_bytes [ROWS, BLOCK_K/32] → the even (low-nibble) and odd
    # (high-nibble) elements, scaled, as two [ROWS, BLOCK_K/2] tiles: column g·16 + j holds element g·32 + 2j of the
    # K step (even tile) or element g·32 + 2j + 1 (odd tile). Compiled (NATIVE): BF16 from _E2M1_SCALED_PTX. In the
    # interpreter: FP32 from e2m1_halves (values times 2^−14), which the scale factor's bias restores.
    if NATIVE:
        # BF16 straight from the PTX, scaled there (the same values, no FP32 round trip); BF16 bits of 2^(b − 127).
        bits = ((scale_bytes.to(tl.int32) & 0xFF) << 7).to(tl.int16)
        even, odd = tl.inline_asm_elementwise(
            _E2M1_SCALED_PTX,
            "=r,=r,=r,=r,r,r,r",
            [raw, tl.broadcast_to(bits[:, :, None], (ROWS, BLOCK_K // 32, 16))],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        factor = pow2(scale_bytes, 14)[:, :, None]
        even, odd = e2m1_halves(raw, NATIVE)
        even, odd = even.to(tl.float32) * factor, odd.to(tl.float32) * factor
    return tl.reshape(even, (ROWS, BLOCK_K // 2)), tl.reshape(odd, (ROWS, BLOCK_K // 2))


@triton.jit
def chunk_range(K, K_CHUNK, SPLIT_GRID: tl.constexpr):  # type: ignore[no-untyped-def]
    # The K chunks this program sums: its own (grid axis 2) under split-K, else all of them in order.
    if SPLIT_GRID:
        first = tl.program_id(2)
        return first, first + 1
    else:
        return 0, tl.cdiv(K, K_CHUNK)


@triton.jit
def group_activation(q_ptr, qs_ptr, K, N_PER_GROUP, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    # Grouped FP8 GEMM: weight rows g·N_PER_GROUP … (g+1)·N_PER_GROUP − 1 multiply activation columns g·K … (g+1)·K − 1
    # (K is the weight's width). A tile of BLOCK_N weight rows lies in one group (the launcher makes BLOCK_N divide
    # N_PER_GROUP), so the program moves its activation pointers to that group's columns. Dense: N_PER_GROUP = N.
    group = (tl.program_id(1) * BLOCK_N) // N_PER_GROUP
    return q_ptr + group * K, qs_ptr + group * (K // 32)


# Chunk sums a split-K tile's last program loads together (finish_tile): a decode GEMV has up to 20 chunks, and one L2
# round trip per chunk made the end of every split call a chain of that many dependent loads.
CHUNKS_PER_LOAD: tl.constexpr = tl.constexpr(8)


@triton.jit
def finish_tile(  # type: ignore[no-untyped-def]
    out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID: tl.constexpr
):
    # Split-K: the chunk's FP32 sum goes to partial[chunk, row, column]; the tile's last program to finish (a ticket
    # per tile in counter_ptr) adds the tile's chunk sums from zero in chunk order, the additions of the
    # single-program path, rounds them into out and resets the ticket to zero for the next launch. No second kernel.
    # It loads the sums CHUNKS_PER_LOAD chunks at a time (one L2 round trip for them, not one per chunk, on the
    # step's critical path); the loads past the last chunk give +0.0, which changes no bit of a sum that starts at
    # +0.0. Else the finished sum is rounded into out.
    mask = row_mask[:, None] & (n_offsets < N)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_out + n_offsets[None, :]
    if SPLIT_GRID:
        offsets = rows[:, None] * N + n_offsets[None, :]
        tl.store(partial_ptr + tl.program_id(2).to(tl.int64) * M * N + offsets, total, mask=mask)
        # Every thread's stores precede the ticket (taken by one thread with release semantics); the last program
        # reads the others' sums after its acquire, from L2 (.cg: L1 is not coherent across SMs).
        tl.debug_barrier()
        ticket = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        chunks = tl.num_programs(2)
        if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            total = tl.zeros_like(total)
            end = chunks * M * N  # the offsets of real chunks lie below it
            for first in range(0, chunks, CHUNKS_PER_LOAD):
                for j in tl.static_range(CHUNKS_PER_LOAD):
                    at = offsets + (first + j) * M * N
                    total += tl.load(partial_ptr + at, mask=mask & (at < end), other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, to_output_dtype(total, out_ptr), mask=mask)
            tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptrs, to_output_dtype(total, out_ptr), mask=mask)


# Tickets per device for split-K launches: enough for every tile of a split launch (at most 64 rows: a few row tiles,
# or the grouped GEMM's cdiv(M, 16) + min(E, M), times N / 32 column tiles).
_MAX_SPLIT_TILES = 1 << 16
_tile_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The per-tile tickets of ``finish_tile`` on ``device``: int32 zeros between launches (each tile's last program
    resets its own). One buffer per device and stream lane (``deepinfer_kernels.branch_streams.stream_lane``),
    created by the lane's first split launch: launches on one stream never overlap (CUDA graphs are captured and
    replayed in order), and the only streams that run beside it are the branch streams (docs/design/kernels.md,
    "Branch streams"), each a lane of its own.

    Raises:
        ValueError: a launch with more than 65,536 tiles.
        RuntimeError: the first split launch on a device is inside CUDA graph capture (its buffer would belong to
            the graph's memory pool).
    """
    if tiles > _MAX_SPLIT_TILES:
        raise ValueError(f"a split-K launch takes at most {_MAX_SPLIT_TILES} tiles, got {tiles}")
    lane = (device, stream_lane(device))
    counters = _tile_counters.get(lane)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the first split-K GEMM of a device's stream lane (the branch streams, or every other stream) ran "
                "inside CUDA graph capture; run one eagerly in the same mode before capturing"
            )
        counters = _tile_counters[lane] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


def launch_grid(
    row_tiles: int, n: int, k: int, cfg: BlockConfig, grouped: bool = False
) -> tuple[tuple[int, int, int], int]:
    """(grid, K chunk length) of a launch: row tiles × N tiles × (K chunks under split-K, else 1)."""
    chunk = chunk_length(n, k, cfg, grouped)
    return (row_tiles, triton.cdiv(n, cfg.block_n), triton.cdiv(k, chunk) if cfg.split_grid else 1), chunk


def split_buffers(
    m: int, n: int, cfg: BlockConfig, grid: tuple[int, int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP32 chunk sums [C, M, N], per-tile tickets) of a split-K launch over ``grid``; 1-element placeholders,
    never read, otherwise. The sums need no zeroing: a tile's last program reads only its own rows' sums."""
    if not cfg.split_grid:
        placeholder = torch.empty(1, dtype=torch.float32, device=device)
        return placeholder, placeholder
    partial = torch.empty((grid[2], m, n), dtype=torch.float32, device=device)
    return partial, split_counters(device, grid[0] * grid[1])
