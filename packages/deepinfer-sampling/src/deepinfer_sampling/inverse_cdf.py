"""Inverse-CDF sampling in 31-bit fixed point (docs/design/sampling.md, "Inverse-CDF sampling"), shared by the sampler
and the verifier.

Each weight wᵢ ∈ [0, 1] becomes fᵢ = floor(wᵢ · 2^31) (exact for float32), the CDF is the int64 cumulative sum in
increasing column order (exact, so independent of reduction order and identical on every backend), and the sampled
column is the unique i with C_{i-1} <= r < C_i for r = min(floor(u · F), F − 1), F = Σ fᵢ, where u = (bits >> 10) ·
2^-53 is a 53-bit uniform in [0, 1) from the 63-bit draw `bits` (`seeds.random_bits`) and the product is one
correctly rounded float64 multiply (so every backend gets the same r). Scaling u by F (rather than taking bits mod F,
as the reference release does) keeps r continuous in F: if two backends' weights differ by float rounding, r moves
by at most the change of F and the sampled token only changes when r sits right at a CDF boundary. Each r value
carries probability 2^-53 ± rounding, far below the 2^-31 resolution of the weights. Columns with fᵢ = 0 (weight
below 2^-31) are never sampled. Weights need not be normalised, so the verifier can pass a residual distribution.
"""

from __future__ import annotations

import torch

FIXED_POINT_SCALE = 2.0**31
UNIFORM_SHIFT = 10  # 63-bit draws → 53-bit float64 mantissas


def scaled_draw(bits: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """r = min(floor(u · total), total − 1) with u = (bits >> 10) · 2^-53.

    Args:
        bits: int64 [B], uniform in [0, 2^63).
        total: int64 [B], fixed-point masses (>= 1).

    Returns:
        int64 [B] in [0, total).
    """
    uniform = (bits >> UNIFORM_SHIFT).to(torch.float64) * 2.0**-53
    return torch.minimum(torch.floor(uniform * total.to(torch.float64)).to(torch.int64), total - 1)


def fixed_point_weights(weights: torch.Tensor) -> torch.Tensor:
    """floor(w · 2^31) of weights clamped to [0, 1].

    Args:
        weights: float32 [B, V].

    Returns:
        int64 [B, V].
    """
    return torch.floor(weights.clamp(0.0, 1.0) * FIXED_POINT_SCALE).to(torch.int64)


def inverse_cdf_sample(weights: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Samples one column per row with probability proportional to the fixed-point weights.

    Args:
        weights: float32 [B, V], values in [0, 1] (larger values are clamped), not necessarily normalised.
        bits: int64 [B], uniform in [0, 2^63).

    Returns:
        int64 [B]; -1 for rows whose fixed-point mass is 0.
    """
    cdf = torch.cumsum(fixed_point_weights(weights), dim=-1)
    total = cdf[:, -1]
    r = scaled_draw(bits, total.clamp(min=1))
    column = torch.searchsorted(cdf, r[:, None], right=True)[:, 0]
    return torch.where(total > 0, column, -1)
