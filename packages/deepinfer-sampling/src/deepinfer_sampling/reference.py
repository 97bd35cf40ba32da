"""Plain-PyTorch reference of the processed distribution (docs/design/sampling.md, "Temperature, top-k and top-p") and
its inverse-CDF sample (docs/design/sampling.md, "Inverse-CDF sampling").

Given masked logits z of a row (`masking.preprocess_logits`), temperature T, top-k, top-p and min-p:

1. s = (z − max z) / T; greedy rows (T = 0) skip to step 5.
2. lse = log Σ exp(s): torch's logsumexp, or with `exact_sums` a 40-bit fixed-point int64 sum (order-free).
3. Rank tokens by descending z, ties by ascending id (stable sort). With p = exp(s − lse) and fᵢ = floor(pᵢ · 2^31),
   a token is kept iff rank < top_k, and the fixed-point mass of strictly better-ranked tokens <= floor(top_p · 2^31)
   (the smallest prefix whose mass exceeds top_p), and s >= log(min_p) (p >= min_p · p_max). All three are measured
   on the same temperature-scaled distribution and are prefixes of the same order, so the kept set is the shortest.
4. ℓ' = s − log Σ_kept exp(s) on kept tokens, −inf elsewhere.
5. Greedy rows: ℓ' is one-hot at the argmax of z (ties → lowest id); a batch of greedy rows only computes just that.
The sample is `inverse_cdf_sample(exp(ℓ'), bits)`.
"""

from __future__ import annotations

import math

import torch

from deepinfer_sampling.batch import SamplingBatch
from deepinfer_sampling.inverse_cdf import fixed_point_weights, inverse_cdf_sample

LSE_SCALE_BITS = 40


def fixed_point_logsumexp(shifted: torch.Tensor) -> torch.Tensor:
    """log Σ exp(s) for rows whose maximum is 0, summed in 40-bit fixed point (exact integer sum).

    Args:
        shifted: float32 [B, V], values <= 0 (−inf allowed), at least one 0 per row.

    Returns:
        float32 [B]. Terms below 2^-40 are dropped; the absolute error is below V · 2^-40.
    """
    fixed = torch.floor(torch.exp(shifted) * 2.0**LSE_SCALE_BITS).to(torch.int64).sum(dim=-1)
    return (torch.log(fixed.to(torch.float64)) - LSE_SCALE_BITS * math.log(2.0)).to(torch.float32)


def _logsumexp(shifted: torch.Tensor, exact_sums: bool) -> torch.Tensor:
    return fixed_point_logsumexp(shifted) if exact_sums else torch.logsumexp(shifted, dim=-1)


def truncation_mask(z: torch.Tensor, shifted: torch.Tensor, batch: SamplingBatch, exact_sums: bool) -> torch.Tensor:
    """Kept-token mask of step 3.

    Args:
        z: float32 [B, V], masked logits (ranking key).
        shifted: float32 [B, V], s = (z − max z) / T.
        batch: per-row top_k, top_p_threshold and log_min_p.
        exact_sums: fixed-point normaliser.

    Returns:
        bool [B, V].
    """
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices
    sorted_shifted = shifted.gather(1, order)
    lse = _logsumexp(shifted, exact_sums)
    mass = fixed_point_weights(torch.exp(sorted_shifted - lse[:, None]))
    mass_above = torch.cumsum(mass, dim=-1) - mass
    rank = torch.arange(z.shape[-1], device=z.device)
    keep_sorted = (rank[None, :] < batch.top_k[:, None]) & (mass_above <= batch.top_p_threshold[:, None])
    keep = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
    return keep & (shifted >= batch.log_min_p[:, None])


def processed_logprobs(z: torch.Tensor, batch: SamplingBatch, exact_sums: bool) -> torch.Tensor:
    """Processed log-probs ℓ' of every row (steps 1–5).

    Args:
        z: float32 [B, V], masked logits with at least one finite value per row.
        batch: the step's sampling batch.
        exact_sums: use fixed-point normalisers (batch-invariant).

    Returns:
        float32 [B, V]; −inf outside the kept set.
    """
    if batch.all_greedy:  # nothing but the one-hot rows of step 5 to compute
        return _argmax_one_hot(z)
    greedy = batch.temperature == 0.0
    top = z.amax(dim=-1, keepdim=True)
    temperature = torch.where(greedy, 1.0, batch.temperature)[:, None]
    shifted = (z - top) / temperature
    if batch.needs_truncation:
        shifted = torch.where(truncation_mask(z, shifted, batch, exact_sums), shifted, float("-inf"))
    logprobs = shifted - _logsumexp(shifted, exact_sums)[:, None]
    if not batch.any_greedy:
        return logprobs
    return torch.where(greedy[:, None], _argmax_one_hot(z), logprobs)


def _argmax_one_hot(z: torch.Tensor) -> torch.Tensor:
    """Log-probs of step 5: 0 at each row's argmax (ties → lowest id), −inf elsewhere."""
    return torch.full_like(z, float("-inf")).scatter_(1, z.argmax(dim=-1, keepdim=True), 0.0)


def sample(
    z: torch.Tensor, batch: SamplingBatch, bits: torch.Tensor, exact_sums: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed log-probs and the sampled token of every row.

    Args:
        z: float32 [B, V], masked logits.
        batch: the step's sampling batch.
        bits: int64 [B], 63-bit uniform integers (`RandomStream.SAMPLE`).
        exact_sums: use fixed-point normalisers.

    Returns:
        (token ids int64 [B], processed log-probs float32 [B, V]).
    """
    logprobs = processed_logprobs(z, batch, exact_sums)
    return inverse_cdf_sample(torch.exp(logprobs), bits), logprobs
