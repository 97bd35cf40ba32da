"""Expert maps, replica choice and dispatch/combine on one process (EP group of size 1)."""

from __future__ import annotations

import pytest
import torch
from ep_moe import moe_through_dispatcher

from deepinfer_kernels.testing import assert_close
from deepinfer_parallel.config import ExpertLayoutConfig
from deepinfer_parallel.expert_parallel import (
    AllToAllDispatcher,
    ExpertPlacement,
    initial_physical_to_logical,
    map_to_physical,
)
from deepinfer_parallel.groups import RankGroup


def test_initial_placement_replicates_from_expert_zero():
    layout = ExpertLayoutConfig(num_logical_experts=5, num_redundant_experts=3, expert_parallel_size=4)
    assert initial_physical_to_logical(layout, 1).tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    placement = ExpertPlacement.initial(layout, num_layers=2)
    assert placement.logical_count[0].tolist() == [2, 2, 2, 1, 1]
    assert placement.logical_to_physical[0].tolist() == [
        [0, 5, -1, -1],
        [1, 6, -1, -1],
        [2, 7, -1, -1],
        [3, -1, -1, -1],
        [4, -1, -1, -1],
    ]
    assert placement.local_logical_experts(1, ep_rank=2).tolist() == [4, 0]


def test_maps_are_consistent_for_a_random_placement():
    layout = ExpertLayoutConfig(num_logical_experts=7, num_redundant_experts=5, expert_parallel_size=3)
    gen = torch.Generator().manual_seed(0)
    p2l = torch.cat([torch.arange(7), torch.randint(0, 7, (5,), generator=gen)])[torch.randperm(12, generator=gen)]
    placement = ExpertPlacement.from_physical_to_logical(p2l.unsqueeze(0), layout)
    for expert in range(7):
        slots = placement.logical_to_physical[0, expert]
        count = int(placement.logical_count[0, expert])
        assert sorted(slots[:count].tolist()) == slots[:count].tolist()
        assert set(slots[:count].tolist()) == set((p2l == expert).nonzero().flatten().tolist())
        assert bool((slots[count:] == -1).all())


def test_placement_rejects_a_missing_expert():
    layout = ExpertLayoutConfig(4, 0, 2)
    with pytest.raises(ValueError, match=r"without a physical slot \(layer, expert\): \[\[0, 3\]\]"):
        ExpertPlacement.from_physical_to_logical(torch.tensor([[0, 1, 2, 2]]), layout)


def test_replica_choice_spreads_tokens_over_replicas():
    layout = ExpertLayoutConfig(num_logical_experts=2, num_redundant_experts=2, expert_parallel_size=2)
    placement = ExpertPlacement.from_physical_to_logical(torch.tensor([[0, 0, 0, 1]]), layout)
    ids = torch.zeros(6, 1, dtype=torch.int64)
    assert map_to_physical(ids, placement, 0).flatten().tolist() == [0, 1, 2, 0, 1, 2]
    assert map_to_physical(ids, placement, 0, token_offset=1).flatten().tolist() == [1, 2, 0, 1, 2, 0]
    assert map_to_physical(torch.ones(3, 1, dtype=torch.int64), placement, 0).flatten().tolist() == [3, 3, 3]


def test_single_rank_moe_weights_and_sums_every_choice():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, generator=gen)
    topk_ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2]])
    topk_weights = torch.rand(6, 2, generator=gen)
    scales = torch.tensor([1.0, 10.0, 100.0])
    dispatcher = AllToAllDispatcher(RankGroup.single(), num_local_experts=3)
    assert dispatcher.dispatch(hidden, topk_ids, topk_weights).num_tokens_per_local_expert.tolist() == [4, 4, 4]
    local_weights = scales.reshape(3, 1, 1) * torch.eye(4)
    out = moe_through_dispatcher(hidden, topk_ids, topk_weights, local_weights, dispatcher)
    expected = (topk_weights * scales[topk_ids]).sum(dim=1, keepdim=True) * hidden
    assert_close(out, expected, atol=1e-4, rtol=1e-6)


def test_empty_batch_gives_empty_output():
    dispatcher = AllToAllDispatcher(RankGroup.single(), num_local_experts=2)
    out = moe_through_dispatcher(
        torch.empty(0, 4), torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), torch.ones(2, 4, 4), dispatcher
    )
    assert out.shape == (0, 4)


def test_dispatch_rejects_out_of_range_physical_ids():
    dispatcher = AllToAllDispatcher(RankGroup.single(), num_local_experts=2)
    with pytest.raises(ValueError, match=r"topk_physical_ids must be in \[0, 2\)"):
        dispatcher.dispatch(torch.zeros(1, 4), torch.tensor([[0, 2]]), torch.ones(1, 2))


def test_dispatch_rejects_float_ids():
    dispatcher = AllToAllDispatcher(RankGroup.single(), num_local_experts=2)
    with pytest.raises(TypeError, match="integer tensor"):
        dispatcher.dispatch(torch.zeros(1, 4), torch.zeros(1, 2), torch.ones(1, 2))
