"""Process groups of one rank, built once from a `ParallelConfig` and passed explicitly.

`ParallelGroups.build` creates every CP, DP and EP group of the world (torch.distributed requires all ranks to take
part in creating every group, in the same order) and keeps the ones this rank belongs to as `RankGroup`s. Nothing is
stored in module globals: the engine builds one `ParallelGroups` per process and hands it to whatever communicates.
With world size 1 no torch.distributed initialisation is needed and every group has size 1.

Device groups use the world's default backend (gloo on CPU, NCCL on GPUs); the DP group also gets a gloo twin
(`data_parallel_cpu`) for CPU-side scheduler votes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_parallel.config import ParallelConfig

__all__ = [
    "ParallelGroups",
    "RankGroup",
    "context_parallel_rank_lists",
    "data_parallel_rank_lists",
    "expert_parallel_rank_lists",
]


def context_parallel_rank_lists(config: ParallelConfig) -> list[tuple[int, ...]]:
    """All CP groups of the world: contiguous blocks of `context_parallel_size` ranks."""
    cp = config.context_parallel_size
    return [tuple(range(start, start + cp)) for start in range(0, config.world_size, cp)]


def data_parallel_rank_lists(config: ParallelConfig) -> list[tuple[int, ...]]:
    """All DP groups of the world: ranks with the same replica and cp_index, ordered by dp_index."""
    dp, cp = config.data_parallel_size, config.context_parallel_size
    lists: list[tuple[int, ...]] = []
    for replica in range(config.num_replicas):
        base = replica * dp * cp
        lists.extend(tuple(base + dp_index * cp + cp_index for dp_index in range(dp)) for cp_index in range(cp))
    return lists


def expert_parallel_rank_lists(config: ParallelConfig) -> list[tuple[int, ...]]:
    """All EP groups of the world: contiguous blocks of `expert_parallel_size` ranks."""
    ep = config.expert_parallel_size
    return [tuple(range(start, start + ep)) for start in range(0, config.world_size, ep)]


@dataclass(frozen=True)
class RankGroup:
    """One process group as seen from a member rank.

    Attributes:
        ranks: global ranks of the members, in group order.
        rank: this process's index within `ranks`.
        process_group: the torch.distributed group; None when the group has one member (collectives then reduce to
            local copies and need no initialised world).
    """

    ranks: tuple[int, ...]
    rank: int
    process_group: dist.ProcessGroup | None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(f"rank={self.rank} is outside a group of size {len(self.ranks)} (ranks {self.ranks})")
        if len(self.ranks) > 1 and self.process_group is None:
            raise ValueError(f"a group of {len(self.ranks)} ranks {self.ranks} needs a process_group")

    @property
    def size(self) -> int:
        """Number of members."""
        return len(self.ranks)

    @classmethod
    def single(cls, global_rank: int = 0) -> RankGroup:
        """A group holding only `global_rank`."""
        return cls((global_rank,), 0, None)


def _member_group(
    rank_lists: list[tuple[int, ...]], global_rank: int, backend: str | None, world_size: int
) -> RankGroup:
    """Create every group in `rank_lists` (collective over the world) and return the one holding `global_rank`."""
    mine: RankGroup | None = None
    for ranks in rank_lists:
        group: object = None
        if len(ranks) == world_size and backend is None:
            # The whole world: reuse the default group instead of creating a duplicate communicator.
            group = dist.group.WORLD
        elif len(ranks) > 1:
            # Collective over the world: every rank creates every group, members or not.
            group = dist.new_group(list(ranks), backend=backend)
        if global_rank in ranks:
            if len(ranks) > 1 and not isinstance(group, dist.ProcessGroup):
                raise RuntimeError(f"torch.distributed returned no process group for member ranks {ranks}")
            mine = RankGroup(ranks, ranks.index(global_rank), group if isinstance(group, dist.ProcessGroup) else None)
    if mine is None:
        raise ValueError(f"global rank {global_rank} is in none of the groups {rank_lists}")
    return mine


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one rank communicates over.

    Attributes:
        config: the parallel sizes these groups were built from.
        world: every rank of the world.
        context_parallel: this rank's CP group (index = cp_rank).
        data_parallel: this rank's DP group (index = dp_rank), on the world's device backend.
        data_parallel_cpu: the same ranks over gloo, for CPU tensors (scheduler votes).
        expert_parallel: this rank's EP group (index = ep_rank).
    """

    config: ParallelConfig
    world: RankGroup
    context_parallel: RankGroup
    data_parallel: RankGroup
    data_parallel_cpu: RankGroup
    expert_parallel: RankGroup

    @classmethod
    def build(cls, config: ParallelConfig, rank: int = 0) -> ParallelGroups:
        """Create the groups of `rank`; every rank of the world must call this with the same config.

        Args:
            config: parallel sizes; `config.world_size` must equal the initialised world's size (when > 1).
            rank: this process's global rank.

        Returns:
            This rank's `ParallelGroups`.
        """
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank={rank} is outside the world of size {config.world_size}")
        if config.world_size == 1:
            single = RankGroup.single(0)
            return cls(config, single, single, single, single, single)
        if not dist.is_initialized():
            raise RuntimeError(
                f"ParallelGroups.build with world_size={config.world_size} needs an initialised torch.distributed "
                "world (see deepinfer_parallel.launcher.init_distributed)"
            )
        if dist.get_world_size() != config.world_size or dist.get_rank() != rank:
            raise ValueError(
                f"config world_size={config.world_size}, rank={rank} disagree with the initialised world "
                f"(world_size={dist.get_world_size()}, rank={dist.get_rank()})"
            )
        world_ranks = [tuple(range(config.world_size))]
        # Creation order is part of the protocol: every rank creates the same groups in the same order.
        world = _member_group(world_ranks, rank, None, config.world_size)
        context_parallel = _member_group(context_parallel_rank_lists(config), rank, None, config.world_size)
        data_parallel = _member_group(data_parallel_rank_lists(config), rank, None, config.world_size)
        data_parallel_cpu = _member_group(data_parallel_rank_lists(config), rank, "gloo", config.world_size)
        expert_parallel = _member_group(expert_parallel_rank_lists(config), rank, None, config.world_size)
        return cls(config, world, context_parallel, data_parallel, data_parallel_cpu, expert_parallel)

    def warm_up(self, device: torch.device) -> None:
        """Run one all-reduce on every group (collective: every rank calls it, in the same order).

        NCCL/HCCL create communicators lazily; warming them here keeps that cost (and the rule that a group's first
        point-to-point batch must involve all its ranks) out of the first step.

        Args:
            device: the rank's device for the device groups (CPU for gloo worlds); the DP CPU twin uses CPU.
        """
        for group, where in (
            (self.world, device),
            (self.context_parallel, device),
            (self.data_parallel, device),
            (self.data_parallel_cpu, torch.device("cpu")),
            (self.expert_parallel, device),
        ):
            if group.size > 1:
                dist.all_reduce(torch.ones(1, device=where), group=group.process_group)

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.world.rank

    @property
    def dp_rank(self) -> int:
        """Index within the DP group."""
        return self.data_parallel.rank

    @property
    def cp_rank(self) -> int:
        """Index within the CP group."""
        return self.context_parallel.rank

    @property
    def ep_rank(self) -> int:
        """Index within the EP group."""
        return self.expert_parallel.rank
