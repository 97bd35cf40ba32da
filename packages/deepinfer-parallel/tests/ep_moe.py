"""A MoE layer through a `TokenDispatcher`, for the expert-parallel tests: dispatch, local experts, combine."""

from __future__ import annotations

import torch

from deepinfer_parallel.expert_parallel import TokenDispatcher


def moe_through_dispatcher(
    hidden: torch.Tensor,
    topk_physical_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    local_weights: torch.Tensor,
    dispatcher: TokenDispatcher,
    local_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[:, j] * (hidden @ W[expert j] + b[expert j]) for affine experts held per local slot.

    Each rank weights and sums its own routing choices per received row (a token picks an expert at most once),
    and combine adds the ranks' partial sums.

    Args:
        hidden: [n, H] this rank's tokens (n may be 0; the rank still takes part).
        topk_physical_ids: [n, k] physical expert ids.
        topk_weights: [n, k] routing weights.
        local_weights: [num_local_experts, H, H] this rank's expert matrices, by local slot.
        dispatcher: transport over the EP group.
        local_bias: [num_local_experts, H] this rank's expert biases, or None for none.
    """
    dispatched = dispatcher.dispatch(hidden, topk_physical_ids, topk_weights)
    rows = dispatched.hidden_states
    out = torch.zeros(rows.shape[0], local_weights.shape[-1], dtype=torch.float32, device=rows.device)
    for slot in range(dispatcher.num_local_experts):
        weight = (dispatched.topk_weights * (dispatched.topk_local_ids == slot)).sum(dim=1)
        expert_out = rows.float() @ local_weights[slot].float()
        if local_bias is not None:
            expert_out = expert_out + local_bias[slot].float()
        out += weight.float().unsqueeze(1) * expert_out
    return dispatcher.combine(out.to(hidden.dtype), dispatched)
