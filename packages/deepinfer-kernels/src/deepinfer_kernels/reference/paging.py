"""Reference paged-row lookup: the contract of ``deepinfer_kernels.paged_rows`` in torch ops."""

from __future__ import annotations

import torch

__all__ = ["paged_rows"]


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rows_per_block: int, out: torch.Tensor
) -> None:
    if block_table.numel() == 0:
        out.fill_(-1)
        return
    request = request.long().view(-1, *([1] * (rows.dim() - 1))).expand(rows.shape)
    rows = rows.long()
    pages = torch.div(rows.clamp(min=0), rows_per_block, rounding_mode="floor")
    valid = (rows >= 0) & (pages < block_table.shape[1]) & (request >= 0) & (request < block_table.shape[0])
    # Invalid entries read entry [0, 0] (any in-range one) and are replaced by −1.
    page = block_table[torch.where(valid, request, 0), torch.where(valid, pages, 0)].long()
    out.copy_(torch.where(valid, page * rows_per_block + torch.remainder(rows, rows_per_block), -1))
