"""Public paged-row lookup (docs/design/kernels.md, "paged_rows"): validation and allocation, then the resolved backend
(one Triton launch on NVIDIA where PyTorch takes about eight)."""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["paged_rows"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rows_per_block: int
) -> torch.Tensor:
    """Flat pool rows of logical rows: ``block_table[request[i], r // rows_per_block] · rows_per_block +
    r mod rows_per_block`` for each ``r = rows[i, …]``, and −1 where ``r`` is negative or names a block or request
    outside the table.

    Args:
        block_table: [R, B] int32/int64, each request's pages.
        request: [N] int32/int64, the request of each row of ``rows``.
        rows: [N] or [N, K] int32/int64 logical rows (−1 for none).
        rows_per_block: rows per page, at least 1.

    Returns:
        int64 tensor of ``rows``' shape, contiguous.

    Raises:
        TypeError: a tensor is not a tensor or not an integer tensor.
        ValueError: shapes disagree, ``rows_per_block`` is below 1, or devices differ.
    """
    for name, tensor in (("block_table", block_table), ("request", request), ("rows", rows)):
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, _INDEX_DTYPES)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, B], got shape {tuple(block_table.shape)}")
    if rows.dim() not in (1, 2):
        raise ValueError(f"rows must be [N] or [N, K], got shape {tuple(rows.shape)}")
    if tuple(request.shape) != (rows.shape[0],):
        raise ValueError(f"request must have shape ({rows.shape[0]},) to match rows, got {tuple(request.shape)}")
    if not isinstance(rows_per_block, int) or rows_per_block < 1:
        raise ValueError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
    check_same_device(block_table=block_table, request=request, rows=rows)
    out = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    if out.numel():
        _registry.resolve("paged_rows", rows.device.type)(
            block_table.contiguous(), request.contiguous(), rows.contiguous(), rows_per_block, out
        )
    return out
