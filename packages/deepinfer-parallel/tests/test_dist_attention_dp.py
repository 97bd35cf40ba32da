"""Attention-DP token movement over real gloo worlds: gather/scatter round trip, gather-based MoE, DP vote."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels.testing import assert_bitwise_equal, assert_close
from deepinfer_parallel.attention_dp import (
    exchange_token_layout,
    gather_tokens,
    max_over_ranks,
    reduce_scatter_tokens,
    scatter_tokens,
)
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups

HIDDEN = 8
TOP_K = 2
NUM_EXPERTS = 8
# fp32 sums of TOP_K weighted products, reduced over ranks in another order than the reference.
ATOL = 1e-5


def _tokens(world_size):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    per_rank = []
    for rank in range(world_size):
        n = [5, 0, 7, 3][rank % 4]
        hidden = torch.randn(n, HIDDEN, generator=gen)
        scores = torch.rand(n, NUM_EXPERTS, generator=gen)
        topk_weights, topk_ids = scores.topk(TOP_K, dim=1)
        per_rank.append((hidden, topk_ids, topk_weights))
    return weights, per_rank


def _apply_experts(hidden, topk_ids, topk_weights, weights, keep):
    """sum_j w_j * expert_j(x) over the routing choices whose expert id satisfies `keep`."""
    out = torch.zeros_like(hidden)
    for j in range(TOP_K):
        use = keep(topk_ids[:, j]).unsqueeze(1)
        out += torch.where(
            use, topk_weights[:, j : j + 1] * torch.einsum("nh,nho->no", hidden, weights[topk_ids[:, j]]), 0
        )
    return out


def _attention_dp_worker(rank, world_size):
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    ep = groups.expert_parallel
    weights, per_rank = _tokens(world_size)
    hidden, topk_ids, topk_weights = per_rank[rank]

    layout = exchange_token_layout(hidden.shape[0], ep, torch.device("cpu"))
    all_hidden = gather_tokens(hidden, layout, ep)
    all_ids = gather_tokens(topk_ids, layout, ep)
    all_weights = gather_tokens(topk_weights, layout, ep)
    assert_bitwise_equal(all_hidden, torch.cat([h for h, _, _ in per_rank]), message=f"rank {rank} gathered hidden")
    assert_bitwise_equal(all_ids, torch.cat([i for _, i, _ in per_rank]), message=f"rank {rank} gathered ids")
    # torch.equal: this rank may hold no tokens, and assert_bitwise_equal cannot take empty tensors yet.
    assert torch.equal(scatter_tokens(all_hidden, layout), hidden), f"rank {rank}: round trip changed the tokens"

    # Each rank applies only its own experts (contiguous shares) to every gathered token; reduce-scatter sums them.
    per_rank_experts = NUM_EXPERTS // ep.size
    mine = range(ep.rank * per_rank_experts, (ep.rank + 1) * per_rank_experts)
    partial = _apply_experts(
        all_hidden, all_ids, all_weights, weights, lambda ids: (ids >= mine.start) & (ids < mine.stop)
    )
    out = reduce_scatter_tokens(partial, layout, ep)
    expected = _apply_experts(
        hidden, topk_ids, topk_weights, weights, lambda ids: torch.ones_like(ids, dtype=torch.bool)
    )
    assert_close(out, expected, rtol=0.0, atol=ATOL, message=f"rank {rank} gathered MoE")
    return max_over_ranks(hidden.shape[0], groups.data_parallel_cpu)


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_dp_gather_moe_reduce_scatter_round_trip(run_ranks, world_size):
    votes = run_ranks(world_size, _attention_dp_worker)
    assert votes == [max([5, 0, 7, 3][:world_size])] * world_size
