"""Triton router selection: one program per token holds all ``E`` scores in registers and picks the top-k by ``k``
rounds of (maximum, lowest index reaching it), which is the order of a stable descending sort.

``softplus`` uses ``log1p(x) = log(1 + x) · x / ((1 + x) − 1)`` (exact to a few ulp, without libdevice, so the kernel
also runs in Triton's interpreter); with ``exp`` this makes the scores differ from the reference in their last bits,
and the weights also by the FP32 order of the sum over the chosen experts. A choice between experts whose biased
scores are that close can differ from the reference.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.reference.routing import WEIGHT_NORM_EPS

__all__ = ["router_topk"]


@triton.jit
def _router_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    experts,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_EPS: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_E)
    mask = offsets < experts
    logits = tl.load(logits_ptr + token * experts + offsets, mask=mask, other=0.0)
    # Above 20 the logit itself is the softplus: exp is taken of at most 20 and no lane divides 0 by 0.
    e = tl.exp(tl.minimum(logits, 20.0))
    u = 1.0 + e
    d = u - 1.0
    log1p = tl.where(d == 0.0, e, tl.div_rn(tl.log(u) * e, tl.where(d == 0.0, 1.0, d)))
    scores = tl.sqrt_rn(tl.where(logits > 20.0, logits, log1p))
    biased = tl.where(mask, scores + tl.load(bias_ptr + offsets, mask=mask, other=0.0), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=0)
        index = tl.min(tl.where(biased == best, offsets, BLOCK_E), axis=0)
        picked = offsets == index
        chosen = tl.where(slots == j, tl.sum(tl.where(picked, scores, 0.0), axis=0), chosen)
        tl.store(ids_ptr + token * TOP_K + j, index.to(tl.int64))
        biased = tl.where(picked, float("-inf"), biased)
    total = tl.sum(chosen, axis=0) + NORM_EPS
    tl.store(weights_ptr + token * TOP_K + slots, tl.div_rn(chosen, total) * scaling, mask=slots < TOP_K)


def router_topk(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, ids: torch.Tensor, weights: torch.Tensor
) -> None:
    """Triton router selection (arguments as ``reference.routing.router_topk``; contiguous inputs)."""
    check_launchable(logits=logits, bias=bias, ids=ids, weights=weights)
    n, experts = logits.shape
    _router_kernel[(n,)](
        logits,
        bias,
        ids,
        weights,
        experts,
        scaling,
        TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_K=triton.next_power_of_2(top_k),
        NORM_EPS=WEIGHT_NORM_EPS,
        enable_fp_fusion=False,
        **dependent_launch(logits.device),
    )
