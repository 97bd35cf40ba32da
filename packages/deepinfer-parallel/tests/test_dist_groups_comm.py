"""Group layout and collectives over real gloo worlds of 2 and 4 ranks, and group-building errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer_parallel.comm import all_gather_into, all_reduce_, all_to_all_v, exchange_counts, reduce_scatter_into
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups


def _groups_worker(rank, world_size, dp, cp, ep):
    config = ParallelConfig(
        world_size=world_size, data_parallel_size=dp, context_parallel_size=cp, expert_parallel_size=ep
    )
    groups = ParallelGroups.build(config, rank)
    groups.warm_up(torch.device("cpu"))
    seen = {}
    for name in ("world", "context_parallel", "data_parallel", "data_parallel_cpu", "expert_parallel"):
        group = getattr(groups, name)
        # Every member contributes its global rank: the gather must reproduce the group's rank list.
        gathered = all_gather_into(torch.empty(group.size, dtype=torch.int64), torch.tensor([rank]), group)
        seen[name] = (group.ranks, tuple(gathered.tolist()), group.rank)
    return seen, (groups.dp_rank, groups.cp_rank, groups.ep_rank)


@pytest.mark.parametrize(
    ("world_size", "dp", "cp", "ep"), [(2, 2, 1, 2), (2, 1, 2, 1), (4, 2, 2, 2), (4, 4, 1, 2), (4, 2, 1, 1)]
)
def test_group_layout(run_ranks, world_size, dp, cp, ep):
    for rank, (seen, (dp_rank, cp_rank, ep_rank)) in enumerate(run_ranks(world_size, _groups_worker, dp, cp, ep)):
        replica, inner = divmod(rank, dp * cp)
        dp_index, cp_index = divmod(inner, cp)
        base = replica * dp * cp
        assert seen["world"][0] == tuple(range(world_size))
        assert seen["context_parallel"][0] == tuple(range(rank - cp_index, rank - cp_index + cp))
        assert seen["data_parallel"][0] == tuple(base + d * cp + cp_index for d in range(dp))
        assert seen["data_parallel_cpu"][0] == seen["data_parallel"][0]
        assert seen["expert_parallel"][0] == tuple(range(rank - rank % ep, rank - rank % ep + ep))
        assert (dp_rank, cp_rank, ep_rank) == (dp_index, cp_index, rank % ep)
        for ranks, gathered, index in seen.values():
            assert gathered == ranks
            assert ranks[index] == rank


def _comm_worker(rank, world_size):
    groups = ParallelGroups.build(ParallelConfig(world_size=world_size, data_parallel_size=world_size), rank)
    world = groups.world
    # all-to-all-v: rank r sends (p + 1) rows of value 10 * r + p to peer p.
    send_counts = torch.tensor([p + 1 for p in range(world_size)])
    send = torch.cat([torch.full((p + 1, 2), 10.0 * rank + p) for p in range(world_size)])
    recv_counts = exchange_counts(send_counts, world)
    recv = all_to_all_v(torch.empty(sum(recv_counts), 2), send, recv_counts, send_counts.tolist(), world)
    expected_recv = torch.cat([torch.full((rank + 1, 2), 10.0 * p + rank) for p in range(world_size)])
    # reduce-scatter: everyone contributes arange; rank r keeps rows r*2..r*2+1 times world_size.
    rs_input = torch.arange(2 * world_size * 3, dtype=torch.float32).reshape(2 * world_size, 3)
    rs = reduce_scatter_into(torch.empty(2, 3), rs_input, world)
    summed = all_reduce_(torch.tensor([float(rank)]), world, "sum")
    return (
        recv_counts == [rank + 1] * world_size,
        torch.equal(recv, expected_recv),
        torch.equal(rs, rs_input[2 * rank : 2 * rank + 2] * world_size),
        float(summed) == sum(range(world_size)),
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives(run_ranks, world_size):
    for checks in run_ranks(world_size, _comm_worker):
        assert all(checks), checks


def _mismatched_world_worker(rank, world_size):
    try:
        ParallelGroups.build(ParallelConfig(world_size=2 * world_size, data_parallel_size=2 * world_size), rank)
    except ValueError as error:
        return str(error)
    return None


def test_groups_reject_a_config_for_another_world_size(run_ranks):
    for message in run_ranks(2, _mismatched_world_worker):
        assert message is not None
        assert "world_size=4" in message and "(world_size=2" in message
