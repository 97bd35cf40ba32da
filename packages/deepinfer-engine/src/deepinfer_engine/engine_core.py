"""The engine core loop: schedule → execute → update, synchronous or with asynchronous scheduling.

`EngineCore` owns a `Scheduler` and a model runner (anything satisfying `ModelRunnerProtocol`). One `step()`:

- synchronous: schedule step N, launch it, wait for its results, commit them, return its outputs.
- asynchronous ("zero-overhead scheduling", the default; docs/design/scheduler.md, "Asynchronous scheduling"): schedule
  step N+1 and launch it while step N still runs on the device, then wait for step N, commit it and return its outputs.
  The host work of a step (scheduling, building inputs, committing, stop checks) thus hides behind the device work of
  the step before.

    host:    | sched N+1 | launch N+1 | wait N · commit N |  sched N+2 | launch N+2 | wait N+1 · commit N+1 |
    device:  |  ········· step N ·········|  ············ step N+1 ·············|  ······ step N+2 ···

Outputs are those of synchronous mode, token for token, one `step()` later: step N+1 is scheduled before step N's
sampled tokens reach the host, so a request whose sampling step is in flight is scheduled with *placeholders*
(`ScheduledRequest.num_placeholder_tokens`): the runner takes the input tokens from step N's results in device
memory and corrects the positions by the drafts step N rejected. The scheduler reserves cache for the worst case
(every draft in flight accepted) and rolls the reservation back on commit. A request that step N finishes (stop
token) was scheduled once more in step N+1; that extra result is discarded, and its cache is freed only when step
N+1 is committed. `step()` with no unfinished request left only collects the step in flight, so

    while core.has_unfinished_requests():
        outputs += core.step()

drains everything.

The two modes batch requests differently (a step may carry an extra round or a skipped request), so equality needs a
runner whose emitted token at a position does not depend on the batch: sampling keyed by (request seed, position)
(sampling package). With draft tokens at temperature > 0 the token also depends on whether its position is a verify
row or the fresh row (rejection sampling draws them from different streams), so each step of a request must verify
the same number of drafts in both modes: a request in flight is planned only when that number does not depend on
what the step in flight emits (`deepinfer_engine.step_plan`), near max_tokens or max_model_len it waits for the
results. A preemption recompute still changes the row layout (its prefill samples the next token as a fresh row), in
both modes alike.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from deepinfer_engine.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from deepinfer_engine.request import Request, RequestStatus
from deepinfer_engine.scheduler import Scheduler

__all__ = ["EngineCore", "ModelRunnerProtocol"]

HandleT = TypeVar("HandleT")


class ModelRunnerProtocol(Protocol[HandleT]):
    """What the engine core needs from a model runner.

    Contract:

    - `execute` launches a step and returns at once, without synchronizing with the device; steps run on the device
      in launch order. `wait` is called exactly once per handle, in launch order.
    - Before a step's requests, the runner drops its state for `finished_request_ids` and
      `preempted_request_ids`; `is_new` requests start from scratch; each block table is cut at
      `first_new_block_index` and extended by `new_block_ids`.
    - A request with `num_placeholder_tokens > 0` was sampled by the step launched just before. Its inputs are that
      step's last emitted token for the request, then the first `num_placeholder_tokens - 1` draft tokens that step
      proposed; its first position is `num_computed_tokens` minus the drafts that step rejected for it. The runner
      gathers both from device memory, never through the host.
    - With `max_num_draft_tokens > 0` the drafter proposes `max_num_draft_tokens` drafts for every request it
      samples (pad drafts are fine: they are rejected).
    - Results for requests that finished, were aborted or preempted while the step was in flight are computed
      anyway and discarded by the scheduler; an empty step reports an empty `ModelRunnerOutput`.
    """

    def execute(self, scheduler_output: SchedulerOutput) -> HandleT:
        """Launch one step without blocking; returns the handle `wait` takes."""
        ...

    def wait(self, handle: HandleT) -> ModelRunnerOutput:
        """Block until the step behind `handle` finished; its results."""
        ...


class EngineCore(Generic[HandleT]):
    """The step loop over a scheduler and a model runner.

    Args:
        scheduler: the scheduler (with its cache manager); it must have no step in flight.
        runner: launches steps and reports their results.
        async_scheduling: overlap scheduling step N+1 with the device running step N.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunnerProtocol[HandleT],
        *,
        async_scheduling: bool = True,
    ) -> None:
        if scheduler.num_steps_in_flight:
            raise ValueError(f"the scheduler has {scheduler.num_steps_in_flight} steps in flight; it must have none")
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self._in_flight: tuple[SchedulerOutput, HandleT] | None = None

    def add_request(self, request: Request) -> None:
        """Queue a new request (see `Scheduler.add_request`)."""
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Abort an unfinished request; its "abort" output comes with the next committed step.

        A step in flight still computes it; that result is discarded and its cache is freed once the step is
        committed.
        """
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a launched step's results are not committed yet (asynchronous scheduling only)."""
        return self._in_flight is not None

    def reset(self) -> None:
        """Forget the step in flight after a step raised (the scheduler and the runner are reset with it)."""
        self._in_flight = None

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished, an output is pending, or a step is still in flight."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the step committed in it (see the module docstring)."""
        if not self.async_scheduling:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.runner.wait(self.runner.execute(scheduler_output))
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        launched: tuple[SchedulerOutput, HandleT] | None = None
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            launched = (scheduler_output, self.runner.execute(scheduler_output))
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            return []
        previous_output, handle = previous
        return self.scheduler.update_from_output(previous_output, self.runner.wait(handle))
