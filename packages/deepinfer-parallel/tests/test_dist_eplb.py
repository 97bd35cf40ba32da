"""EPLB over real gloo worlds: load counters summed over ranks, and weight rearrangement that keeps outputs."""

from __future__ import annotations

import pytest
import torch
from ep_moe import moe_through_dispatcher

from deepinfer_kernels.testing import assert_bitwise_equal, assert_close
from deepinfer_parallel.config import EplbConfig, ParallelConfig
from deepinfer_parallel.eplb.policy import rebalance_experts
from deepinfer_parallel.eplb.rebalance import apply_placement, plan_transfers
from deepinfer_parallel.eplb.stats import ExpertLoadWindow
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement, map_to_physical
from deepinfer_parallel.groups import ParallelGroups

HIDDEN = 8
TOP_K = 2
NUM_LOGICAL = 6
NUM_LAYERS = 2
# fp32, at most TOP_K weighted products summed in another order after the move.
ATOL = 1e-5


def _setup(rank, world_size):
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    layout = config.expert_layout(NUM_LOGICAL, min_redundant_experts=2)
    gen = torch.Generator().manual_seed(0)
    up = torch.randn(NUM_LAYERS, NUM_LOGICAL, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    bias = torch.randn(NUM_LAYERS, NUM_LOGICAL, HIDDEN, generator=gen)
    tokens = []
    for _ in range(world_size):
        hidden = torch.randn(9, HIDDEN, generator=gen)
        # Skewed routing: experts 3 and 5 are chosen far more often than the rest, so the policy replicates them
        # instead of experts 0 and 1 (the start-up replicas) and weights must travel between ranks.
        bias_scores = torch.tensor([0.0, 0.0, 0.0, 3.0, 0.0, 2.0])
        scores = torch.rand(9, NUM_LOGICAL, generator=gen) + bias_scores
        topk_weights, topk_ids = scores.topk(TOP_K, dim=1)
        tokens.append((hidden, topk_ids, topk_weights / topk_weights.sum(dim=1, keepdim=True)))
    return groups, layout, up, bias, tokens[rank]


def _forward(groups, placement, layer_weights, hidden, topk_ids, topk_weights, window=None):
    dispatcher = AllToAllDispatcher(groups.expert_parallel, placement.layout.num_local_experts)
    outs = []
    for layer, (local_up, local_bias) in enumerate(layer_weights):
        physical = map_to_physical(topk_ids, placement, layer, token_offset=groups.ep_rank)
        dispatched = dispatcher.dispatch(hidden, physical, topk_weights)
        if window is not None:
            window.record(layer, groups.ep_rank, dispatched.num_tokens_per_local_expert)
        outs.append(moe_through_dispatcher(hidden, physical, topk_weights, local_up, dispatcher, local_bias))
    return torch.stack(outs)


def _rearrange_worker(rank, world_size, num_p2p_groups):
    groups, layout, up, bias, (hidden, topk_ids, topk_weights) = _setup(rank, world_size)
    # Start with slots sorted by expert id descending, so the busy experts 5 and 3 share a rank and balancing has to
    # move weights between ranks.
    start = ExpertPlacement.initial(layout, NUM_LAYERS).physical_to_logical
    start = torch.stack([row[torch.argsort(-row, stable=True)] for row in start])
    placement = ExpertPlacement.from_physical_to_logical(start, layout)
    live_p2l = placement.physical_to_logical  # the router's tensor; must be updated in place
    local = [placement.local_logical_experts(layer, groups.ep_rank) for layer in range(NUM_LAYERS)]
    layer_weights = [[up[layer][ids].clone(), bias[layer][ids].clone()] for layer, ids in enumerate(local)]
    window = ExpertLoadWindow(layout, NUM_LAYERS, EplbConfig(window_size=4, step_interval=4))
    before = _forward(groups, placement, layer_weights, hidden, topk_ids, topk_weights, window)
    window.end_step(placement.physical_to_logical)
    load = window.sum_over_ranks(groups.expert_parallel)
    new_p2l = rebalance_experts(load, layout.num_redundant_experts, world_size)
    moved = sum(
        len(plan_transfers(placement.physical_to_logical[layer].tolist(), new_p2l[layer].tolist(), world_size))
        for layer in range(NUM_LAYERS)
    )

    apply_placement(layer_weights, placement, new_p2l, groups.expert_parallel, num_p2p_groups)
    after = _forward(groups, placement, layer_weights, hidden, topk_ids, topk_weights)
    assert_close(after, before, rtol=0.0, atol=ATOL, message=f"rank {rank}: output after rearrangement")
    for layer, (local_up, local_bias) in enumerate(layer_weights):
        now_local = placement.local_logical_experts(layer, groups.ep_rank)
        assert_bitwise_equal(local_up, up[layer][now_local], message=f"rank {rank} layer {layer} up")
        assert_bitwise_equal(local_bias, bias[layer][now_local], message=f"rank {rank} layer {layer} bias")
    assert placement.physical_to_logical is live_p2l, "maps must be updated in place"
    assert torch.equal(live_p2l, new_p2l)
    assert int(load.sum()) == NUM_LAYERS * TOP_K * 9 * world_size, "every routing choice is counted once"
    return moved


@pytest.mark.parametrize(("world_size", "num_p2p_groups"), [(2, 1), (4, 1), (4, 3)])
def test_rearrangement_moves_weights_and_keeps_outputs(run_ranks, world_size, num_p2p_groups):
    for moved in run_ranks(world_size, _rearrange_worker, num_p2p_groups):
        assert moved > 0, "the skewed load must move experts between ranks"


def _load_worker(rank, world_size):
    groups, layout, up, bias, (hidden, topk_ids, topk_weights) = _setup(rank, world_size)
    placement = ExpertPlacement.initial(layout, NUM_LAYERS)
    local = [placement.local_logical_experts(layer, groups.ep_rank) for layer in range(NUM_LAYERS)]
    layer_weights = [[up[layer][local[layer]], bias[layer][local[layer]]] for layer in range(NUM_LAYERS)]
    window = ExpertLoadWindow(layout, NUM_LAYERS, EplbConfig(window_size=2, step_interval=4))
    for _ in range(3):  # three counted steps in a window of two: the oldest falls out
        _forward(groups, placement, layer_weights, hidden, topk_ids, topk_weights, window)
        window.end_step(placement.physical_to_logical)
    load = window.sum_over_ranks(groups.expert_parallel)
    local_counts = torch.bincount(topk_ids.flatten(), minlength=NUM_LOGICAL)
    return load.tolist(), local_counts.tolist()


@pytest.mark.parametrize("world_size", [2, 4])
def test_load_window_counts_every_routing_choice(run_ranks, world_size):
    results = run_ranks(world_size, _load_worker)
    expected_per_step = torch.tensor([counts for _, counts in results]).sum(dim=0)
    for load, _ in results:
        load = torch.tensor(load)
        assert load.shape == (2, NUM_LAYERS, NUM_LOGICAL)
        assert torch.equal(load, expected_per_step.expand(2, NUM_LAYERS, NUM_LOGICAL))
