"""Triton paged-row lookup (docs/design/kernels.md, "paged_rows"): one launch for the division, the table gather, the
product, the remainder and the −1 of missing rows, which PyTorch runs as about eight kernels."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import check_launchable

__all__ = ["paged_rows"]

_BLOCK = 1024


@triton.jit
def _paged_rows_kernel(  # type: ignore[no-untyped-def]
    table_ptr, request_ptr, rows_ptr, out_ptr, total, per_request, table_rows, table_cols, rows_per_block,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    row = tl.load(rows_ptr + i, mask=live, other=-1).to(tl.int64)
    request = tl.load(request_ptr + i // per_request, mask=live, other=-1).to(tl.int64)
    page_index = tl.maximum(row, 0) // rows_per_block
    valid = (row >= 0) & (page_index < table_cols) & (request >= 0) & (request < table_rows)
    page = tl.load(table_ptr + request * table_cols + page_index, mask=live & valid, other=0).to(tl.int64)
    tl.store(out_ptr + i, tl.where(valid, page * rows_per_block + row % rows_per_block, -1), mask=live)


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rows_per_block: int, out: torch.Tensor
) -> None:
    """Triton ``deepinfer_kernels.paged_rows`` (contiguous tensors, shapes there)."""
    check_launchable(block_table=block_table, request=request, rows=rows, out=out)
    total = rows.numel()
    per_request = total // max(rows.shape[0], 1)
    _paged_rows_kernel[(triton.cdiv(total, _BLOCK),)](
        block_table, request, rows, out, total, per_request, block_table.shape[0], block_table.shape[1],
        rows_per_block, BLOCK=_BLOCK,
    )  # fmt: skip
