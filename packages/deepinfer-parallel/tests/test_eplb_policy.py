"""EPLB placement policy: hand-checked small cases, redundant experts, uneven rank counts, a skewed routing trace."""

from __future__ import annotations

import pytest
import torch

from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.eplb.policy import (
    max_to_mean_rank_load,
    place_replicas,
    rebalance_experts,
    replicate_experts,
)
from deepinfer_parallel.expert_parallel import initial_physical_to_logical


def test_replication_goes_to_the_busiest_expert_with_lowest_id_on_ties():
    load = torch.tensor([[8, 4, 2, 2]])
    # Slot 0: giving expert 0 a replica lowers the step max from 8 to 4. Slot 1: experts 0, 1 and 2 all leave the max
    # at 4; the 1e-4 * e perturbation picks expert 0.
    assert replicate_experts(load, 2).tolist() == [0, 1, 2, 3, 0, 0]


def test_replication_of_zero_load_prefers_lowest_id():
    assert replicate_experts(torch.zeros(3, 5), 3).tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


def test_replication_sums_the_per_step_maximum_over_steps():
    # Expert 0 is busy in step 0, expert 1 in steps 1 and 2: the replica goes where it cuts the summed maxima most.
    load = torch.tensor([[10, 0, 1], [0, 9, 1], [0, 9, 1]])
    assert replicate_experts(load, 1).tolist() == [0, 1, 2, 1]


def test_placement_hand_checked():
    # Replicas in load order 0 (4), 1 (3), 2 (2), 3 (1): 0 -> rank 0 (tie, lowest rank), 1 -> rank 1,
    # 2 -> rank 1 (max 5 < 6), 3 -> rank 0 (rank 1 full).
    p2l = place_replicas(torch.tensor([[4, 3, 2, 1]]), torch.arange(4), num_ranks=2)
    assert p2l.tolist() == [0, 3, 1, 2]
    assert max_to_mean_rank_load(torch.tensor([[4, 3, 2, 1]]), p2l, 2) == pytest.approx(1.0)


def test_one_slot_per_rank_keeps_replica_order():
    replicas = torch.tensor([0, 1, 2, 3, 1, 0])
    assert place_replicas(torch.rand(4, 4), replicas, num_ranks=6).tolist() == replicas.tolist()


@pytest.mark.parametrize(("num_logical", "ep", "min_redundant"), [(10, 3, 0), (10, 6, 0), (7, 4, 2), (12, 5, 1)])
def test_uneven_counts_with_redundant_experts(num_logical, ep, min_redundant):
    layout = ParallelConfig(world_size=ep, data_parallel_size=ep, expert_parallel_size=ep).expert_layout(
        num_logical, min_redundant
    )
    assert layout.num_physical_experts % ep == 0
    assert layout.num_redundant_experts >= min_redundant
    load = torch.randint(0, 50, (6, 2, num_logical), generator=torch.Generator().manual_seed(ep))
    p2l = rebalance_experts(load, layout.num_redundant_experts, ep)
    assert p2l.shape == (2, layout.num_physical_experts)
    for layer in range(2):
        counts = torch.bincount(p2l[layer], minlength=num_logical)
        assert counts.shape == (num_logical,)
        assert bool((counts >= 1).all())
        assert int(counts.sum()) == layout.num_physical_experts


def test_policy_is_deterministic():
    load = torch.rand(5, 3, 9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rebalance_experts(load, 3, 4), rebalance_experts(load, 3, 4))


def _skewed_trace(num_steps, num_logical, tokens_per_step, top_k, popularity_seed, routing_seed):
    """Per-step tokens routed to each logical expert when expert popularity follows a Zipf-like law."""
    popularity = 1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64) ** 1.2
    popularity = popularity[torch.randperm(num_logical, generator=torch.Generator().manual_seed(popularity_seed))]
    gen = torch.Generator().manual_seed(routing_seed)
    load = torch.zeros(num_steps, num_logical, dtype=torch.int64)
    for step in range(num_steps):
        topk = torch.multinomial(popularity.expand(tokens_per_step, -1), top_k, generator=gen)
        load[step] = torch.bincount(topk.flatten(), minlength=num_logical)
    return load


@pytest.mark.parametrize(("num_logical", "ep", "min_redundant"), [(16, 4, 4), (24, 6, 6), (20, 3, 0)])
def test_skewed_trace_imbalance_drops_after_rebalancing(num_logical, ep, min_redundant):
    layout = ParallelConfig(world_size=ep, data_parallel_size=ep, expert_parallel_size=ep).expert_layout(
        num_logical, min_redundant
    )
    trace = _skewed_trace(40, num_logical, tokens_per_step=256, top_k=4, popularity_seed=ep, routing_seed=0)
    before_p2l = initial_physical_to_logical(layout, 1)[0]
    after_p2l = rebalance_experts(trace.unsqueeze(1), layout.num_redundant_experts, ep)[0]
    before = max_to_mean_rank_load(trace, before_p2l, ep)
    after = max_to_mean_rank_load(trace, after_p2l, ep)
    # A fresh trace from the same distribution: the placement must generalise, not just fit the window.
    held_out = _skewed_trace(40, num_logical, tokens_per_step=256, top_k=4, popularity_seed=ep, routing_seed=1)
    held_out_after = max_to_mean_rank_load(held_out, after_p2l, ep)
    print(
        f"E={num_logical} ep={ep} redundant={layout.num_redundant_experts}: max/mean rank load "
        f"{before:.3f} -> {after:.3f} (held-out trace {held_out_after:.3f})"
    )
    assert after < before
    assert after < 1.15
    assert held_out_after < before


def test_rebalance_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match=r"10 \+ 1 = 11 does not divide over num_ranks=4"):
        rebalance_experts(torch.ones(2, 1, 10), 1, 4)


def test_rebalance_rejects_negative_load():
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-torch.ones(2, 1, 4), 0, 2)


def test_placement_rejects_replicas_missing_an_expert():
    with pytest.raises(ValueError, match="every one of the 4 logical experts"):
        place_replicas(torch.ones(1, 4), torch.tensor([0, 1, 2, 2]), 2)
