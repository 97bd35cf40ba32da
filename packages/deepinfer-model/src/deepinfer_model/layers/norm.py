"""RMSNorm layer (docs/design/model.md, "RMSNorm"): FP32 statistics and product, one rounding to the output; with
the FP8 copy of the output for the FP8 GEMMs that read it (docs/design/numerics.md, "Rounding points")."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import rms_norm, rms_norm_fp8
from deepinfer_model.layers.linear import Fp8Copy, make_parameter
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

    def makes_fp8_copy(self) -> bool:
        """Whether :meth:`with_fp8_copy` gives an FP8 copy: in exact mode on an accelerator, for a width that is a
        multiple of 32."""
        return self.mode is ComputeMode.EXACT and self.weight.device.type != "cpu" and self.weight.shape[0] % 32 == 0

    def with_fp8_copy(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp8Copy | None]:
        """The layer's output and, where :meth:`makes_fp8_copy`, its FP8 copy for ``Fp8BlockLinear``'s ``fp8_copy``
        from the same kernel (``deepinfer_kernels.rms_norm_fp8``); None elsewhere (CPU, FP32 mode, a width that is
        not a multiple of 32), where the GEMMs quantize the output themselves to the same codes.

        Args: x [..., dim] bf16/fp32. Returns: ([..., dim] activation dtype, (codes, scales) or None).
        """
        if not self.makes_fp8_copy():
            return self(x), None
        y, q, scale = rms_norm_fp8(x.to(torch.bfloat16), self.weight, self.eps)
        return y, (q, scale)
