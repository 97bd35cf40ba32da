"""EPLB load statistics: per-step routed-token counters kept over a sliding window of steps.

During a step each MoE layer records how many routing choices every local physical slot received (the dispatch's
`num_tokens_per_local_expert`; no host synchronisation). At the end of a counted step the counts are folded into
logical-expert counts with the placement of that step and pushed into a ring of `window_size` steps. Each rank only
sees its own slots, so the window holds partial sums until `sum_over_ranks` adds them up over the EP group. Which
steps count (e.g. whether prefill steps do) is the caller's choice: it calls `end_step` for counted steps and
`discard_step` for the others.
"""

from __future__ import annotations

import torch

from deepinfer_parallel.comm import all_reduce_
from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig
from deepinfer_parallel.groups import RankGroup

__all__ = ["ExpertLoadWindow"]


class ExpertLoadWindow:
    """Ring window of logical expert load, [window_size, num_layers, num_logical], on one EP rank."""

    def __init__(
        self, layout: ExpertLayoutConfig, num_layers: int, config: EplbConfig, device: torch.device | None = None
    ) -> None:
        """Create zeroed counters.

        Args:
            layout: expert counts and EP size.
            num_layers: MoE layers (>= 1).
            config: window size and rearrangement schedule.
            device: where the counters live (the device the dispatch counts are on); CPU when None.
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.layout = layout
        self.config = config
        self._step = torch.zeros(num_layers, layout.num_physical_experts, dtype=torch.int64, device=device)
        self._window = torch.zeros(
            config.window_size, num_layers, layout.num_logical_experts, dtype=torch.int64, device=device
        )
        self._next = 0
        self._num_filled = 0
        self.num_counted_steps = 0

    def record(self, layer: int, ep_rank: int, num_tokens_per_local_expert: torch.Tensor) -> None:
        """Add one layer's received counts for the current step.

        Args:
            layer: MoE layer index.
            ep_rank: this rank's index in the EP group (selects its physical slots).
            num_tokens_per_local_expert: [num_local_experts] int64 routing choices per local slot.
        """
        num_local = self.layout.num_local_experts
        if num_tokens_per_local_expert.shape != (num_local,):
            raise ValueError(
                f"num_tokens_per_local_expert must be [{num_local}], got {tuple(num_tokens_per_local_expert.shape)}"
            )
        if not 0 <= ep_rank < self.layout.expert_parallel_size:
            raise ValueError(f"ep_rank={ep_rank} outside [0, {self.layout.expert_parallel_size})")
        start = ep_rank * num_local
        self._step[layer, start : start + num_local] += num_tokens_per_local_expert

    def end_step(self, physical_to_logical: torch.Tensor) -> None:
        """Close a counted step: fold its counts into logical experts and push them into the window.

        Args:
            physical_to_logical: [num_layers, num_physical] int64 placement the step ran with.
        """
        if physical_to_logical.shape != self._step.shape:
            raise ValueError(
                f"physical_to_logical must be {tuple(self._step.shape)}, got {tuple(physical_to_logical.shape)}"
            )
        slot = self._window[self._next]
        slot.zero_()
        slot.scatter_add_(1, physical_to_logical.to(slot.device), self._step)
        self._step.zero_()
        self._next = (self._next + 1) % self.config.window_size
        self._num_filled = min(self._num_filled + 1, self.config.window_size)
        self.num_counted_steps += 1

    def discard_step(self) -> None:
        """Drop the current step's counts (a step that is not counted)."""
        self._step.zero_()

    def logical_load(self) -> torch.Tensor:
        """This rank's part of the window, oldest step first: [num_filled, num_layers, num_logical] int64."""
        order = [(self._next - self._num_filled + i) % self.config.window_size for i in range(self._num_filled)]
        return self._window[order]

    def sum_over_ranks(self, group: RankGroup) -> torch.Tensor:
        """The window summed over the EP group (collective: every EP rank must call it).

        Returns:
            [num_filled, num_layers, num_logical] int64, identical on all ranks.
        """
        return all_reduce_(self.logical_load().contiguous(), group, "sum")

    def rearrangement_due(self) -> bool:
        """Whether the counted steps so far reach a rearrangement point.

        The first comes after `config.first_rearrangement_step` counted steps, then one every `config.step_interval`
        counted steps; never when rearrangement is disabled.
        """
        if not self.config.enabled:
            return False
        first = self.config.first_rearrangement_step
        n = self.num_counted_steps
        return n >= first and (n - first) % self.config.step_interval == 0
