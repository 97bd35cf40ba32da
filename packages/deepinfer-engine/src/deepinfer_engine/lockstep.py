"""Lockstep execution of the ranks of a data-/expert-/context-parallel world.

The ranks meet in every MoE layer's all-to-all, so each rank must run exactly one model forward per step, in
lockstep with the others:

- the loop continues while *any* rank has unfinished work (`LockstepRunner.any_busy`, a MAX vote over the DP group);
- a rank with nothing to compute in a step (no requests left, or a schedule that came out empty) runs a *padding
  forward* instead: one placeholder token at position 0 in the null block 0 and the never-used state slot 0
  (`StepBuffers.placeholder_batch`), whose logits are discarded. The model cannot run a forward of zero tokens (its
  Engram layers reshape an empty tensor), so one token is the smallest step that still enters every MoE all-to-all;
- ranks step synchronously (no asynchronous scheduling), so every `EngineCore.step` launches exactly one forward.

EPLB (`deepinfer_engine.eplb`): the vote also carries whether the step just run held prompt tokens on any rank, so
every rank closes that step in the EPLB controller with the same verdict, counts the same steps and rearranges at the
same step; the rearrangement runs between two forwards, before the next step is scheduled.
"""

from __future__ import annotations

import torch

from deepinfer_engine.eplb import EplbController
from deepinfer_engine.model_runner import ModelRunner, StepHandle
from deepinfer_engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer_parallel.comm import all_reduce_
from deepinfer_parallel.groups import RankGroup

__all__ = ["LockstepRunner"]


class LockstepRunner:
    """A model runner that runs one forward per step on every rank (see the module docstring).

    Args:
        runner: this rank's model runner (its model and cache pools run the padding forwards).
        vote_group: the group that votes on unfinished work (the DP group over gloo).
        eplb: this rank's EPLB controller; None when rearrangement is off or the EP group has one rank.
    """

    def __init__(
        self,
        runner: ModelRunner,
        vote_group: RankGroup,
        eplb: EplbController | None = None,
    ) -> None:
        self.runner = runner
        self.vote_group = vote_group
        self.eplb = eplb
        self._stepped = False  # a forward ran since the last vote
        self._step_had_prefill = False

    def any_busy(self, busy: bool) -> bool:
        """Whether any rank of the vote group has unfinished work (collective: every rank calls it once a step).

        The vote also closes the step run since the previous vote in the EPLB controller (which may rearrange,
        collectively over the EP group), with "a prefill ran" voted over the group too.
        """
        vote = torch.tensor([int(busy), int(self._step_had_prefill)], dtype=torch.int64)
        any_busy, any_prefill = all_reduce_(vote, self.vote_group, "max").tolist()
        if self._stepped and self.eplb is not None:
            self.eplb.end_step(bool(any_prefill))
        self._stepped = self._step_had_prefill = False
        return bool(any_busy)

    def pad_step(self) -> None:
        """Run the padding forward of a step in which this rank computes nothing; its logits are discarded."""
        with torch.inference_mode():
            self.runner.model(self.runner.buffers.placeholder_batch(1, 1), self.runner.state)
        self._stepped = True

    def execute(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """`ModelRunner.execute`, with a padding forward when the schedule is empty."""
        if scheduler_output.is_empty:
            self.pad_step()
        else:
            self._stepped = True
            self._step_had_prefill = any(
                r.num_computed_tokens < r.num_prompt_tokens for r in scheduler_output.scheduled_requests
            )
        return self.runner.execute(scheduler_output)

    def wait(self, handle: StepHandle) -> ModelRunnerOutput:
        """`ModelRunner.wait`."""
        return self.runner.wait(handle)
