"""Reference cache-row lookups: the contracts of ``deepinfer_kernels.paged_rows``, ``window_key_rows``,
``uniform_compressed_rows`` and ``position_sources`` in torch ops."""

from __future__ import annotations

import torch

__all__ = ["paged_rows", "position_sources", "uniform_compressed_rows", "window_key_rows"]


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


def window_key_rows(
    positions: torch.Tensor,
    token_request: torch.Tensor,
    q_start: torch.Tensor,
    cu_query_lens: torch.Tensor,
    state_slots: torch.Tensor,
    window_floor: torch.Tensor | None,
    ring: int,
    window: int,
    num_key_tokens: int,
    history: torch.Tensor,
    own: torch.Tensor,
) -> None:
    offsets = torch.arange(window, device=positions.device) - (window - 1)
    key_positions = positions[:, None] + offsets[None, :]
    request = token_request[:, None].expand_as(key_positions)
    seen = key_positions >= 0
    if window_floor is not None:
        seen &= key_positions >= window_floor[request]
    in_chunk = key_positions >= q_start[request]
    ring_rows = state_slots[request] * ring + torch.remainder(key_positions, ring)
    step_rows = (cu_query_lens[request] + key_positions - q_start[request]).clamp(0, max(num_key_tokens - 1, 0))
    history.copy_(torch.where(seen & ~in_chunk, ring_rows, -1))
    own.copy_(torch.where(seen & in_chunk, step_rows, -1))


def uniform_compressed_rows(
    q_start: torch.Tensor, context_lens: torch.Tensor, ratio: int, count: int, request: torch.Tensor, row: torch.Tensor
) -> None:
    first = torch.div(q_start, ratio, rounding_mode="floor")
    last = torch.div(context_lens - 1, ratio, rounding_mode="floor")
    rows = first[:, None] + torch.arange(count, device=first.device)[None, :]
    request.copy_(torch.arange(first.shape[0], device=first.device).repeat_interleave(count))
    row.copy_(torch.minimum(rows, last[:, None]).reshape(-1))


def position_sources(
    request: torch.Tensor,
    row: torch.Tensor,
    ratio: int,
    q_start: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    state_slots: torch.Tensor,
    ring: int,
    num_tokens: int,
    token: torch.Tensor,
    ring_row: torch.Tensor,
    in_chunk: torch.Tensor,
) -> None:
    offsets = torch.arange(ratio, device=row.device)
    positions = row[:, None] * ratio + offsets[None, :]
    req = request[:, None].expand_as(positions)
    positions = torch.minimum(positions, context_lens[req] - 1)
    start = q_start[req]
    in_chunk.copy_(positions >= start)
    token.copy_((cu_query_lens[req] + positions - start).clamp(0, max(num_tokens - 1, 0)))
    ring_row.copy_(state_slots[req] * ring + torch.remainder(positions, ring))
