"""Reference router selection (docs/design/model.md, "Router"): ``sqrt(softplus)`` scores, biased top-k with ties to
the lower expert index, normalized unbiased weights times the routed scaling factor. FP32."""

from __future__ import annotations

import torch

__all__ = ["WEIGHT_NORM_EPS", "router_topk"]

WEIGHT_NORM_EPS = 1e-20


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, ids: torch.Tensor, weights: torch.Tensor
) -> None:
    """Select ``top_k`` experts per token from FP32 router logits.

    ``s = sqrt(softplus(l))`` (``l`` itself above 20), experts ordered by ``s + bias`` descending with a stable sort
    (ties to the lower index), weights ``s_chosen / (Σ s_chosen + 1e−20) · scaling``.

    Args:
        logits: [n, E] fp32.
        bias: [E] fp32 selection bias.
        top_k: experts per token (1 … E).
        scaling: ``routed_scaling_factor``.
        ids: [n, top_k] int64, written.
        weights: [n, top_k] fp32, written.
    """
    scores = torch.sqrt(torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))))
    order = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = scores.gather(1, order)
    ids.copy_(order)
    weights.copy_(chosen / (chosen.sum(dim=-1, keepdim=True) + WEIGHT_NORM_EPS) * scaling)
