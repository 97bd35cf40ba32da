"""Expert-parallel dispatch/combine over real gloo worlds of 2 and 4 CPU ranks vs single-process MoE math."""

from __future__ import annotations

import pytest
import torch
from ep_moe import moe_through_dispatcher

from deepinfer_kernels.testing import assert_close
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement, map_to_physical
from deepinfer_parallel.groups import ParallelGroups

HIDDEN = 8
TOP_K = 3
# fp32 sums of at most TOP_K products of O(1) values, accumulated in a different order than the reference.
ATOL = 1e-5


def _problem(world_size: int, num_logical: int, seed: int):
    """Expert weights [E, H, H] and every rank's tokens/routing, identical on all ranks (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_logical, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    per_rank = []
    for rank in range(world_size):
        # Uneven token counts, one rank idle, as attention-DP ranks have.
        num_tokens = [5, 0, 7, 3][rank % 4]
        hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
        scores = torch.rand(num_tokens, num_logical, generator=gen)
        topk_weights, topk_ids = scores.topk(TOP_K, dim=1)
        per_rank.append((hidden, topk_ids, topk_weights.softmax(dim=1)))
    return weights, per_rank


def _reference(hidden, topk_ids, topk_weights, weights):
    out = torch.zeros_like(hidden)
    for j in range(topk_ids.shape[1]):
        out += topk_weights[:, j : j + 1] * torch.einsum("nh,nho->no", hidden, weights[topk_ids[:, j]])
    return out


def _moe(groups, placement, weights, hidden, topk_ids, topk_weights, local_weights=None):
    ep_rank = groups.ep_rank
    if local_weights is None:
        local_weights = weights[placement.local_logical_experts(0, ep_rank)]
    physical_ids = map_to_physical(topk_ids, placement, layer=0, token_offset=ep_rank)
    dispatcher = AllToAllDispatcher(groups.expert_parallel, placement.layout.num_local_experts)
    return moe_through_dispatcher(hidden, physical_ids, topk_weights, local_weights, dispatcher)


def _ep_worker(rank, world_size, num_logical, num_redundant, shuffle_seed, ep_size=None):
    ep_size = world_size if ep_size is None else ep_size
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=ep_size)
    groups = ParallelGroups.build(config, rank)
    layout = config.expert_layout(num_logical, num_redundant)
    weights, per_rank = _problem(world_size, num_logical, seed=0)
    hidden, topk_ids, topk_weights = per_rank[rank]
    placement = ExpertPlacement.initial(layout, num_layers=1)
    if shuffle_seed is not None:
        perm = torch.randperm(layout.num_physical_experts, generator=torch.Generator().manual_seed(shuffle_seed))
        placement = ExpertPlacement.from_physical_to_logical(placement.physical_to_logical[:, perm], layout)
    out = _moe(groups, placement, weights, hidden, topk_ids, topk_weights)
    assert_close(out, _reference(hidden, topk_ids, topk_weights, weights), rtol=0.0, atol=ATOL, message=f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_combine_matches_single_process(run_ranks, world_size):
    run_ranks(world_size, _ep_worker, 8, 0, None)


@pytest.mark.parametrize("world_size", [2, 4])
def test_redundant_experts_give_the_same_result(run_ranks, world_size):
    # 6 logical experts + redundant replicas in a shuffled placement: every replica of an expert holds its weights,
    # so which replica a token reaches must not matter.
    run_ranks(world_size, _ep_worker, 6, 2, 3)


def test_expert_parallel_subgroups_inside_a_larger_world(run_ranks):
    # World of 4 with EP groups {0, 1} and {2, 3}: two independent dispatch/combine exchanges side by side.
    run_ranks(4, _ep_worker, 6, 0, 5, 2)
