"""Row codecs of the cache groups: thin adapters over the row formats of ``deepinfer_kernels`` (byte layouts in
``deepinfer_kernels.row_formats`` and docs/design/cache.md, "Row formats"). Every cache pool is a uint8 tensor
``[..., bytes_per_row]``; a codec encodes FP32 vectors into rows and decodes rows back to the exact dequantized values
attention reads.

| codec               | format        | use (exact mode)                           |
|---------------------|---------------|--------------------------------------------|
| ``Fp8RowCodec``     | ``FP8``       | SWA rings; compressed rows (FP8 mode)      |
| ``Fp4E4m3RowCodec`` | ``FP4_E4M3``  | compressed rows (``use_fp4_sparse_kv``)    |
| ``Fp4Ue8m0RowCodec``| ``FP4_UE8M0`` | index-K rows                               |
| ``RawFp32RowCodec`` | ``RAW_FP32``  | compressor state; every cache in FP32 mode |
"""

from __future__ import annotations

from typing import ClassVar

import torch

from deepinfer_kernels import RowFormat, bytes_per_row, decode_rows, encode_rows

__all__ = ["Fp4E4m3RowCodec", "Fp4Ue8m0RowCodec", "Fp8RowCodec", "RawFp32RowCodec", "RowCodec"]


class RowCodec:
    """Encodes ``[..., width]`` vectors into ``[..., bytes_per_row]`` uint8 rows of :attr:`row_format` and back."""

    row_format: ClassVar[RowFormat]

    def __init__(self, width: int) -> None:
        self.width = width
        self.bytes_per_row = bytes_per_row(self.row_format, width)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [..., width] bf16/fp32. Returns: [..., bytes_per_row] uint8."""
        return encode_rows(x, self.row_format)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Args: rows [..., bytes_per_row] uint8. Returns: [..., width] fp32 dequantized values."""
        return decode_rows(rows, self.row_format, self.width)


class RawFp32RowCodec(RowCodec):
    """Unquantized FP32 rows."""

    row_format = RowFormat.RAW_FP32


class Fp8RowCodec(RowCodec):
    """e4m3 with one UE8M0 scale per 32 elements."""

    row_format = RowFormat.FP8


class Fp4Ue8m0RowCodec(RowCodec):
    """e2m1 with one UE8M0 scale per 32 elements (index K, index q)."""

    row_format = RowFormat.FP4_UE8M0


class Fp4E4m3RowCodec(RowCodec):
    """e2m1 with one e4m3 scale per 16 elements (compressed KV, ``use_fp4_sparse_kv``)."""

    row_format = RowFormat.FP4_E4M3
