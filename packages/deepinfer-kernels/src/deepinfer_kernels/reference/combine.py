"""Reference MoE combine: the contract of ``deepinfer_kernels.moe_combine`` as sequential torch FP32 adds."""

from __future__ import annotations

import torch

__all__ = ["moe_combine"]


def moe_combine(routed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    total = torch.zeros(out.shape, dtype=torch.float32, device=out.device) if bias is None else bias.float()
    for choice in range(routed.shape[1]):
        total = total + routed[:, choice].float()
    out.copy_(total)
