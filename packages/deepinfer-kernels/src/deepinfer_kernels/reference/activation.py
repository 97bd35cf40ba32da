"""Reference clamped SwiGLU of the MoE experts (docs/design/model.md, "Routed experts"), FP32; and its FP8 copy
(docs/design/numerics.md, "Rounding points": SwiGLU × weight FP32 → FP8)."""

from __future__ import annotations

import torch

from deepinfer_kernels.reference import quant

__all__ = ["swiglu_clamped", "swiglu_clamped_fp8"]


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


def swiglu_clamped_fp8(
    t: torch.Tensor,
    limit: float | None,
    row_weight: torch.Tensor | None,
    q: torch.Tensor,
    scale: torch.Tensor,
    deinterleave: bool = False,
) -> None:
    """:func:`swiglu_clamped`, its FP32 result quantized per token and 32 columns
    (``quant.quantize_fp8_per_token_group``).

    Args:
        t, limit, row_weight: as in :func:`swiglu_clamped`; ``I % 32 == 0``.
        q: [n, I] float8_e4m3fn; written.
        scale: [n, I/32] float8_e8m0fnu; written.
        deinterleave: each group's codes stored even columns first, then odd ones.
    """
    act = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    swiglu_clamped(t, limit, row_weight, act)
    if not deinterleave:
        quant.quantize_fp8_per_token_group(act, q, scale)
        return
    codes = torch.empty_like(q)
    quant.quantize_fp8_per_token_group(act, codes, scale)
    quant.deinterleave_groups(codes, q)
