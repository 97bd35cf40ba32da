"""Public encoders and decoders of cached rows (docs/design/kernels.md, "Row formats").

Layouts (each row ``[data | scales]``, little-endian, FP4 element ``2i`` in the low nibble of byte ``i``):

| format        | use                                        | row bytes for width ``w``            |
|---------------|--------------------------------------------|--------------------------------------|
| ``FP8``       | SWA rings; compressed rows in FP8 mode     | ``[e4m3 × w | UE8M0 × w/32]``        |
| ``FP4_E4M3``  | compressed rows (``use_fp4_sparse_kv``)    | ``[e2m1 pairs × w/2 | e4m3 × w/16]`` |
| ``FP4_UE8M0`` | index-K rows, index queries                | ``[e2m1 pairs × w/2 | UE8M0 × w/32]``|
| ``RAW_FP32``  | compressor state; every cache in FP32 mode | ``[fp32 × w]``                       |

Recipes: UE8M0 scale ``2^⌈log2(max(amax, m) / qmax)⌉`` (FP8: qmax 448, m 1e−4; FP4: qmax 6, m 6·2^−126), codes the
round-to-nearest-even of ``x · 2^−e``; e4m3 scale ``e4m3(min(max(amax, 6·2^−9) / 6, 448))``, codes the e2m1 rounding
of ``x · fp32(1 / scale)``. Decoding gives ``code × scale`` in FP32 (exactly representable in BF16).
"""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import FLOAT_DTYPES, check_dtype, check_ndim_at_least, check_tensor
from deepinfer_kernels.cache_layout import RowFormat, bytes_per_row, check_width, width_of

__all__ = ["RowFormat", "bytes_per_row", "decode_rows", "encode_rows", "width_of"]


def encode_rows(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """Encode vectors into rows of ``fmt``.

    Args:
        x: [..., width] bf16/fp16/fp32; ``width`` a multiple of the format's scale group (32, or 16 for FP4_E4M3).
        fmt: the row format.

    Returns:
        [..., bytes_per_row(fmt, width)] uint8.
    """
    check_tensor("x", x)
    check_dtype("x", x.dtype, FLOAT_DTYPES)
    check_ndim_at_least("x", x, 1)
    width = x.shape[-1]
    check_width(fmt, width)
    flat = x.reshape(-1, width)
    out = torch.empty((flat.shape[0], bytes_per_row(fmt, width)), dtype=torch.uint8, device=x.device)
    if flat.shape[0]:
        _registry.resolve("encode_rows", x.device.type)(flat.contiguous(), fmt, out)
    return out.view(*x.shape[:-1], out.shape[-1])


def decode_rows(rows: torch.Tensor, fmt: RowFormat, width: int | None = None) -> torch.Tensor:
    """Decode rows of ``fmt`` into FP32 vectors.

    Args:
        rows: [..., bytes] uint8.
        fmt: the row format.
        width: elements per row; derived from the byte count when None (it must agree when given).

    Returns:
        [..., width] fp32, the exact dequantized values.
    """
    check_tensor("rows", rows)
    check_dtype("rows", rows.dtype, (torch.uint8,))
    check_ndim_at_least("rows", rows, 1)
    derived = width_of(fmt, rows.shape[-1])
    if width is not None and width != derived:
        raise ValueError(f"rows of {rows.shape[-1]} bytes hold {derived} {fmt.name} elements, not width={width}")
    flat = rows.reshape(-1, rows.shape[-1])
    out = torch.empty((flat.shape[0], derived), dtype=torch.float32, device=rows.device)
    if flat.shape[0]:
        _registry.resolve("decode_rows", rows.device.type)(flat.contiguous(), fmt, out)
    return out.view(*rows.shape[:-1], derived)
