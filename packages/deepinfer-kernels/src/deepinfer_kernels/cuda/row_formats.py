"""Triton row encode/decode and the fused quantize+scatter store, bit-exact with ``reference.row_formats``.

``decode_tile`` is the device function the attention and indexer kernels use to read keys straight from a pool.
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
    exp2_int,
    scale_exponent,
    ue8m0_decode,
)
from deepinfer_kernels.cuda._launch import check_launchable

__all__ = ["FORMAT_CODES", "decode_rows", "decode_tile", "encode_rows", "round_bf16", "store_rows"]

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
):
    for r in tl.static_range(ROWS):
        i = tl.program_id(0) * ROWS + r
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
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    d = tl.arange(0, BLOCK_W)
    mask = (r[:, None] < num_rows) & (d[None, :] < WIDTH)
    values = decode_tile(rows_ptr, r[:, None] * row_bytes, d[None, :], mask, WIDTH, FMT)
    tl.store(out_ptr + r[:, None] * WIDTH + d[None, :], values, mask=mask)


def store_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> None:
    """Fused encode + scatter; see ``reference.row_formats.store_rows``."""
    check_launchable(pool=pool, rows=rows, values=values)
    width = values.shape[1]
    block_w = max(triton.next_power_of_2(width), 2 * fmt.group_size)
    grid = (triton.cdiv(rows.shape[0], _ROWS_PER_PROGRAM),)
    _store_kernel[grid](
        pool,
        rows,
        values,
        rows.shape[0],
        values.stride(0),
        pool.shape[1],
        WIDTH=width,
        BLOCK_W=block_w,
        GROUP=fmt.group_size,
        FMT=FORMAT_CODES[fmt],
        ROWS=_ROWS_PER_PROGRAM,
    )


def encode_rows(x: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> None:
    """Encode ``x`` [N, width] into ``out`` [N, bytes] (the store kernel writing rows 0 … N − 1)."""
    rows = torch.arange(x.shape[0], device=x.device)
    store_rows(out, rows, x, fmt)


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
    )
