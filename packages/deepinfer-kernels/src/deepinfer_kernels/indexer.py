"""Lightning-indexer top-k selection over the paged index-K cache, streaming (docs/design/kernels.md,
"indexer_select")."""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_shape, check_tensor
from deepinfer_kernels.cache_layout import RowFormat, width_of
from deepinfer_kernels.kv_cache import INDEX_DTYPES, flat_pool

__all__ = ["indexer_select"]


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
    candidates: torch.Tensor | None = None,
    candidate_block_size: int = 0,
    num_candidate_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``topk`` best index-K rows of every query and, on the candidate-source layer, its best candidate blocks.

    ``logit(t, b) = Σ_h weights[t, h] · relu(q[t, h] · k_b)`` (FP32, rounded to BF16 when ``round_logits_bf16``)
    over the visible rows ``b < num_rows[t]`` of the query's request; row ``b`` lives in flat pool row
    ``block_table[token_request[t], b // rows_per_block] · rows_per_block + b mod rows_per_block``.

    Selection: the largest valid logits, ties to the lower row, returned in ascending row order with −1 padding at
    the end. With ``candidates`` only the rows of those blocks are visible (block ``j`` = rows ``j·bs … j·bs + bs −
    1``) and only they are scored. With ``num_candidate_blocks > 0`` the best blocks are returned too: block score =
    max valid logit (capped at the largest finite BF16), the block holding row ``num_rows − 1`` always kept, empty
    blocks never chosen, ties to the lower block, ascending, −1 padded.

    Streaming: memory O(query chunk × (topk + row chunk)), never [T, all rows]. Shapes depend only on the host ints
    (``max_rows``, ``topk`` …), so a decode step can be captured in a CUDA graph.

    Args:
        q: [T, Hi, d] fp32 index queries (already rounded through the index-K format).
        weights: [T, Hi] fp32 head weights.
        key_pool: [S, bytes] or [num_blocks, rows_per_block, bytes] uint8 index-K pool in ``key_format`` (width d).
        key_format: the pool's row format.
        block_table: [R, max_blocks] int32/int64 pages of each request.
        rows_per_block: rows per page.
        token_request: [T] int32/int64 request of each query.
        num_rows: [T] int32/int64 visible rows of each query (``klen``), at most ``max_rows``.
        max_rows: host bound on ``num_rows`` (fixes the row loop; a CUDA graph needs it fixed).
        topk: rows selected per query.
        round_logits_bf16: round the logits to BF16 before ranking (exact mode).
        candidates: [T, nb] int32/int64 candidate blocks per query, ascending, −1 padded; None = unrestricted.
        candidate_block_size: rows per candidate block (needed with ``candidates`` or ``num_candidate_blocks``).
        num_candidate_blocks: blocks to return (the candidate-source layer, which is unrestricted); 0 = none.

    Returns:
        ``(rows [T, topk] int64, blocks [T, num_candidate_blocks] int64 or None)``.
    """
    for name, tensor in (("q", q), ("weights", weights), ("block_table", block_table)):
        check_tensor(name, tensor)
    check_tensor("token_request", token_request)
    check_tensor("num_rows", num_rows)
    check_dtype("q", q.dtype, (torch.float32,))
    check_dtype("weights", weights.dtype, (torch.float32,))
    for name, tensor in (("block_table", block_table), ("token_request", token_request), ("num_rows", num_rows)):
        check_dtype(name, tensor.dtype, INDEX_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hi, d], got {tuple(q.shape)}")
    num_tokens, num_heads, dim = q.shape
    check_shape("weights", weights, (num_tokens, num_heads))
    check_shape("token_request", token_request, (num_tokens,))
    check_shape("num_rows", num_rows, (num_tokens,))
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, max_blocks], got {tuple(block_table.shape)}")
    pool = flat_pool("key_pool", key_pool)
    if width_of(key_format, pool.shape[1]) != dim:
        raise ValueError(f"key_pool rows of {pool.shape[1]} bytes do not hold {key_format.name} rows of width {dim}")
    if rows_per_block <= 0 or max_rows < 0 or topk < 0 or num_candidate_blocks < 0:
        raise ValueError(
            f"need rows_per_block > 0 and max_rows, topk, num_candidate_blocks >= 0; got {rows_per_block}, "
            f"{max_rows}, {topk}, {num_candidate_blocks}"
        )
    restricted = candidates is not None
    if (restricted or num_candidate_blocks) and candidate_block_size <= 0:
        raise ValueError("candidate_block_size must be > 0 with candidates or num_candidate_blocks")
    if restricted and num_candidate_blocks:
        raise ValueError("the candidate-source layer (num_candidate_blocks > 0) is unrestricted; pass candidates=None")
    tensors = {"q": q, "weights": weights, "key_pool": pool, "block_table": block_table}
    tensors |= {"token_request": token_request, "num_rows": num_rows}
    if candidates is not None:
        check_tensor("candidates", candidates)
        check_dtype("candidates", candidates.dtype, INDEX_DTYPES)
        if candidates.dim() != 2 or candidates.shape[0] != num_tokens:
            raise ValueError(f"candidates must be [T={num_tokens}, nb], got {tuple(candidates.shape)}")
        tensors["candidates"] = candidates = candidates.contiguous()
    check_same_device(**tensors)
    out_rows = torch.empty((num_tokens, topk), dtype=torch.int64, device=q.device)
    out_blocks = (
        torch.empty((num_tokens, num_candidate_blocks), dtype=torch.int64, device=q.device)
        if num_candidate_blocks
        else None
    )
    if num_tokens:
        _registry.resolve("indexer_select", q.device.type)(
            q.contiguous(),
            weights.contiguous(),
            pool,
            key_format,
            block_table.contiguous(),
            rows_per_block,
            token_request.contiguous(),
            num_rows.contiguous(),
            max_rows,
            topk,
            bool(round_logits_bf16),
            candidates,
            candidate_block_size,
            num_candidate_blocks,
            out_rows,
            out_blocks,
        )
    return out_rows, out_blocks
