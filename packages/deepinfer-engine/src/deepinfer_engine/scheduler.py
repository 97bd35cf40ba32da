"""The scheduler: each step decides how many tokens every request computes, and commits what the model emitted.

CPU only and deterministic: the same calls in the same order give the same schedules. There are no separate prefill
and decode phases; a step mixes prompt chunks, single decode tokens and draft tokens to verify, under two limits:
the token budget `max_num_batched_tokens` and `max_num_seqs` requests holding cache.

One step of `schedule()`:

1. Running requests, in serve order: first those with one known token left to compute (decode), then those still
   prefilling; within each, fewest generated tokens first (ties: earlier arrival first). Each gets
   `min(remaining tokens + allowed drafts, budget left, max_model_len - computed)` tokens and the cache for them. When
   the cache is full, the *victim order* (docs/design/scheduler.md, "Preemption") applies: the not-yet-scheduled running
   request with the most generated tokens (ties: latest arrival) is preempted, the request being served itself only when
   no other candidate is left. Requests already scheduled this step keep their cache.
2. Waiting requests, FCFS with head-of-line blocking, only if nothing was preempted this step: the head is admitted
   when a request slot is free, the cache can hold its whole known sequence now, and budget is left; it gets a
   chunk of at most the remaining budget (chunked prefill).

Preemption (recompute): the request's cache is released, `num_computed_tokens` drops to 0 and it goes back to the
head of the waiting queue with its generated tokens kept; when it runs again it recomputes prompt + outputs as one
long prompt. With `stop_preempted_requests` it finishes with "insufficient_system_resource" instead.

`update_from_output()` first finishes the requests the runner failed (no token of theirs is kept), then commits
each request's emitted tokens one at a time and checks, after each, in this order: EOS unless
ignore_eos → "stop"; a stop token id → "stop"; total length > max_model_len → "length"; generated tokens ==
max_tokens → "length". Tokens after the first stop are dropped. Rejected draft tokens are rolled back in the cache.
Stop strings need detokenized text: the engine's output processor finds them and ends the request with
`finish_request` (status "stop", the tokens after the match dropped), the path every finish from outside a step
takes (abort, grammar failure, stop string).

Asynchronous scheduling (docs/design/scheduler.md, "Asynchronous scheduling"; driven by `deepinfer_engine.engine_core`):
`schedule()` may be called once more before the previous step's `update_from_output`; steps are committed in the order
they were scheduled. A request whose sampling step is in flight is planned with placeholders
(`deepinfer_engine.step_plan`), the cache reserving for the worst case (every draft in flight accepted); when that
cannot be had, the request waits for the results instead of preempting itself. The cache of a request that finishes
while a step computing it is in flight is freed once that step is committed, so no step computes into cache handed out
again; preemption frees at once and relies on the device running steps in launch order.
"""

from __future__ import annotations

from collections import deque

from deepinfer_engine.cache_manager import AllocationResult, CacheManager
from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.outputs import ModelRunnerOutput, RequestOutput, ScheduledRequest, SchedulerOutput
from deepinfer_engine.request import Request, RequestStatus, TopLogprobs
from deepinfer_engine.step_plan import StepInFlight, num_new_tokens, num_remaining, scheduled_request
from deepinfer_engine.step_results import append_emitted, check_result, completion_of
from deepinfer_engine.verify_plan import plan_verified_drafts
from deepinfer_sampling.speculative import DecodeCostCurve

__all__ = ["Scheduler"]


