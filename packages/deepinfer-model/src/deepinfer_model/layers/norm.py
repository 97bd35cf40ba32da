"""RMSNorm layer (docs/design/model.md, "RMSNorm"): FP32 statistics and product, one rounding to the output."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import rms_norm
from deepinfer_model.layers.linear import make_parameter
from deepinfer_model.layers.mode import ComputeMode

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x · ρ · w`` with ``ρ = 1/sqrt(mean(x²) + eps)``; BF16 weight ``[dim]``."""

    def __init__(self, dim: int, eps: float, mode: ComputeMode) -> None:
        super().__init__()
        self.eps = eps
        self.mode = mode
        self.weight = make_parameter((dim,), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [..., dim] bf16/fp32. Returns: [..., dim] in the activation dtype."""
        dtype = self.mode.activation_dtype
        weight = self.weight if dtype == torch.bfloat16 else self.weight.float()
        return rms_norm(x.to(dtype), weight, self.eps)
