"""Public router selection (docs/design/model.md, "Router"): validation and allocation, then the resolved backend
(one Triton kernel on NVIDIA for scores, biased top-k and weights, where PyTorch launches about twelve)."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["router_topk"]


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts and routing weights per token: ``s = sqrt(softplus(l))``, the ``top_k`` largest ``s + bias`` (ties to
    the lower expert index), weights ``s / Σ s · scaling`` over the chosen experts.

    Args:
        logits: [n, E] fp32 router logits.
        bias: [E] fp32 selection bias, same device.
        top_k: experts per token, 1 … E.
        scaling: ``routed_scaling_factor`` (finite).

    Returns:
        ``(ids [n, top_k] int64, weights [n, top_k] fp32)``, ids in selection order.

    Raises:
        TypeError: a tensor is not a tensor or not fp32.
        ValueError: shapes disagree, ``top_k`` is out of range, ``scaling`` is not finite, or devices differ.
    """
    check_tensor("logits", logits)
    check_tensor("bias", bias)
    check_dtype("logits", logits.dtype, (torch.float32,))
    check_dtype("bias", bias.dtype, (torch.float32,))
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [n, E] with E >= 1, got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if tuple(bias.shape) != (experts,):
        raise ValueError(f"bias must have shape ({experts},), got {tuple(bias.shape)}")
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be an int in [1, {experts}], got {top_k!r}")
    if not (isinstance(scaling, (int, float)) and math.isfinite(scaling)):
        raise ValueError(f"scaling must be a finite float, got {scaling!r}")
    check_same_device(logits=logits, bias=bias)
    n = logits.shape[0]
    ids = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((n, top_k), dtype=torch.float32, device=logits.device)
    if n:
        _registry.resolve("router_topk", logits.device.type)(
            logits.contiguous(), bias.contiguous(), top_k, float(scaling), ids, weights
        )
    return ids, weights