class Scheduler:
    """Continuous-batching scheduler under the step limits of `config`, over the cache of `cache_manager`; with a
    decode cost curve `verify_cost` each step verifies the drafts the confidences say pay off
    (`deepinfer_engine.verify_plan`), without one every draft held."""

    def __init__(
        self, config: SchedulerConfig, cache_manager: CacheManager, verify_cost: DecodeCostCurve | None = None
    ) -> None:
        limit = cache_manager.max_backtracking_tokens
        if limit is not None and config.max_num_draft_tokens > limit:
            raise ValueError(
                f"max_num_draft_tokens {config.max_num_draft_tokens} exceeds the {limit} backtracking tokens the "
                f"cache rings are sized for"
            )
        self.config = config
        self.cache_manager = cache_manager
        self.verify_cost = verify_cost
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, int] = {}
        self._num_arrivals = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._finished_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []
        self._step = 0
        self._in_flight: deque[StepInFlight] = deque()
        self._frees_after_step: dict[int, list[str]] = {}

    @property
    def num_waiting(self) -> int:
        """Requests waiting (new or preempted)."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests holding cache."""
        return len(self._running)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps scheduled whose results are not committed yet (at most 2, while scheduling ahead)."""
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is unfinished or an output is still to be returned."""
        return bool(self._requests) or bool(self._pending_outputs)

    def get_request(self, request_id: str) -> Request:
        """The unfinished request `request_id`."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request {request_id!r}")
        return self._requests[request_id]

    def add_request(self, request: Request) -> None:
        """Queue a new request; one that can never run finishes at once with "prompt_length_exceeded".

        A request can never run when its prompt is longer than `max_model_len`, or when its longest possible
        sequence does not fit in the whole cache (it could then not even finish alone).
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.cache_manager.has_request(request.request_id):
            raise ValueError(
                f"request id {request.request_id!r} still holds the cache of a finished request until the step in "
                f"flight is committed; use a fresh id"
            )
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id!r} must be new (WAITING, nothing computed), got {request!r}")
        request.arrival_step = self._step
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._num_arrivals
        self._num_arrivals += 1
        limit, num_prompt = self.config.max_model_len, request.num_prompt_tokens
        max_positions = min(num_prompt + request.stop.max_tokens - 1, limit)
        message = None
        if num_prompt > limit:
            message = f"prompt of {num_prompt} tokens exceeds max_model_len={limit}"
        elif not self.cache_manager.can_ever_fit(max_positions):
            message = f"prompt of {num_prompt} tokens plus max_tokens cannot fit in the whole cache, even alone"
        if message is None:
            self._waiting.append(request)
            return
        finish = self._finish(request, RequestStatus.FINISHED_IGNORED, self._step, error_message=message)
        self._pending_outputs.append(finish)

    def finish_request(
        self,
        request_id: str,
        status: RequestStatus,
        error_message: str | None = None,
        *,
        stop_reason: int | str | None = None,
        num_output_tokens: int | None = None,
    ) -> None:
        """Finish an unfinished request from outside a step (abort, structured-output failure, stop string) with
        `status`, `error_message` (error statuses only) and `stop_reason`, keeping only its first `num_output_tokens`
        generated tokens when given. Its cache is released; its final output comes with the next `update_from_output`.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        request = self.get_request(request_id)
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        finish = self._finish(request, status, self._step, stop_reason=stop_reason, error_message=error_message)
        self._pending_outputs.append(finish)

    def abort_all(self, error_message: str) -> list[RequestOutput]:
        """Recover from a failed step: forget the steps in flight, finish every unfinished request with
        FINISHED_ERROR and `error_message`, free all their cache; returns every output still to be returned
        (those finish outputs included). The scheduler is then as good as new (its step counter goes on)."""
        self._in_flight.clear()
        self._frees_after_step.clear()
        for request in list(self._requests.values()):
            self._pending_outputs.append(
                self._finish(request, RequestStatus.FINISHED_ERROR, self._step, error_message=error_message)
            )
        for request_id in list(self.cache_manager.request_ids):  # includes frees deferred to a forgotten step
            self.cache_manager.free(request_id)
        self._finished_ids.clear()
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work (see the module docstring).

        Raises:
            RuntimeError: two steps are already in flight (commit the older one first).
        """
        if len(self._in_flight) > 1:
            raise RuntimeError(
                f"steps {[s.output.step for s in self._in_flight]} are in flight; commit the oldest with "
                f"update_from_output before scheduling another"
            )
        step = self._step
        self._step += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        scheduled_ids: set[str] = set()
        preempted: list[str] = []

        victims = sorted(self._running, key=self._victim_key, reverse=True)
        serve = sorted(self._running, key=lambda r: (num_remaining(r) > 1, self._victim_key(r)))
        cost = self.verify_cost
        max_drafts = plan_verified_drafts(self._running, self.config, cost) if cost is not None else {}
        for request in serve:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new, num_drafts = num_new_tokens(request, budget, self.config, max_drafts.get(request.request_id))
            if num_new == 0:
                continue  # its step in flight must be committed first
            allocation = self._allocate_or_preempt(request, num_new, victims, scheduled_ids, preempted, step)
            if allocation is None:
                continue  # the request itself was preempted
            scheduled.append(scheduled_request(request, num_new, num_drafts, False, allocation, step))
            scheduled_ids.add(request.request_id)
            budget -= num_new

        while not preempted and self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if not self.cache_manager.can_allocate(request.request_id, request.num_tokens):
                break  # head-of-line blocking keeps admission FCFS
            num_new, num_drafts = num_new_tokens(request, budget, self.config)
            allocation = self.cache_manager.allocate(request.request_id, num_new)
            if allocation is None:
                raise RuntimeError(f"request {request.request_id!r}: allocation failed after can_allocate")
            self._waiting.popleft()
            request.set_status(RequestStatus.RUNNING)
            self._running.append(request)
            scheduled.append(scheduled_request(request, num_new, num_drafts, True, allocation, step))
            budget -= num_new

        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        output = SchedulerOutput(step, tuple(scheduled), finished_ids, tuple(preempted))
        self._in_flight.append(StepInFlight(output, {s.request_id: s for s in scheduled}))
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Commit the runner's results (index-aligned with `scheduler_output.scheduled_requests`) for the matching
        `schedule()` call and return this step's outputs.

        Outputs of requests that finished outside a step (ignored, aborted, stopped by a stop string) come first,
        then one per scheduled request that emitted tokens, failed or finished, in batch order. Steps are committed
        in the order they were scheduled; nothing changes when the runner output is rejected.
        """
        if not self._in_flight or self._in_flight[0].output.step != scheduler_output.step:
            in_flight = [s.output.step for s in self._in_flight]
            raise ValueError(f"step {scheduler_output.step} is not the oldest step in flight {in_flight}")
        expected = tuple(s.request_id for s in scheduler_output.scheduled_requests)
        if runner_output.request_ids != expected:
            raise ValueError(f"runner output is for requests {runner_output.request_ids}, expected {expected}")
        valid = []
        for index, scheduled in enumerate(scheduler_output.scheduled_requests):
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled: its result is void
            if scheduled.request_id not in runner_output.failures:
                check_result(request, scheduled, runner_output.sampled_token_ids[index])
            valid.append((index, request, scheduled))
        self._in_flight.popleft()
        outputs, self._pending_outputs = self._pending_outputs, []
        step = scheduler_output.step
        for index, request, scheduled in valid:
            if runner_output.prompt_logprobs is not None:
                request.prompt_logprobs.update(runner_output.prompt_logprobs[index])
            failure = runner_output.failures.get(request.request_id)
            if failure is not None:
                outputs.append(self._finish(request, failure.status, step, error_message=failure.message))
                continue
            sampled = runner_output.sampled_token_ids[index]
            logprobs = runner_output.logprobs[index] if runner_output.logprobs is not None else None
            top = runner_output.top_logprobs[index] if runner_output.top_logprobs is not None else None
            drafts = runner_output.draft_token_ids[index] if runner_output.draft_token_ids is not None else ()
            confidences = runner_output.draft_confidences
            request.draft_confidences = list(confidences[index]) if confidences is not None else []
            output = self._commit(request, scheduled, sampled, logprobs, top, drafts, step)
            if output is not None:
                outputs.append(output)
        for request_id in self._frees_after_step.pop(scheduler_output.step, ()):
            self.cache_manager.free(request_id)
        return outputs

    def _victim_key(self, request: Request) -> tuple[int, int]:
        # Larger = preempted first: most generated tokens, then latest arrival.
        return request.num_output_tokens, self._arrival[request.request_id]

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        victims: list[Request],
        scheduled_ids: set[str],
        preempted: list[str],
        step: int,
    ) -> AllocationResult | None:
        """Allocate for a running request, preempting in victim order until it fits; None if it preempted itself."""
        num_tokens = request.num_computed_tokens + num_new
        while (allocation := self.cache_manager.allocate(request.request_id, num_tokens)) is None:
            candidates = (
                v
                for v in victims
                if v.status is RequestStatus.RUNNING and v.request_id not in scheduled_ids and v is not request
            )
            victim = next(candidates, request)
            if victim is request and request.num_output_placeholders:
                return None  # its worst case does not fit: wait for the step in flight rather than lose it
            preempted.append(victim.request_id)
            self._preempt(victim, step)
            if victim is request:
                return None
        return allocation

    def _preempt(self, request: Request, step: int) -> None:
        self._running.remove(request)
        self.cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft_token_ids, request.draft_confidences = [], []
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        if self.config.stop_preempted_requests:
            self._pending_outputs.append(self._finish(request, RequestStatus.FINISHED_PREEMPTED, step))
            return
        request.set_status(RequestStatus.PREEMPTED)
        self._waiting.appendleft(request)

    def _num_tokens_in_later_steps(self, request_id: str) -> int:
        """Tokens of the request reserved by steps in flight (the step being committed is no longer listed)."""
        return sum(s.requests[request_id].num_scheduled_tokens for s in self._in_flight if request_id in s.requests)

    def _commit(
        self,
        request: Request,
        scheduled: ScheduledRequest,
        sampled: tuple[int, ...],
        logprobs: tuple[float, ...] | None,
        top: tuple[TopLogprobs, ...] | None,
        drafts: tuple[int, ...],
        step: int,
    ) -> RequestOutput | None:
        """Append one request's emitted tokens (checked by `check_result`); returns its output, or None for a
        prompt chunk that sampled nothing."""
        request_id = request.request_id
        if not scheduled.samples_token:
            return None
        num_drafts = scheduled.num_draft_tokens
        num_accepted = len(sampled) - 1
        request.num_output_placeholders -= 1 + num_drafts
        request.count_sampling_step(num_drafts, num_accepted)
        num_rejected = num_drafts - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            self.cache_manager.rollback(request_id, num_rejected, self._num_tokens_in_later_steps(request_id))
        request.draft_token_ids = []
        if request.first_token_step is None:
            request.first_token_step = step
        num_emitted, finish = append_emitted(request, sampled, logprobs, top, self.config.max_model_len)
        new_tokens = tuple(sampled[:num_emitted])
        new_logprobs = tuple(logprobs[:num_emitted]) if logprobs is not None else None
        if finish is None:
            request.draft_token_ids = list(drafts)
            return RequestOutput(request_id, new_tokens, new_logprobs, request.num_output_tokens)
        status, stop_reason = finish
        return self._finish(request, status, step, new_tokens, new_logprobs, stop_reason)

    def _finish(
        self,
        request: Request,
        status: RequestStatus,
        step: int,
        new_token_ids: tuple[int, ...] = (),
        new_logprobs: tuple[float, ...] | None = None,
        stop_reason: int | str | None = None,
        error_message: str | None = None,
    ) -> RequestOutput:
        """Finish `request`, release everything it holds, and build its last output."""
        request_id = request.request_id
        request.set_status(status, error_message)
        request.stop_reason = stop_reason
        request.finished_step = step
        if request in self._running:
            self._running.remove(request)
        elif request in self._waiting:
            self._waiting.remove(request)
        if self.cache_manager.has_request(request_id):
            self._release_cache(request_id)
        del self._requests[request_id]
        del self._arrival[request_id]
        self._finished_ids.add(request_id)
        reason = status.finish_reason
        assert reason is not None  # status.is_finished was checked by set_status's transition table
        completion = completion_of(request, reason, step)
        return RequestOutput(request_id, new_token_ids, new_logprobs, request.num_output_tokens, reason, completion)

    def _release_cache(self, request_id: str) -> None:
        """Free a finished request's cache now, or once the last step in flight that computes it is committed."""
        steps = [s.output.step for s in self._in_flight if request_id in s.requests]
        if steps:
            self._frees_after_step.setdefault(max(steps), []).append(request_id)
        else:
            self.cache_manager.free(request_id)
