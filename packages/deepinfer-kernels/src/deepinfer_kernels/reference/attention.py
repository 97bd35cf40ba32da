"""Reference sparse attention over key sources (docs/design/kernels.md, "sparse_attention").

Queries are processed in chunks sized so that no intermediate exceeds :data:`WORKSPACE_BYTES`: memory is
O(chunk × Σ N_i × (D + H)), never O(T × cached rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kernels.cache_layout import KeySource
from deepinfer_kernels.reference.row_formats import decode

__all__ = ["WORKSPACE_BYTES", "sparse_attention"]

WORKSPACE_BYTES = 256 << 20


def _gather_keys(sources: Sequence[KeySource], start: int, stop: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded keys [t, Σ N_i, D] fp32 and validity [t, Σ N_i] of queries ``start … stop − 1``."""
    keys, valid = [], []
    for source in sources:
        rows = source.rows[start:stop].long()
        if source.pool.shape[0]:
            keys.append(decode(source.pool[rows.clamp(min=0)], source.fmt, width))
        else:  # an empty pool (e.g. no fresh keys this step): every entry must be −1
            keys.append(torch.zeros((*rows.shape, width), device=rows.device))
        valid.append(rows >= 0)
    return torch.cat(keys, dim=1), torch.cat(valid, dim=1)


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    out: torch.Tensor,
) -> None:
    """One softmax per (query, head) over every valid key of every source plus the sink logit (zero value).

    FP32 logits and statistics; with ``round_probs_bf16`` the unnormalized probabilities are rounded to BF16 before
    the value product while the denominator keeps them in FP32. A query with no valid key gets zeros.

    Args:
        q: [T, H, D] bf16/fp32.
        sources: key sources, rows [T, N_i] each.
        sink: [H] fp32 sink logits.
        scale: softmax scale.
        round_probs_bf16: round the probabilities to BF16 before the value product.
        out: [T, H, D] fp32, written.
    """
    num_tokens, num_heads, width = q.shape
    num_keys = sum(source.rows.shape[1] for source in sources)
    if num_keys == 0:
        out.zero_()
        return
    per_token = 4 * (num_keys * (2 * width + 4 * num_heads) + num_heads * width)
    chunk = max(1, WORKSPACE_BYTES // max(per_token, 1))
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        keys, valid = _gather_keys(sources, start, stop, width)
        logits = torch.einsum("thd,tnd->thn", q[start:stop].float(), keys) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        peak = torch.maximum(logits.amax(dim=-1), sink[None, :])
        probs = torch.exp(logits - peak[..., None])
        denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - peak)
        weights = probs.to(torch.bfloat16).float() if round_probs_bf16 else probs
        out[start:stop] = torch.einsum("thn,tnd->thd", weights, keys) / denom[..., None]
