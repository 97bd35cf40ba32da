"""RMSNorm layer (docs/design/model.md, "RMSNorm"): FP32 statistics and product, one rounding to the output; with
the FP8 copy of the output for the FP8 GEMMs that read it (docs/design/numerics.md, "Rounding points")."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import CodeOrder, GroupCodes, rms_norm, rms_norm_fp8
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

    def with_fp8_copy(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp8Copy | None]:
        """The layer's output and, in exact mode on an accelerator, its FP8 copy for ``Fp8BlockLinear``'s
        ``fp8_copy`` from the same kernel (``deepinfer_kernels.rms_norm_fp8``); None elsewhere (CPU, FP32 mode, a
        width that is not a multiple of 32), where the GEMMs quantize the output themselves to the same codes.

        Args: x [..., dim] bf16/fp32. Returns: ([..., dim] activation dtype, (codes, scales) or None).
        """
        y, copy, _ = self.with_fp8_codes(x, None)
        return y, copy

    def with_fp8_codes(
        self, x: torch.Tensor, order: CodeOrder | None
    ) -> tuple[torch.Tensor, Fp8Copy | None, GroupCodes | None]:
        """:meth:`with_fp8_copy`, and where there is a copy and ``order`` names one, the same codes as ``GroupCodes``
        in that order for a grouped MXFP4 GEMM that reads them (the de-interleaved order written by the same kernel;
        docs/design/kernels.md, "Codes into the grouped GEMM").

        Args: x [..., dim] bf16/fp32; order as ``deepinfer_kernels.mxfp4_grouped_code_order`` names it, or None.
        Returns: (output, (codes, scales) or None, GroupCodes or None).
        """
        if self.mode is not ComputeMode.EXACT or self.weight.device.type == "cpu" or x.shape[-1] % 32:
            return self(x), None, None
        if order != "deinterleaved":
            y, q, scale = rms_norm_fp8(x.to(torch.bfloat16), self.weight, self.eps)
            return y, (q, scale), None if order is None else GroupCodes(q, scale, order)
        deinterleaved = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        y, q, scale = rms_norm_fp8(x.to(torch.bfloat16), self.weight, self.eps, deinterleaved_out=deinterleaved)
        return y, (q, scale), GroupCodes(deinterleaved, scale, order)
