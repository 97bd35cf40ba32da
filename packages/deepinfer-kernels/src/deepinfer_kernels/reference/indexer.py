"""Reference lightning-indexer selection over a paged index-K pool, streaming (docs/design/kernels.md,
"indexer_select").

Rows are scored in chunks of ``row_chunk`` and merged into a running top-k (and a running top of candidate blocks);
queries are processed in chunks. Peak memory is O(query_chunk × (topk + row_chunk) × (d + H)), never [T, all rows].
Every chunk has the same shape, so a decode step runs a fixed sequence of kernels (no host sync, no data-dependent
shape).
"""

from __future__ import annotations

import torch

from deepinfer_kernels.cache_layout import RowFormat
from deepinfer_kernels.reference.row_formats import decode

__all__ = ["indexer_select", "sorted_selection"]

_WORKSPACE_BYTES = 256 << 20
_ROW_CHUNK = 4096
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_FP32_MAX = float(torch.finfo(torch.float32).max)


def _merge_top(
    best_score: torch.Tensor, best_id: torch.Tensor, score: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of the running top and a new chunk; ties go to the lower id.

    Every valid id of the chunk is larger than every id in the running top and the chunk's ids ascend, so a stable
    descending sort of ``[running | chunk]`` puts equal scores in ascending id order. Invalid entries score −inf and
    have id −1.
    """
    scores = torch.cat((best_score, score), dim=1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return scores.gather(1, order), torch.cat((best_id, ids), dim=1).gather(1, order)


def sorted_selection(ids: torch.Tensor) -> torch.Tensor:
    """Selected ids [T, k] (−1 = none) in ascending order with the −1 entries at the end."""
    big = torch.iinfo(ids.dtype).max
    ordered = torch.sort(torch.where(ids >= 0, ids, big), dim=1).values
    return torch.where(ordered == big, -1, ordered)


def _chunk_rows(
    start: int,
    size: int,
    num_rows: torch.Tensor,
    candidates: torch.Tensor | None,
    candidate_block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices [t, size] and validity of one chunk: rows ``start …`` (unrestricted), or slots ``start …`` of the
    candidate blocks' rows (slot ``v`` is row ``v mod bs`` of candidate block ``v // bs``)."""
    slots = torch.arange(start, start + size, device=num_rows.device)
    if candidates is None:
        rows = slots[None, :].expand(num_rows.shape[0], -1)
        return rows, rows < num_rows[:, None]
    block = candidates.long().gather(1, (slots // candidate_block_size)[None, :].expand(num_rows.shape[0], -1))
    rows = block * candidate_block_size + slots % candidate_block_size
    return rows, (block >= 0) & (rows < num_rows[:, None])


def _chunk_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_format: RowFormat,
    slot_base: torch.Tensor,
    rows_per_block: int,
    rows: torch.Tensor,
    round_logits_bf16: bool,
) -> torch.Tensor:
    """``Σ_h w[t,h] · relu(q[t,h] · k_row)`` [t, n] fp32 (BF16-rounded when asked) for the given rows."""
    safe = rows.clamp(min=0)
    page = slot_base.gather(1, (safe // rows_per_block).clamp(max=slot_base.shape[1] - 1))
    flat = (page * rows_per_block + safe % rows_per_block).clamp(0, key_pool.shape[0] - 1)
    keys = decode(key_pool[flat], key_format, q.shape[-1])
    scores = torch.relu(torch.einsum("thd,tnd->thn", q, keys))
    logits = torch.einsum("th,thn->tn", weights, scores)
    return logits.to(torch.bfloat16).float() if round_logits_bf16 else logits


def indexer_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_format: RowFormat,
    block_table: torch.Tensor,
    rows_per_block: int,
    token_request: torch.Tensor,
    num_rows: torch.Tensor,
    max_rows: int,
    topk: int,
    round_logits_bf16: bool,
    candidates: torch.Tensor | None,
    candidate_block_size: int,
    num_candidate_blocks: int,
    out_rows: torch.Tensor,
    out_blocks: torch.Tensor | None,
) -> None:
    """Top-``topk`` rows by index logit per query, and (``num_candidate_blocks > 0``) its best candidate blocks.

    Args: as :func:`deepinfer_kernels.indexer_select`; ``key_pool`` is flat [S, bytes]; ``out_rows`` [T, topk] and
    ``out_blocks`` [T, num_candidate_blocks] int64 are written.
    """
    num_tokens, num_heads, dim = q.shape
    bs = max(candidate_block_size, 1)
    span = -(-max_rows // bs) * bs if candidates is None else candidates.shape[1] * bs
    row_chunk = max(bs, _ROW_CHUNK // bs * bs)
    per_token = 4 * row_chunk * (2 * dim + 2 * num_heads) + key_pool.shape[1] * row_chunk
    query_chunk = max(1, _WORKSPACE_BYTES // per_token)
    for q_start in range(0, num_tokens, query_chunk):
        q_stop = min(q_start + query_chunk, num_tokens)
        count = q_stop - q_start
        klen = num_rows[q_start:q_stop].long()
        slot_base = block_table.long()[token_request[q_start:q_stop].long()]
        cand = None if candidates is None else candidates[q_start:q_stop]
        best_score = torch.full((count, topk), float("-inf"), device=q.device)
        best_row = torch.full((count, topk), -1, dtype=torch.int64, device=q.device)
        block_score = torch.full((count, num_candidate_blocks), float("-inf"), device=q.device)
        block_id = torch.full((count, num_candidate_blocks), -1, dtype=torch.int64, device=q.device)
        last_block = torch.div(klen - 1, bs, rounding_mode="floor")
        for start in range(0, span, row_chunk):
            rows, valid = _chunk_rows(start, min(row_chunk, span - start), klen, cand, bs)
            logits = _chunk_logits(
                q[q_start:q_stop].float(),
                weights[q_start:q_stop].float(),
                key_pool,
                key_format,
                slot_base,
                rows_per_block,
                rows,
                round_logits_bf16,
            )
            ranked = torch.where(valid, logits.clamp(min=-_FP32_MAX), float("-inf"))
            best_score, best_row = _merge_top(best_score, best_row, ranked, torch.where(valid, rows, -1), topk)
            if num_candidate_blocks:
                per_block = torch.where(valid, logits.clamp(max=_BF16_MAX), float("-inf"))
                score = per_block.view(count, -1, bs).amax(dim=-1)
                ids = start // bs + torch.arange(score.shape[1], device=q.device)[None, :].expand(count, -1)
                # The block holding the newest visible row is always kept.
                score = torch.where((ids == last_block[:, None]) & (klen[:, None] > 0), float("inf"), score)
                ids = torch.where(score > float("-inf"), ids, -1)
                block_score, block_id = _merge_top(block_score, block_id, score, ids, num_candidate_blocks)
        out_rows[q_start:q_stop] = sorted_selection(best_row)
        if out_blocks is not None:
            out_blocks[q_start:q_stop] = sorted_selection(block_id)
