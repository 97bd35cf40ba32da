"""Plain causal attention with log-sum-exp, the single-rank oracle for the context-parallel tests."""

from __future__ import annotations

import torch


def masked_attention(q, k, v, mask):
    """softmax attention of q [T, H, D] over k, v [S, H, D] where mask [T, S] is True; returns (out, lse [T, H])."""
    scores = torch.einsum("thd,shd->ths", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.einsum("ths,shd->thd", probs, v), lse


def causal_mask(q_request, q_position, k_request, k_position):
    """[T, S] True where key s is in query t's request at a position <= the query's."""
    same = q_request.unsqueeze(1) == k_request.unsqueeze(0)
    return same & (k_position.unsqueeze(0) <= q_position.unsqueeze(1)) & (q_request.unsqueeze(1) >= 0)


def packed_metadata(seq_lens):
    """Request index and position of every token of a packed batch: two [num_tokens] int64 tensors."""
    request = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(seq_lens)])
    position = torch.cat([torch.arange(n, dtype=torch.int64) for n in seq_lens])
    return request, position
