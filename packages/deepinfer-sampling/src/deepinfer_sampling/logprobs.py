"""What the sampler reports from the processed log-probabilities ℓ' (docs/design/sampling.md, "Logprobs").

Every reported value is clamped to >= `LOGPROB_FLOOR` (-9999), so tokens outside the kept set read -9999. Top-N
entries are sorted by value descending with ties broken by lowest token id, computed over the whole batch with the
batch's largest N; callers truncate each row to its own N.
"""

from __future__ import annotations

import torch

from deepinfer_sampling.masking import top_indices

LOGPROB_FLOOR = -9999.0
_MASS_SCALE = 2.0**52


def mass_sum(probs: torch.Tensor, exact: bool) -> torch.Tensor:
    """Row sums of probabilities in [0, 1].

    Args:
        probs: float32 [B, V].
        exact: sum in 52-bit fixed point with int64 (order-free, so batch-invariant; error <= V · 2^-52).

    Returns:
        float32 [B].
    """
    if not exact:
        return probs.sum(dim=-1)
    fixed = torch.floor(probs * _MASS_SCALE).to(torch.int64).sum(dim=-1)
    return (fixed.to(torch.float64) / _MASS_SCALE).to(torch.float32)


def top_logprobs(logprobs: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `num` largest processed log-probs per row.

    Args:
        logprobs: float32 [B, V], processed log-probs (-inf outside the kept set).
        num: 0 … V.

    Returns:
        (token ids int64 [B, num], values float32 [B, num] clamped to >= -9999).
    """
    if num == 0:
        empty = logprobs.new_empty((logprobs.shape[0], 0))
        return empty.to(torch.int64), empty
    ids = top_indices(logprobs, num)
    return ids, logprobs.gather(1, ids).clamp(min=LOGPROB_FLOOR)


def sum_smaller_probs(logprobs: torch.Tensor, token_ids: torch.Tensor, exact: bool) -> torch.Tensor:
    """Σ exp(ℓ'ⱼ) over tokens j with ℓ'ⱼ < ℓ'ₜ, or ℓ'ⱼ = ℓ'ₜ and j <= t, where t is the emitted token.

    Args:
        logprobs: float32 [B, V], processed log-probs.
        token_ids: int64 [B], emitted tokens (a -1 row yields 0).
        exact: use the batch-invariant fixed-point sum.

    Returns:
        float32 [B].
    """
    valid = token_ids >= 0
    chosen = logprobs.gather(1, token_ids.clamp(min=0)[:, None])
    column = torch.arange(logprobs.shape[-1], device=logprobs.device)
    smaller = (logprobs < chosen) | ((logprobs == chosen) & (column[None, :] <= token_ids[:, None]))
    total = mass_sum(torch.where(smaller, logprobs.exp(), 0.0), exact)
    return torch.where(valid, total, 0.0)
