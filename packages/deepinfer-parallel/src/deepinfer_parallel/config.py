"""Frozen parallelism configuration: how many ranks do what, validated once.

`ParallelConfig` holds the data-parallel (DP), context-parallel (CP) and expert-parallel (EP) sizes and the world
they live in. `ExpertLayoutConfig` fixes how many physical expert slots exist for a model's logical routed experts
(logical experts plus redundant replicas) and how they are sharded over the EP group. `EplbConfig` holds the
expert-parallel load-balancing (EPLB) schedule knobs.

Glossary:
    logical expert: a routed expert as the checkpoint defines it (`n_routed_experts` of them).
    physical expert: an expert slot on some EP rank; it holds the weights of one logical expert. There are
        `num_logical_experts + num_redundant_experts` slots, evenly split over the EP ranks.
    redundant expert: an extra physical slot holding a copy (replica) of a busy logical expert.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["EplbConfig", "ExpertLayoutConfig", "ParallelConfig"]

_logger = logging.getLogger(__name__)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions of one world of processes.

    Rank layout (global rank = replica * (dp * cp) + dp_index * cp + cp_index):
        - CP groups are contiguous blocks of `context_parallel_size` ranks.
        - DP groups are the ranks with the same replica and cp_index.
        - EP groups are contiguous blocks of `expert_parallel_size` ranks.

    Attributes:
        world_size: number of processes; a multiple of data_parallel_size * context_parallel_size (the quotient is
            the number of replicas of the DP x CP grid).
        data_parallel_size: attention data-parallel ranks, each with its own scheduler, KV cache and batch.
        context_parallel_size: ranks that split one prefill chunk (balanced "mirror" split).
        expert_parallel_size: ranks that shard the routed experts; must divide data_parallel_size *
            context_parallel_size so that every EP group lies inside one replica.
    """

    world_size: int = 1
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "data_parallel_size", "context_parallel_size", "expert_parallel_size"):
            _require_positive(name, getattr(self, name))
        grid = self.data_parallel_size * self.context_parallel_size
        if self.world_size % grid != 0:
            raise ValueError(
                f"world_size={self.world_size} is not a multiple of data_parallel_size * context_parallel_size = "
                f"{self.data_parallel_size} * {self.context_parallel_size} = {grid}; allowed world sizes are "
                f"multiples of {grid}"
            )
        if grid % self.expert_parallel_size != 0:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} does not divide data_parallel_size * "
                f"context_parallel_size = {grid}; allowed expert_parallel_size values are {_divisors(grid)}"
            )

    @property
    def num_replicas(self) -> int:
        """Copies of the DP x CP grid in the world."""
        return self.world_size // (self.data_parallel_size * self.context_parallel_size)

    def expert_layout(self, num_logical_experts: int, min_redundant_experts: int = 0) -> ExpertLayoutConfig:
        """Expert slots for a model with `num_logical_experts` routed experts under this EP size.

        The redundant count is the smallest value >= `min_redundant_experts` that makes the physical count divisible
        by the EP size; a warning is logged when it had to be rounded up.

        Args:
            num_logical_experts: routed experts of the model (>= 1).
            min_redundant_experts: lower bound on redundant (replica) slots (>= 0).

        Returns:
            The validated `ExpertLayoutConfig`.
        """
        _require_positive("num_logical_experts", num_logical_experts)
        if not isinstance(min_redundant_experts, int) or min_redundant_experts < 0:
            raise ValueError(f"min_redundant_experts must be an int >= 0, got {min_redundant_experts!r}")
        ep = self.expert_parallel_size
        num_redundant = min_redundant_experts + (-(num_logical_experts + min_redundant_experts)) % ep
        if num_redundant != min_redundant_experts:
            _logger.warning(
                "redundant experts rounded up from %d to %d so that %d logical + redundant experts divide over %d "
                "EP ranks",
                min_redundant_experts,
                num_redundant,
                num_logical_experts,
                ep,
            )
        return ExpertLayoutConfig(num_logical_experts, num_redundant, ep)


@dataclass(frozen=True)
class ExpertLayoutConfig:
    """Physical expert slots of one MoE layer stack and their split over EP ranks.

    EP rank r owns the contiguous physical slots [r * num_local_experts, (r + 1) * num_local_experts).

    Attributes:
        num_logical_experts: routed experts of the model.
        num_redundant_experts: extra physical slots that hold replicas of logical experts.
        expert_parallel_size: EP ranks; must divide num_logical_experts + num_redundant_experts.
    """

    num_logical_experts: int
    num_redundant_experts: int
    expert_parallel_size: int

    def __post_init__(self) -> None:
        _require_positive("num_logical_experts", self.num_logical_experts)
        _require_positive("expert_parallel_size", self.expert_parallel_size)
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an int >= 0, got {self.num_redundant_experts!r}")
        num_physical = self.num_logical_experts + self.num_redundant_experts
        if num_physical % self.expert_parallel_size != 0:
            smallest = self.num_redundant_experts + (-num_physical) % self.expert_parallel_size
            raise ValueError(
                f"num_logical_experts + num_redundant_experts = {self.num_logical_experts} + "
                f"{self.num_redundant_experts} = {num_physical} physical experts do not divide over "
                f"expert_parallel_size={self.expert_parallel_size} ranks; the physical count must be a multiple of "
                f"{self.expert_parallel_size} (e.g. num_redundant_experts={smallest})"
            )

    @property
    def num_physical_experts(self) -> int:
        """Physical expert slots over all EP ranks."""
        return self.num_logical_experts + self.num_redundant_experts

    @property
    def num_local_experts(self) -> int:
        """Physical expert slots on each EP rank."""
        return self.num_physical_experts // self.expert_parallel_size

    @property
    def max_replicas(self) -> int:
        """Most replicas one logical expert can have (all redundant slots on one expert, plus its own)."""
        return self.num_redundant_experts + 1


@dataclass(frozen=True)
class EplbConfig:
    """When expert-parallel load balancing gathers statistics and rearranges experts.

    Attributes:
        window_size: steps of per-expert load kept in the sliding window (>= 1; at most step_interval when
            rearrangement is on).
        step_interval: counted steps between rearrangements; 0 disables rearrangement.
        num_p2p_groups: buckets the weight-shuffle transfers are split into, by (receiver - sender) mod this.
    """

    window_size: int = 100
    step_interval: int = 0
    num_p2p_groups: int = 1

    def __post_init__(self) -> None:
        _require_positive("window_size", self.window_size)
        _require_positive("num_p2p_groups", self.num_p2p_groups)
        if not isinstance(self.step_interval, int) or self.step_interval < 0:
            raise ValueError(
                f"step_interval must be an int >= 0 (0 disables rearrangement), got {self.step_interval!r}"
            )
        if self.step_interval > 0 and self.window_size > self.step_interval:
            raise ValueError(
                f"window_size={self.window_size} exceeds step_interval={self.step_interval}; with rearrangement on the "
                f"window must be in [1, {self.step_interval}]"
            )

    @property
    def enabled(self) -> bool:
        """Whether rearrangement ever happens."""
        return self.step_interval > 0

    @property
    def first_rearrangement_step(self) -> int:
        """Counted steps before the first rearrangement: max(1, step_interval // 4)."""
        return max(1, self.step_interval // 4)
