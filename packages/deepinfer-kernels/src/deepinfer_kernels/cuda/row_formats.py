"""Triton row encode/decode and the fused quantize+scatter store, bit-exact with ``reference.row_formats``.

``decode_tile`` and ``decode_groups`` are the device functions that read rows straight from a pool:
``decode_tile`` loads and decodes element by element (any columns, any row alignment: ``decode_rows`` and the
``RAW_FP32`` format), ``decode_groups`` a scale group at a time with the hardware conversions (several times fewer
instructions: the attention and indexer kernels' keys; docs/design/kernels.md, "Row formats").
Formats are passed to kernels as the integer codes of :data:`FORMAT_CODES`.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cache_layout import RowFormat, bytes_per_row
from deepinfer_kernels.cuda._formats import (
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    e4m3_encode,
    e4m3_value,
    exp2_int,
    scale_exponent,
    ue8m0_decode,
)
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.gemm_operands import e2m1_halves, native_fp8

__all__ = ["FORMAT_CODES", "decode_groups", "decode_rows", "decode_tile", "encode_rows", "round_bf16", "store_rows"]

FORMAT_CODES = {RowFormat.FP8: 0, RowFormat.FP4_E4M3: 1, RowFormat.FP4_UE8M0: 2, RowFormat.RAW_FP32: 3}
_FMT_FP8: tl.constexpr = tl.constexpr(0)
_FMT_FP4_E4M3: tl.constexpr = tl.constexpr(1)
_FMT_FP4_UE8M0: tl.constexpr = tl.constexpr(2)
_FP8_AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-4)
_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)
_FP4_AMAX_FLOOR: tl.constexpr = tl.constexpr(6.0 * 2.0**-126)
_FP4_E4M3_AMAX_FLOOR: tl.constexpr = tl.constexpr(6.0 * 2.0**-9)
_E2M1_MAX: tl.constexpr = tl.constexpr(6.0)
_ROWS_PER_PROGRAM = 8
# Hardware FP8 conversion and PTX in decode_tile when compiled; Triton picks the interpreter at import too.
_NATIVE: tl.constexpr = tl.constexpr(native_fp8())


@triton.jit
def round_bf16(x):  # type: ignore[no-untyped-def]
    # FP32 → BF16 round-to-nearest-even in integer arithmetic (Triton's interpreter truncates in its own cast).
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def decode_tile(pool_ptr, base, d, mask, WIDTH: tl.constexpr, FMT: tl.constexpr):  # type: ignore[no-untyped-def]
    """FP32 values of elements ``d`` of the rows at byte offsets ``base`` (broadcast shapes); 0 where masked."""
    if FMT == _FMT_FP8:
        data = tl.load(pool_ptr + base + d, mask=mask, other=0)
        scale = tl.load(pool_ptr + base + WIDTH + d // 32, mask=mask, other=127)
        return e4m3_decode(data) * ue8m0_decode(scale)
    elif FMT == _FMT_FP4_E4M3:
        byte = tl.load(pool_ptr + base + d // 2, mask=mask, other=0).to(tl.int32)
        scale = tl.load(pool_ptr + base + WIDTH // 2 + d // 16, mask=mask, other=0)
        return e2m1_decode((byte >> ((d % 2) * 4)) & 15) * e4m3_decode(scale)
    elif FMT == _FMT_FP4_UE8M0:
        byte = tl.load(pool_ptr + base + d // 2, mask=mask, other=0).to(tl.int32)
        scale = tl.load(pool_ptr + base + WIDTH // 2 + d // 32, mask=mask, other=127)
        return e2m1_decode((byte >> ((d % 2) * 4)) & 15) * ue8m0_decode(scale)
    else:
        offset = base + 4 * d
        bits = tl.load(pool_ptr + offset, mask=mask, other=0).to(tl.int32)
        bits |= tl.load(pool_ptr + offset + 1, mask=mask, other=0).to(tl.int32) << 8
        bits |= tl.load(pool_ptr + offset + 2, mask=mask, other=0).to(tl.int32) << 16
        bits |= tl.load(pool_ptr + offset + 3, mask=mask, other=0).to(tl.int32) << 24
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp4_pairs(pool_ptr, base, valid, g, GROUP: tl.constexpr):  # type: ignore[no-untyped-def]
    """Elements of FP4 groups ``g`` [G] of the rows at ``base`` [N] (the caller masks groups past the width into
    ``valid`` [N, G]) as (even, odd) FP32 tensors [N, G, GROUP/2] of the e2m1 values times 2^−14: one vector load of
    each group's packed bytes, four bytes decoded at a time (``e2m1_halves``: PTX when compiled)."""
    j = tl.arange(0, GROUP // 2)
    raw = tl.load(pool_ptr + base[:, None, None] + (g * (GROUP // 2))[None, :, None] + j[None, None, :],
                  mask=valid[:, :, None], other=0)  # fmt: skip
    even, odd = e2m1_halves(raw, _NATIVE)
    return even.to(tl.float32), odd.to(tl.float32)


@triton.jit
def decode_groups(  # type: ignore[no-untyped-def]
    pool_ptr, base, valid, FIRST: tl.constexpr, COLS: tl.constexpr, WIDTH: tl.constexpr, FMT: tl.constexpr
):
    """FP32 [N, COLS]: elements ``FIRST … FIRST + COLS − 1`` of the rows at byte offsets ``base`` [N]; zero for rows
    not ``valid`` [N] and for elements at or past ``WIDTH``. ``FIRST`` is a multiple of ``COLS``, a power of two of
    at least the format's scale group.

    Each scale group is read as one vector of codes and one scale byte (not a load per element), and decoded with
    the hardware e4m3 conversion and ``e2m1_halves``'s PTX when compiled; every value is the exact product of code and
    scale either way, so the bits are those of ``reference.row_formats`` (NaN codes decode to NaN). The vector widths
    follow Triton's alignment analysis of ``base``: offsets from loaded row indices are safe; offsets built from a
    contiguous range can be credited with its first element's alignment (docs/design/kernels.md, "Row formats")."""
    if FMT == _FMT_FP8:
        g = FIRST // 32 + tl.arange(0, COLS // 32)
        mask = valid[:, None] & (g < WIDTH // 32)[None, :]
        j = tl.arange(0, 32)
        raw = tl.load(pool_ptr + base[:, None, None] + (g * 32)[None, :, None] + j[None, None, :],
                      mask=mask[:, :, None], other=0)  # fmt: skip
        scale = ue8m0_decode(tl.load(pool_ptr + base[:, None] + WIDTH + g[None, :], mask=mask, other=127))
        return tl.reshape(e4m3_value(raw, _NATIVE) * scale[:, :, None], (base.shape[0], COLS))
    elif FMT == _FMT_FP4_E4M3:
        g = FIRST // 16 + tl.arange(0, COLS // 16)
        mask = valid[:, None] & (g < WIDTH // 16)[None, :]
        even, odd = _fp4_pairs(pool_ptr, base, mask, g, 16)
        # The e4m3 scale times 2^14 undoes the pairs' 2^−14 (both products exact: at most 448 · 2^14).
        scale_code = tl.load(pool_ptr + base[:, None] + WIDTH // 2 + g[None, :], mask=mask, other=0)
        factor = (e4m3_value(scale_code, _NATIVE) * 16384.0)[:, :, None]
        return tl.reshape(tl.join(even * factor, odd * factor), (base.shape[0], COLS))
    elif FMT == _FMT_FP4_UE8M0:
        g = FIRST // 32 + tl.arange(0, COLS // 32)
        mask = valid[:, None] & (g < WIDTH // 32)[None, :]
        even, odd = _fp4_pairs(pool_ptr, base, mask, g, 32)
        # Two products (2^14, then the scale): one factor 2^(b − 127 + 14) would overflow for scale bytes above 240.
        scale = ue8m0_decode(tl.load(pool_ptr + base[:, None] + WIDTH // 2 + g[None, :], mask=mask, other=127))
        scale = scale[:, :, None]
        return tl.reshape(tl.join(even * 16384.0 * scale, odd * 16384.0 * scale), (base.shape[0], COLS))
    else:
        # RAW_FP32 has no scale groups: decode_tile's byte loads (a pool's rows need not be 4-byte aligned).
        d = FIRST + tl.arange(0, COLS)
        return decode_tile(pool_ptr, base[:, None], d[None, :], valid[:, None] & (d < WIDTH)[None, :], WIDTH, FMT)


@triton.jit
def _store_nibbles(ptr, codes, NUM: tl.constexpr, mask):  # type: ignore[no-untyped-def]
    even, odd = tl.split(tl.reshape(codes, (NUM // 2, 2)))
    tl.store(ptr + tl.arange(0, NUM // 2), (even | (odd << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _store_kernel(  # type: ignore[no-untyped-def]
    pool_ptr,
    rows_ptr,
    values_ptr,
    num_rows,
    stride_values,
    row_bytes,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    GROUP: tl.constexpr,
    FMT: tl.constexpr,
    ROWS: tl.constexpr,
    IDENTITY: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    for r in tl.static_range(ROWS):
        i = tl.program_id(0) * ROWS + r
        if IDENTITY:  # value i into pool row i: no row list to build and read (a launch saved per encode)
            row = tl.where(i < num_rows, i, -1).to(tl.int64)
        else:
            row = tl.load(rows_ptr + i, mask=i < num_rows, other=-1).to(tl.int64)
        if row >= 0:
            base = pool_ptr + row * row_bytes
            d = tl.arange(0, BLOCK_W)
            x = tl.load(values_ptr + i.to(tl.int64) * stride_values + d, mask=d < WIDTH, other=0.0).to(tl.float32)
            if FMT == 3:
                bits = x.to(tl.int32, bitcast=True)
                for k in tl.static_range(4):
                    tl.store(base + 4 * d + k, ((bits >> (8 * k)) & 255).to(tl.uint8), mask=d < WIDTH)
            else:
                groups = tl.reshape(x, (BLOCK_W // GROUP, GROUP))
                amax = tl.max(tl.abs(groups), axis=1)
                g = tl.arange(0, BLOCK_W // GROUP)
                half = tl.arange(0, BLOCK_W // 2) < WIDTH // 2
                if FMT == _FMT_FP8:
                    exponent = scale_exponent(amax, _FP8_AMAX_FLOOR, _E4M3_MAX)
                    codes = tl.reshape(e4m3_encode(groups * exp2_int(-exponent)[:, None]), (BLOCK_W,))
                    tl.store(base + d, codes, mask=d < WIDTH)
                    tl.store(base + WIDTH + g, (exponent + 127).to(tl.uint8), mask=g < WIDTH // GROUP)
                elif FMT == _FMT_FP4_UE8M0:
                    exponent = scale_exponent(amax, _FP4_AMAX_FLOOR, _E2M1_MAX)
                    codes = tl.reshape(e2m1_encode(groups * exp2_int(-exponent)[:, None]), (BLOCK_W,))
                    _store_nibbles(base, codes, BLOCK_W, half)
                    tl.store(base + WIDTH // 2 + g, (exponent + 127).to(tl.uint8), mask=g < WIDTH // GROUP)
                else:
                    scale = tl.minimum(tl.div_rn(tl.maximum(amax, _FP4_E4M3_AMAX_FLOOR), _E2M1_MAX), _E4M3_MAX)
                    scale_code = e4m3_encode(scale)
                    inverse = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), e4m3_decode(scale_code))
                    scaled = tl.minimum(tl.maximum(groups * inverse[:, None], -6.0), 6.0)
                    _store_nibbles(base, tl.reshape(e2m1_encode(scaled), (BLOCK_W,)), BLOCK_W, half)
                    tl.store(base + WIDTH // 2 + g, scale_code, mask=g < WIDTH // GROUP)


@triton.jit
def _decode_kernel(  # type: ignore[no-untyped-def]
    rows_ptr,
    out_ptr,
    num_rows,
    row_bytes,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FMT: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    d = tl.arange(0, BLOCK_W)
    mask = (r[:, None] < num_rows) & (d[None, :] < WIDTH)
    values = decode_tile(rows_ptr, r[:, None] * row_bytes, d[None, :], mask, WIDTH, FMT)
    tl.store(out_ptr + r[:, None] * WIDTH + d[None, :], values, mask=mask)


def store_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> None:
    """Fused encode + scatter; see ``reference.row_formats.store_rows``."""
    check_launchable(pool=pool, rows=rows, values=values)
    _store(pool, rows, values, fmt)


def encode_rows(x: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> None:
    """Encode ``x`` [N, width] into ``out`` [N, bytes] (the store kernel writing rows 0 … N − 1)."""
    check_launchable(x=x, out=out)
    _store(out, None, x, fmt)


def _store(pool: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor, fmt: RowFormat) -> None:
    """The store kernel: ``values`` into the ``pool`` rows listed in ``rows`` (None: value i into row i)."""
    width = values.shape[1]
    block_w = max(triton.next_power_of_2(width), 2 * fmt.group_size)
    num_rows = values.shape[0] if rows is None else rows.shape[0]
    _store_kernel[(triton.cdiv(num_rows, _ROWS_PER_PROGRAM),)](
        pool,
        rows,
        values,
        num_rows,
        values.stride(0),
        pool.shape[1],
        WIDTH=width,
        BLOCK_W=block_w,
        GROUP=fmt.group_size,
        FMT=FORMAT_CODES[fmt],
        ROWS=_ROWS_PER_PROGRAM,
        IDENTITY=rows is None,
        **dependent_launch(pool.device),
    )


def decode_rows(rows: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> None:
    """Decode ``rows`` [N, bytes] into ``out`` [N, width] fp32."""
    check_launchable(rows=rows, out=out)
    width = out.shape[1]
    assert rows.shape[1] == bytes_per_row(fmt, width)
    grid = (triton.cdiv(rows.shape[0], _ROWS_PER_PROGRAM),)
    _decode_kernel[grid](
        rows,
        out,
        rows.shape[0],
        rows.shape[1],
        WIDTH=width,
        BLOCK_W=triton.next_power_of_2(width),
        FMT=FORMAT_CODES[fmt],
        ROWS=_ROWS_PER_PROGRAM,
        **dependent_launch(rows.device),
    )
