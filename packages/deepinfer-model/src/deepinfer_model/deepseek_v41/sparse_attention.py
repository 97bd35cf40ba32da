"""Sparse attention over key sources: one softmax per (query, head) over the rows each query names in a few cached
row pools, plus the per-head sink (docs/design/attention.md, "Sparse attention").

A layer's keys come from up to three sources: the SWA ring history, the step's own fresh window keys (encoded into
a scratch pool, so they read back exactly as the cache will hold them) and the selected compressed rows. K = V = the
decoded row. Queries are processed in chunks, so no intermediate grows with tokens × keys beyond a fixed workspace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from deepinfer_model.state.codecs import RowCodec

__all__ = ["KeySource", "sparse_attention"]

# Bytes of decoded keys (and logits) one query chunk may hold; bounds the step's attention workspace.
WORKSPACE_BYTES = 64 << 20


class KeySource(NamedTuple):
    """Rows of one pool that each query attends.

    Attributes:
        pool: [S, bytes_per_row] uint8 encoded rows.
        rows: [T, N] int64 flat row of each query's keys in ``pool``, −1 = no key.
        codec: the pool's row format.
    """

    pool: torch.Tensor
    rows: torch.Tensor
    codec: RowCodec


def sparse_attention(
    q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float, round_probs_bf16: bool
) -> torch.Tensor:
    """One softmax per (query, head) over every valid key of every source plus the sink logit (zero value).

    FP32 logits and statistics; with ``round_probs_bf16`` (exact mode) the unnormalized probabilities are rounded to
    BF16 before the value product, as FlashMLA does, while the denominator keeps them in FP32. Keys are summed in
    source order, then in row order.

    Args:
        q: [T, H, D] bf16/fp32 (RoPE applied).
        sources: key sources, each with ``rows`` of ``T`` queries.
        sink: [H] fp32 sink logits.
        scale: softmax scale ``D^−0.5``.
        round_probs_bf16: round the probabilities of the value product to BF16.

    Returns:
        [T, H, D] fp32; zero for a query without valid keys.
    """
    num_tokens, num_heads, width = q.shape
    num_keys = sum(source.rows.shape[1] for source in sources)
    out = torch.zeros((num_tokens, num_heads, width), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_keys == 0:
        return out
    per_query = 4 * num_keys * (width + 2 * num_heads)
    chunk = max(1, WORKSPACE_BYTES // per_query)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        keys = torch.cat([s.codec.decode(s.pool[s.rows[start:end].clamp(min=0)]) for s in sources], dim=1)
        valid = torch.cat([s.rows[start:end] >= 0 for s in sources], dim=1)
        out[start:end] = _attend(q[start:end].float(), keys, valid, sink, scale, round_probs_bf16)
    return out


def _attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float, round_probs: bool
) -> torch.Tensor:
    logits = torch.einsum("thd,tnd->thn", q, keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    peak = torch.maximum(logits.amax(dim=-1), sink[None, :])
    probs = torch.exp(logits - peak[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - peak)
    weights = probs.to(torch.bfloat16).float() if round_probs else probs
    return torch.einsum("thn,tnd->thd", weights, keys) / denom[..., None]
