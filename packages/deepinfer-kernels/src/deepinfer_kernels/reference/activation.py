"""Reference clamped SwiGLU of the MoE experts (docs/design/model.md, "Routed experts"), FP32."""

from __future__ import annotations

import torch

__all__ = ["swiglu_clamped"]


def swiglu_clamped(t: torch.Tensor, limit: float | None, row_weight: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = silu(min(g, λ)) · clamp(u, −λ, λ) [· w]`` with ``[g | u]`` the halves of each row, FP32:
    ``silu(g) = g / (1 + exp(−g))``, then the product with ``u``, then with the row's routing weight.

    Args:
        t: [n, 2I] bf16/fp32, gate half first.
        limit: ``swiglu_limit`` λ, or None for no clamping.
        row_weight: [n] fp32 routing weights, or None.
        out: [n, I] fp32, written.
    """
    half = t.shape[-1] // 2
    gate, up = t[..., :half].float(), t[..., half:].float()
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, -limit, limit)
    act = gate / (1.0 + torch.exp(-gate)) * up
    if row_weight is not None:
        act = act * row_weight[:, None]
    out.copy_(act)
