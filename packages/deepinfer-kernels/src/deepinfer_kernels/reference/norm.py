"""Reference RMSNorm (docs/design/model.md, "RMSNorm"): FP32 statistics and product, one rounding to the output."""

from __future__ import annotations

import torch

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = round(x · ρ · w)`` with ``ρ = 1 / sqrt(Σx² / H + eps)``.

    ``Σx²`` is an FP32 sum (PyTorch's reduction order); ``eps`` is taken as an FP32 value (as every kernel
    receives it); ``Σx² / H + eps`` and ``1 / sqrt(·)`` are evaluated in FP64 and rounded once to FP32 (the
    "correctly rounded" ρ); the product ``(x · ρ) · w`` is FP32.

    Args:
        x: [num_rows, hidden_size] bf16 or fp32, contiguous.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square.
        out: [num_rows, hidden_size], x's dtype; written in place.
    """
    xf = x.float()
    sum_sq = (xf * xf).sum(dim=-1, keepdim=True)
    eps_fp32 = float(torch.tensor(eps, dtype=torch.float32))
    rho = (1.0 / torch.sqrt(sum_sq.double() / x.shape[-1] + eps_fp32)).float()
    out.copy_((xf * rho) * weight.float())
