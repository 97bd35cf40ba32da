"""The library's spawn helper starts real processes that form one gloo world; argument errors are clear."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer_parallel.launcher import find_free_port, init_distributed, spawn


def _sum_ranks_then_fail_on_rank_one(rank, world_size, offset):
    value = torch.tensor([rank + offset])
    dist.all_reduce(value)
    if int(value) != sum(range(world_size)) + world_size * offset:
        raise AssertionError(f"rank {rank}: all-reduce gave {int(value)}")
    if rank == 1:
        raise RuntimeError(f"rank one failed on purpose after a correct all-reduce ({int(value)})")


def test_spawn_forms_a_world_and_reraises_a_rank_failure():
    # One spawn (each costs seconds): the all-reduce proves the world works, rank 1's error must reach the parent.
    with pytest.raises(
        mp.ProcessRaisedException, match=r"rank one failed on purpose after a correct all-reduce \(21\)"
    ):
        spawn(_sum_ranks_then_fail_on_rank_one, 2, args=(10,), timeout_s=30.0)


def test_init_distributed_rejects_bad_arguments():
    port = find_free_port()
    with pytest.raises(ValueError, match="need 0 <= rank < world_size, got rank=2, world_size=2"):
        init_distributed(2, 2, "127.0.0.1", port)
    with pytest.raises(ValueError, match="backend must be one of"):
        init_distributed(0, 1, "127.0.0.1", port, backend="mpi")
    with pytest.raises(ValueError, match="master_port must be in"):
        init_distributed(0, 1, "127.0.0.1", 0)
