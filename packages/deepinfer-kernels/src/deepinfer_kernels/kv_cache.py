"""Cache stores: quantize rows into a row format and scatter them into a pool in one op (docs/design/kernels.md,
"store_rows")."""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import FLOAT_DTYPES, check_dtype, check_same_device, check_tensor
from deepinfer_kernels.cache_layout import RowFormat, bytes_per_row, check_width

__all__ = ["INDEX_DTYPES", "flat_pool", "store_rows"]

INDEX_DTYPES = (torch.int32, torch.int64)


def flat_pool(name: str, pool: torch.Tensor) -> torch.Tensor:
    """``pool`` ([S, bytes] or paged [num_blocks, rows_per_block, bytes] uint8) as a flat [S, bytes] view."""
    check_tensor(name, pool)
    check_dtype(name, pool.dtype, (torch.uint8,))
    if pool.dim() not in (2, 3):
        raise ValueError(f"{name} must be [S, bytes] or [num_blocks, rows_per_block, bytes], got {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (rows are addressed as a flat [S, bytes] view)")
    return pool.view(-1, pool.shape[-1])


def store_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, fmt: RowFormat) -> None:
    """Encode ``values`` in ``fmt`` and write row ``i`` into ``pool`` row ``rows[i]``; ``rows[i] < 0`` is skipped.

    Args:
        pool: [S, bytes] or [num_blocks, rows_per_block, bytes] uint8, contiguous; updated in place.
        rows: [N] int32/int64 flat row indices (−1 = skip; a repeated row must carry equal values).
        values: [N, width] bf16/fp16/fp32 with ``bytes == bytes_per_row(fmt, width)``.
    """
    flat = flat_pool("pool", pool)
    check_tensor("rows", rows)
    check_tensor("values", values)
    check_dtype("rows", rows.dtype, INDEX_DTYPES)
    check_dtype("values", values.dtype, FLOAT_DTYPES)
    if rows.dim() != 1 or values.dim() != 2 or values.shape[0] != rows.shape[0]:
        raise ValueError(f"need rows [N] and values [N, width], got {tuple(rows.shape)} and {tuple(values.shape)}")
    check_width(fmt, values.shape[1])
    expected = bytes_per_row(fmt, values.shape[1])
    if flat.shape[1] != expected:
        raise ValueError(
            f"pool rows have {flat.shape[1]} bytes but {fmt.name} rows of width {values.shape[1]} need {expected}"
        )
    check_same_device(pool=pool, rows=rows, values=values)
    if rows.shape[0]:
        _registry.resolve("store_rows", pool.device.type)(flat, rows.contiguous(), values.contiguous(), fmt)
