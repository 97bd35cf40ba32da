"""Clamped SwiGLU of the MoE experts (docs/design/model.md, "Routed experts"), FP32."""

from __future__ import annotations

import torch

__all__ = ["swiglu_clamped"]


def swiglu_clamped(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(min(g, λ)) · clamp(u, −λ, λ) [· w]`` with ``[g | u]`` the two halves of the last dimension.

    Args:
        t: [n, 2I] bf16/fp32, gate half first (rows from ``w1``), up half second (``w3``).
        limit: ``swiglu_limit`` λ, or None for no clamping.
        row_weight: optional [n] fp32 routing weight multiplied in before any quantization.

    Returns:
        [n, I] fp32.
    """
    half = t.shape[-1] // 2
    gate, up = t[..., :half].float(), t[..., half:].float()
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, -limit, limit)
    out = gate / (1.0 + torch.exp(-gate)) * up
    if row_weight is not None:
        out = out * row_weight[:, None]
    return out
