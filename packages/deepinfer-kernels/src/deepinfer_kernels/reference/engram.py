"""Reference Engram gate: the contract of ``deepinfer_kernels.engram_gate`` in torch ops, FP32 sums in torch's order."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels.engram import GATE_FLOOR

__all__ = ["engram_gate"]


def engram_gate(
    trunk: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    active: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    hidden = trunk.shape[-1]
    x, k = trunk.float(), keys.float()
    weight = q_weight.float() * k_weight.float()
    a_x = torch.rsqrt(((x * x).sum(dim=-1) / hidden + eps).double()).float()
    a_k = torch.rsqrt(((k * k).sum(dim=-1) / hidden + eps).double()).float()
    z = (x * weight[None] * k).sum(dim=-1) * a_x * a_k / math.sqrt(hidden)
    # copysign: z = +0 gives sigmoid(+1e−3).
    gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(z.abs(), min=GATE_FLOOR)), z))
    updated = (x + gate[..., None] * value.float()[:, None, :]).to(out.dtype)
    out.copy_(torch.where(active[:, None, None], updated, trunk))
