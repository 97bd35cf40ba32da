"""Expert-parallel load balancing (EPLB) inside the engine's ranks: settings, the per-rank controller, its statistics.

`EplbSettings` is built once from the environment by the entrypoint (`EplbSettings.from_env`) and handed to every rank
by the executor. On each expert-parallel rank (EP size > 1, rearrangement on) an `EplbController`
(docs/design/parallelism.md, "EPLB"):

- enables the recording hook of the rank's `ExpertParallelMoE`: every MoE dispatch adds the routing choices each
  local physical slot received to the current step's counters of an on-device `ExpertLoadWindow` (no host sync);
- closes every step the ranks ran in lockstep (`end_step`, told by the lockstep vote whether any rank's step held a
  prefill): a step with a prefill is discarded unless `rearrange_after_prefill`; any other step is pushed into the
  window and counted;
- rearranges after max(1, interval // 4) counted steps, then every `interval` counted steps; with
  `rearrange_after_prefill`, prefill steps are counted too and the first step without a prefill after one rearranges
  regardless of the schedule.

Every rank of an EP group sees the same votes, so all count the same steps and reach each rearrangement together.
A rearrangement sums the window over the EP group, computes the new placement on the CPU (`rebalance_experts`, the
same deterministic result on every rank) and installs it (`ExpertParallelMoE.rebalance`: weights move, maps update).
Model outputs do not change: a token's routed experts are the same logical experts wherever they live.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_engine.envs import EnvSettings
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.eplb.policy import rebalance_experts
from deepinfer_parallel.eplb.stats import ExpertLoadWindow

__all__ = [
    "EplbController",
    "EplbSettings",
    "EplbStats",
    "Rearrangement",
    "engine_expert_layout",
    "rank_imbalance",
]

logger = logging.getLogger(__name__)

_WINDOW = "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE"
_INTERVAL = "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL"
_P2P = "DEEPINFER_REARRANGE_P2P_GROUPS"
_AFTER_PREFILL = "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE"
_EXTRA = "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"


@dataclass(frozen=True)
class EplbSettings:
    """EPLB in the engine (only expert-parallel ranks with EP size > 1 act on it).

    Attributes:
        schedule: window size, rearrangement interval and P2P buckets; None when rearrangement is off.
        min_redundant_experts: replica slots asked for; rounded up so the physical experts divide over the EP ranks.
            0 adds none (the routed experts must then divide over the EP ranks themselves).
        rearrange_after_prefill: count prefill steps, and rearrange on the first step without a prefill after one.
    """

    schedule: EplbConfig | None = None
    min_redundant_experts: int = 0
    rearrange_after_prefill: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.min_redundant_experts, bool) or not isinstance(self.min_redundant_experts, int):
            raise ValueError(f"min_redundant_experts must be an int >= 0, got {self.min_redundant_experts!r}")
        if self.min_redundant_experts < 0:
            raise ValueError(f"min_redundant_experts must be >= 0, got {self.min_redundant_experts}")
        if self.rearrange_after_prefill and self.schedule is None:
            raise ValueError("rearrange_after_prefill needs rearrangement on (a schedule with step_interval > 0)")

    @classmethod
    def from_env(cls, env: EnvSettings) -> EplbSettings:
        """The settings of the parsed environment.

        Raises:
            ValueError: the window is not in [1, interval] while rearrangement is on, or
                DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE is set with rearrangement off (the message names
                the variables and their values).
        """
        window, interval = env[_WINDOW], env[_INTERVAL]
        after_prefill = env[_AFTER_PREFILL]
        if interval == 0:
            if after_prefill:
                raise ValueError(
                    f"{_AFTER_PREFILL} is set but {_INTERVAL}=0 turns rearrangement off; set {_INTERVAL} > 0 or "
                    f"unset {_AFTER_PREFILL}"
                )
            return cls(None, env[_EXTRA], False)
        if not 1 <= window <= interval:
            raise ValueError(
                f"{_WINDOW}={window} must be in [1, {_INTERVAL}={interval}] while rearrangement is on ({_INTERVAL} > 0)"
            )
        return cls(EplbConfig(window, interval, env[_P2P]), env[_EXTRA], after_prefill)


def engine_expert_layout(
    config: ParallelConfig, num_logical_experts: int, settings: EplbSettings
) -> ExpertLayoutConfig:
    """The expert layout of the engine's EP ranks: no replicas unless asked for, else the rounded-up count.

    Raises:
        ValueError: without replicas, the routed experts do not divide over the EP ranks (the message names both).
    """
    ep = config.expert_parallel_size
    if settings.min_redundant_experts == 0:
        try:
            return ExpertLayoutConfig(num_logical_experts, 0, ep)
        except ValueError as exc:
            raise ValueError(
                f"expert_parallel_size={ep} does not divide the model's n_routed_experts={num_logical_experts}: {exc} "
                f"({_EXTRA} adds replica slots)"
            ) from exc
    return config.expert_layout(num_logical_experts, settings.min_redundant_experts)


def rank_imbalance(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> float:
    """Max-to-mean rank load of a placement over every step and layer: Σ max_r / Σ mean_r (1.0 = even).

    A logical expert's load is split evenly over its replicas (what the router's replica rotation does on average).

    Args:
        load: [num_steps, num_layers, num_logical] logical expert load (any real dtype), on the CPU.
        physical_to_logical: [num_layers, num_physical] int64 placement; rank r holds an even contiguous share.
        num_ranks: EP ranks.

    Returns:
        The ratio, or 1.0 when there is no load.
    """
    t = load.to(torch.float64)
    num_steps, num_layers, num_logical = t.shape
    p2l = physical_to_logical.to(device="cpu", dtype=torch.int64)
    counts = torch.zeros(num_layers, num_logical, dtype=torch.float64)
    counts.scatter_add_(1, p2l, torch.ones_like(p2l, dtype=torch.float64))
    index = p2l.unsqueeze(0).expand(num_steps, -1, -1)
    slot_load = torch.gather(t, 2, index) / torch.gather(counts, 1, p2l)
    rank_load = slot_load.reshape(num_steps, num_layers, num_ranks, -1).sum(dim=3)
    mean = float(rank_load.mean(dim=2).sum())
    return float(rank_load.amax(dim=2).sum()) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Rearrangement:
    """One rearrangement.

    Attributes:
        counted_step: counted steps when it happened.
        num_moved_slots: physical slots (over all layers) whose logical expert changed.
        imbalance_before: `rank_imbalance` of the window under the old placement.
        imbalance_after: the same under the new placement.
    """

    counted_step: int
    num_moved_slots: int
    imbalance_before: float
    imbalance_after: float


@dataclass(frozen=True)
class EplbStats:
    """What an EP rank's controller did so far.

    Attributes:
        num_counted_steps: steps pushed into the load window.
        rearrangements: every rearrangement, oldest first.
        physical_to_logical: [num_layers][num_physical] the placement now.
    """

    num_counted_steps: int
    rearrangements: tuple[Rearrangement, ...]
    physical_to_logical: tuple[tuple[int, ...], ...]

    @property
    def num_rearrangements(self) -> int:
        """Rearrangements so far."""
        return len(self.rearrangements)


class EplbController:
    """Load statistics and rearrangements of one EP rank (see the module docstring).

    Args:
        schedule: window size, interval and P2P buckets.
        rearrange_after_prefill: see `EplbSettings`.
        expert_parallel: the rank's backbone experts (EP group size > 1); its recording hook is turned on.
        moes: the backbone MoE of every layer, in layer order.

    Raises:
        ValueError: the EP group has one rank, or `moes` does not match the placement.
    """

    def __init__(
        self,
        schedule: EplbConfig,
        rearrange_after_prefill: bool,
        expert_parallel: ExpertParallelMoE,
        moes: Sequence[MoE],
    ) -> None:
        if expert_parallel.group.size < 2:
            raise ValueError("EPLB needs an EP group of at least 2 ranks (EP size 1 has nothing to balance)")
        placement = expert_parallel.placement
        if len(moes) != placement.num_layers:
            raise ValueError(f"got {len(moes)} MoE layers, the expert placement covers {placement.num_layers}")
        self.schedule = schedule
        self.rearrange_after_prefill = rearrange_after_prefill
        self.expert_parallel = expert_parallel
        self.moes = list(moes)
        self.window = ExpertLoadWindow(
            placement.layout, placement.num_layers, schedule, device=placement.physical_to_logical.device
        )
        expert_parallel.record_load(self.window)
        self._rearrange_on_next_decode = False
        self._rearrangements: list[Rearrangement] = []

    def end_step(self, any_prefill: bool) -> None:
        """Close the step every rank just ran; rearranges when due (then collective over the EP group).

        Args:
            any_prefill: whether any rank's step held prompt tokens (identical on every rank: the lockstep vote).
        """
        if any_prefill and not self.rearrange_after_prefill:
            self.window.discard_step()
            return
        self.window.end_step(self.expert_parallel.placement.physical_to_logical)
        if any_prefill:
            self._rearrange_on_next_decode = True
            return
        if self._rearrange_on_next_decode or self.window.rearrangement_due():
            self._rearrange_on_next_decode = False
            self.rearrange()

    def rearrange(self) -> Rearrangement:
        """Rebalance now from the window summed over the EP group (collective: every EP rank calls it)."""
        ep = self.expert_parallel
        group, layout = ep.group, ep.placement.layout
        load = self.window.sum_over_ranks(group).cpu()
        old = ep.placement.physical_to_logical.cpu().clone()
        new = rebalance_experts(load, layout.num_redundant_experts, group.size)
        record = Rearrangement(
            counted_step=self.window.num_counted_steps,
            num_moved_slots=int((old != new).sum()),
            imbalance_before=rank_imbalance(load, old, group.size),
            imbalance_after=rank_imbalance(load, new, group.size),
        )
        ep.rebalance(self.moes, new, self.schedule.num_p2p_groups)
        self._rearrangements.append(record)
        if group.rank == 0:
            logger.info(
                "EPLB rearrangement %d after %d counted steps (window of %d): %d expert slots moved, max/mean rank "
                "load %.3f -> %.3f",
                len(self._rearrangements),
                record.counted_step,
                load.shape[0],
                record.num_moved_slots,
                record.imbalance_before,
                record.imbalance_after,
            )
        return record

    def stats(self) -> EplbStats:
        """What this controller did so far."""
        p2l = self.expert_parallel.placement.physical_to_logical.cpu().tolist()
        return EplbStats(
            num_counted_steps=self.window.num_counted_steps,
            rearrangements=tuple(self._rearrangements),
            physical_to_logical=tuple(tuple(row) for row in p2l),
        )
