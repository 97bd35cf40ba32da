"""Cached-row formats and their byte sizes, and the key source that addresses rows of a pool; shared by the public
wrappers and every backend (no computation here).

A row holds one ``width``-element vector. Layouts (docs/design/kernels.md, "Row formats"):

| format       | use                                         | row bytes                              |
|--------------|---------------------------------------------|----------------------------------------|
| ``FP8``      | SWA rings; compressed rows in FP8 mode      | ``[e4m3 × w | UE8M0 × w/32]``          |
| ``FP4_E4M3`` | compressed rows (``use_fp4_sparse_kv``)     | ``[e2m1 pairs × w/2 | e4m3 × w/16]``   |
| ``FP4_UE8M0``| index-K rows, index queries                 | ``[e2m1 pairs × w/2 | UE8M0 × w/32]``  |
| ``RAW_FP32`` | compressor state; every cache in FP32 mode  | ``[fp32 × w]`` little-endian           |

FP4 pairs hold element ``2i`` in the low nibble and ``2i+1`` in the high nibble.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["KeySource", "RowFormat", "bytes_per_row", "check_width", "width_of"]


class RowFormat(enum.Enum):
    """Encoding of one cached row."""

    FP8 = "fp8_e4m3_ue8m0_32"
    FP4_E4M3 = "fp4_e2m1_e4m3_16"
    FP4_UE8M0 = "fp4_e2m1_ue8m0_32"
    RAW_FP32 = "raw_fp32"

    @property
    def group_size(self) -> int:
        """Elements per scale (1 for RAW_FP32, which has none)."""
        return {RowFormat.FP8: 32, RowFormat.FP4_E4M3: 16, RowFormat.FP4_UE8M0: 32, RowFormat.RAW_FP32: 1}[self]


def check_width(fmt: RowFormat, width: int) -> None:
    """Raise ValueError unless ``width`` is a positive multiple of ``fmt``'s scale group."""
    if not isinstance(fmt, RowFormat):
        raise TypeError(f"fmt must be a RowFormat ({[f.name for f in RowFormat]}), got {fmt!r}")
    if width <= 0 or width % fmt.group_size:
        raise ValueError(f"row width {width} is not a positive multiple of {fmt.name}'s group of {fmt.group_size}")


def bytes_per_row(fmt: RowFormat, width: int) -> int:
    """Bytes of one encoded ``width``-element row in ``fmt``."""
    check_width(fmt, width)
    if fmt is RowFormat.FP8:
        return width + width // 32
    if fmt is RowFormat.FP4_E4M3:
        return width // 2 + width // 16
    if fmt is RowFormat.FP4_UE8M0:
        return width // 2 + width // 32
    return 4 * width


def width_of(fmt: RowFormat, row_bytes: int) -> int:
    """The element count of a ``row_bytes``-byte row in ``fmt`` (inverse of :func:`bytes_per_row`)."""
    per_group = bytes_per_row(fmt, fmt.group_size)
    if row_bytes <= 0 or row_bytes % per_group:
        raise ValueError(f"{row_bytes} bytes is not a whole number of {fmt.name} groups ({per_group} bytes each)")
    return row_bytes // per_group * fmt.group_size


@dataclass(frozen=True)
class KeySource:
    """Keys of one kind for :func:`deepinfer_kernels.sparse_attention`: row ``rows[t, n]`` of ``pool`` is key ``n`` of
    query ``t`` (and its value: K = V = the decoded row).

    Attributes:
        pool: [S, bytes_per_row] uint8 flat pool (a paged pool viewed as ``[num_blocks · rows_per_block, bytes]``).
        rows: [T, N] int32/int64 flat row indices into ``pool``; −1 = no key.
        fmt: the pool's row format.
    """

    pool: torch.Tensor
    rows: torch.Tensor
    fmt: RowFormat
