"""Reference encoders and decoders of cached rows, and the row store (docs/design/kernels.md, "Row formats").

Encode and decode are graph-safe: no host syncs, no host-built tables, no data-dependent shapes.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.cache_layout import RowFormat
from deepinfer_kernels.reference.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FP4_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    e2m1_decode,
    e2m1_encode,
    exp2_int,
    scale_exponent,
    ue8m0_bytes_to_float,
)

__all__ = ["decode", "decode_rows", "encode", "encode_rows", "store_rows"]

# FP4 with e4m3 scales: the scale is e4m3(min(max(amax, 6·2^−9) / 6, 448)), so the smallest scale is the smallest
# e4m3 subnormal 2^−9 and never zero.
_FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def encode(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Encode ``x`` [..., width] (any float dtype) into rows [..., bytes] uint8 (a new tensor)."""
    lead, width = x.shape[:-1], x.shape[-1]
    if fmt is RowFormat.RAW_FP32:
        return x.float().contiguous().view(torch.uint8)
    groups = x.float().reshape(*lead, width // fmt.group_size, fmt.group_size)
    amax = groups.abs().amax(dim=-1)
    if fmt is RowFormat.FP4_E4M3:
        scale = (torch.clamp(amax, min=_FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scaled = torch.clamp(groups * (1.0 / scale.float())[..., None], -E2M1_MAX, E2M1_MAX)
        data = _pack_nibbles(e2m1_encode(scaled).reshape(*lead, width))
        return torch.cat((data, scale.view(torch.uint8)), dim=-1)
    floor, max_value = (FP8_AMAX_FLOOR, E4M3_MAX) if fmt is RowFormat.FP8 else (FP4_AMAX_FLOOR, E2M1_MAX)
    exponent = scale_exponent(amax, floor, max_value)
    scaled = groups * exp2_int(-exponent)[..., None]
    if fmt is RowFormat.FP8:
        data = scaled.reshape(*lead, width).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        data = _pack_nibbles(e2m1_encode(scaled).reshape(*lead, width))
    return torch.cat((data, (exponent + 127).to(torch.uint8)), dim=-1)


def decode(rows: torch.Tensor, fmt: RowFormat, width: int) -> torch.Tensor:
    """Decode rows [..., bytes] uint8 into [..., width] fp32 (a new tensor)."""
    lead = rows.shape[:-1]
    if fmt is RowFormat.RAW_FP32:
        return rows.contiguous().view(torch.float32)
    data_bytes = width if fmt is RowFormat.FP8 else width // 2
    data, scale_bytes = rows[..., :data_bytes], rows[..., data_bytes:]
    if fmt is RowFormat.FP8:
        values = data.contiguous().view(torch.float8_e4m3fn).float()
    else:
        values = e2m1_decode(_unpack_nibbles(data))
    if fmt is RowFormat.FP4_E4M3:
        factor = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        factor = ue8m0_bytes_to_float(scale_bytes)
    grouped = values.reshape(*lead, width // fmt.group_size, fmt.group_size) * factor[..., None]
    return grouped.reshape(*lead, width)


def encode_rows(x: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> None:
    """Registry form of :func:`encode`: ``out`` [N, bytes] uint8 is written."""
    out.copy_(encode(x, fmt))


def decode_rows(rows: torch.Tensor, fmt: RowFormat, out: torch.Tensor) -> None:
    """Registry form of :func:`decode`: ``out`` [N, width] fp32 is written."""
    out.copy_(decode(rows, fmt, out.shape[-1]))


def store_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> None:
    """``pool[rows[i]] = encode(values[i])`` for every ``rows[i] >= 0`` (negative rows are skipped).

    Args:
        pool: [S, bytes] uint8, updated in place.
        rows: [N] int64 distinct flat row indices, −1 = skip.
        values: [N, width] bf16/fp16/fp32.
    """
    # Boolean selection is a host sync in eager CUDA code; the nvidia backend's fused store has none.
    keep = rows >= 0
    pool[rows[keep]] = encode(values[keep], fmt)
