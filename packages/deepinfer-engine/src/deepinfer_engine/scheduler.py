"""The scheduler: each step decides how many tokens every request computes, and commits what the model emitted.

CPU only and deterministic: the same calls in the same order give the same schedules. There are no separate prefill
and decode phases; a step mixes prompt chunks, single decode tokens and draft tokens to verify, under two limits:
the token budget `max_num_batched_tokens` and `max_num_seqs` requests holding cache.

One step of `schedule()`:

1. Running requests, in serve order: first those with one known token left to compute (decode), then those still
   prefilling; within each, fewest generated tokens first (ties: earlier arrival first). Each gets
   `min(remaining tokens + allowed drafts, budget left, max_model_len - computed)` tokens and the cache for them.
   When the cache is full, the *victim order* of runtime §6.6 applies: the not-yet-scheduled running request with
   the most generated tokens (ties: latest arrival) is preempted, the request being served itself only when no
   other candidate is left. Requests already scheduled this step keep their cache.
2. Waiting requests, FCFS with head-of-line blocking, only if nothing was preempted this step: the head is admitted
   when a request slot is free, the cache can hold its whole known sequence now, and budget is left; it gets a
   chunk of at most the remaining budget (chunked prefill).

Preemption (recompute): the request's cache is released, `num_computed_tokens` drops to 0 and it goes back to the
head of the waiting queue with its generated tokens kept; when it runs again it recomputes prompt + outputs as one
long prompt. With `stop_preempted_requests` it finishes with "insufficient_system_resource" instead.

`update_from_output()` commits each request's emitted tokens one at a time and checks, after each, in this order
(runtime §6.8): EOS unless ignore_eos → "stop"; a stop token id → "stop"; the engine's stop checker (stop strings
on detokenized text) → "stop"; total length > max_model_len → "length"; generated tokens == max_tokens → "length".
Tokens after the first stop are dropped. Rejected draft tokens are rolled back in the cache.

Driving loop (synchronous):

    while scheduler.has_unfinished_requests():
        scheduler_output = scheduler.schedule()
        runner_output = runner.execute(scheduler_output)     # an empty ModelRunnerOutput when nothing is scheduled
        outputs = scheduler.update_from_output(scheduler_output, runner_output, stop_checker)

Asynchronous scheduling (runtime §6.9; driven by `deepinfer_engine.engine_core`): `schedule()` may be called once
more before the previous step's `update_from_output`, and steps are committed in the order they were scheduled.
A request whose sampling step is still in flight is scheduled with placeholders: one token (the one that step
samples) plus `max_num_draft_tokens` drafts (the ones it proposes), all of them read by the runner on the device;
its `num_computed_tokens` assumes the drafts in flight are accepted, and the cache reserves for that worst case. A
request that the step in flight surely finishes (max_tokens, max_model_len) is not scheduled again; one that it
finishes by a stop token is, and that extra result is discarded. When the step in flight cannot get its worst-case
cache, it waits for the results instead of preempting itself. Cache of a request that finishes (or is aborted)
while a step that computes it is in flight is freed only once that step is committed, so a step in flight never
computes into cache the scheduler has handed out again; preemption frees at once (the space is needed now) and
relies on the device running steps in launch order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_engine.cache_manager import AllocationResult, CacheManager
from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.outputs import (
    PLACEHOLDER_TOKEN_ID,
    CompletionOutput,
    ModelRunnerOutput,
    RequestMetrics,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer_engine.request import Request, RequestStatus

__all__ = ["Scheduler", "StopChecker"]

StopChecker = Callable[[Request], str | None]
"""Called after each token appended to a request (it is `request.last_token_id`) unless an earlier stop condition
already finished the request; returns the stop string found in the request's detokenized text, or None."""


@dataclass(frozen=True)
class _StepInFlight:
    """A scheduled step whose results are not committed yet."""

    output: SchedulerOutput
    requests: dict[str, ScheduledRequest]


class Scheduler:
    """Continuous-batching scheduler over one `CacheManager`.

    Args:
        config: step limits.
        cache_manager: the cache the scheduled requests live in.
    """

    def __init__(self, config: SchedulerConfig, cache_manager: CacheManager) -> None:
        limit = cache_manager.max_backtracking_tokens
        if limit is not None and config.max_num_draft_tokens > limit:
            raise ValueError(
                f"max_num_draft_tokens {config.max_num_draft_tokens} exceeds the {limit} backtracking tokens the "
                f"cache rings are sized for"
            )
        self.config = config
        self.cache_manager = cache_manager
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, int] = {}
        self._num_arrivals = 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._finished_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []
        self._step = 0
        self._in_flight: deque[_StepInFlight] = deque()
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
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        return request

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
        max_positions = min(request.num_prompt_tokens + request.stop.max_tokens - 1, self.config.max_model_len)
        if request.num_prompt_tokens > self.config.max_model_len or not self.cache_manager.can_ever_fit(max_positions):
            self._pending_outputs.append(self._finish(request, RequestStatus.FINISHED_IGNORED, self._step))
            return
        self._waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus, error_message: str | None = None) -> None:
        """Finish an unfinished request from outside (abort, structured-output failure, runner error).

        Its cache is released and its final output is returned by the next `update_from_output`.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        request = self.get_request(request_id)
        self._pending_outputs.append(self._finish(request, status, self._step, error_message=error_message))

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
        serve = sorted(self._running, key=lambda r: (self._num_remaining(r) > 1, self._victim_key(r)))
        for request in serve:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new, num_drafts = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue  # its step in flight must be committed first
            allocation = self._allocate_or_preempt(request, num_new, victims, scheduled_ids, preempted, step)
            if allocation is None:
                continue  # the request itself was preempted
            scheduled.append(self._scheduled(request, num_new, num_drafts, False, allocation, step))
            scheduled_ids.add(request.request_id)
            budget -= num_new

        while not preempted and self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if not self.cache_manager.can_allocate(request.request_id, request.num_tokens):
                break  # head-of-line blocking keeps admission FCFS
            num_new, num_drafts = self._num_new_tokens(request, budget)
            allocation = self.cache_manager.allocate(request.request_id, num_new)
            if allocation is None:
                raise RuntimeError(f"request {request.request_id!r}: allocation failed after can_allocate")
            self._waiting.popleft()
            request.set_status(RequestStatus.RUNNING)
            self._running.append(request)
            scheduled.append(self._scheduled(request, num_new, num_drafts, True, allocation, step))
            budget -= num_new

        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        output = SchedulerOutput(step, tuple(scheduled), finished_ids, tuple(preempted))
        self._in_flight.append(_StepInFlight(output, {s.request_id: s for s in scheduled}))
        return output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        stop_checker: StopChecker | None = None,
    ) -> list[RequestOutput]:
        """Commit the runner's results for `scheduler_output` and return this step's outputs.

        Outputs of requests that finished outside a step (ignored, aborted, failed) come first, then one per
        scheduled request that emitted tokens, in batch order. Steps are committed in the order they were
        scheduled; nothing changes when the runner output is rejected.

        Args:
            scheduler_output: the output of the matching `schedule()` call.
            runner_output: the runner's results, index-aligned with `scheduler_output.scheduled_requests`.
            stop_checker: the engine's stop-string check (see `StopChecker`); None when no request has stop strings.
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
            self._check_result(request, scheduled, runner_output.sampled_token_ids[index])
            valid.append((index, request, scheduled))
        self._in_flight.popleft()
        outputs, self._pending_outputs = self._pending_outputs, []
        for index, request, scheduled in valid:
            sampled = runner_output.sampled_token_ids[index]
            logprobs = runner_output.logprobs[index] if runner_output.logprobs is not None else None
            drafts = runner_output.draft_token_ids[index] if runner_output.draft_token_ids is not None else ()
            output = self._commit(request, scheduled, sampled, logprobs, drafts, scheduler_output.step, stop_checker)
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

    @staticmethod
    def _num_remaining(request: Request) -> int:
        """Known or in-flight tokens of the request whose cache is not written or reserved yet."""
        return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens

    def _num_new_tokens(self, request: Request, budget: int) -> tuple[int, int]:
        """Tokens to compute this step and how many of them are draft tokens; (0, 0) to skip the request."""
        remaining = self._num_remaining(request)
        num_drafts = 0
        if remaining == 1:
            in_flight = request.num_output_placeholders > 0
            # The step in flight appends at least one token.
            min_num_outputs = request.num_output_tokens + int(in_flight)
            if in_flight and (
                min_num_outputs >= request.stop.max_tokens or request.num_tokens + 1 > self.config.max_model_len
            ):
                return 0, 0  # the step in flight surely finishes it
            # In flight, the drafts are the ones that step proposes (a drafter proposes max_num_draft_tokens).
            num_available = self.config.max_num_draft_tokens if in_flight else len(request.draft_token_ids)
            # Drafts beyond the last token the request may still emit would be wasted.
            num_drafts = min(
                num_available, self.config.max_num_draft_tokens, request.stop.max_tokens - min_num_outputs - 1
            )
        num_new = min(remaining + num_drafts, budget, self.config.max_model_len - request.num_computed_tokens)
        if num_new <= 0:
            return 0, 0  # optimistic positions of a request in flight reached max_model_len
        return num_new, max(0, num_new - remaining)

    def _scheduled(
        self,
        request: Request,
        num_new: int,
        num_drafts: int,
        is_new: bool,
        allocation: AllocationResult,
        step: int,
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        num_known = request.num_tokens + request.num_output_placeholders
        num_placeholders = 0
        if request.num_output_placeholders:
            # Every input comes from the sampling step in flight, which covered all known tokens.
            num_placeholders = num_new
            inputs = (PLACEHOLDER_TOKEN_ID,) * num_new
        else:
            known = request.token_ids(start, start + num_new - num_drafts)
            inputs = tuple(known + request.draft_token_ids[:num_drafts])
        request.num_computed_tokens += num_new
        samples_token = request.num_computed_tokens - num_drafts >= num_known
        if samples_token:
            request.num_output_placeholders += 1 + num_drafts
        if request.first_scheduled_step is None:
            request.first_scheduled_step = step
        return ScheduledRequest(
            request_id=request.request_id,
            is_new=is_new,
            input_token_ids=inputs,
            num_computed_tokens=start,
            num_draft_tokens=num_drafts,
            samples_token=samples_token,
            num_prompt_tokens=request.num_prompt_tokens,
            state_slot=allocation.state_slot,
            first_new_block_index=allocation.first_new_block_index,
            new_block_ids=allocation.new_block_ids,
            num_placeholder_tokens=num_placeholders,
        )

    def _preempt(self, request: Request, step: int) -> None:
        self._running.remove(request)
        self.cache_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        if self.config.stop_preempted_requests:
            self._pending_outputs.append(self._finish(request, RequestStatus.FINISHED_PREEMPTED, step))
            return
        request.set_status(RequestStatus.PREEMPTED)
        self._waiting.appendleft(request)

    @staticmethod
    def _verified_drafts(request: Request, scheduled: ScheduledRequest) -> tuple[int, ...]:
        """The draft tokens the step verified for the request (placeholders: the ones committed before it)."""
        num_drafts = scheduled.num_draft_tokens
        if scheduled.num_placeholder_tokens:
            return tuple(request.draft_token_ids[:num_drafts])
        return scheduled.input_token_ids[len(scheduled.input_token_ids) - num_drafts :]

    def _check_result(self, request: Request, scheduled: ScheduledRequest, sampled: tuple[int, ...]) -> None:
        """Raise ValueError when the runner's tokens for one request cannot be the result of `scheduled`."""
        request_id = request.request_id
        if not scheduled.samples_token:
            if sampled:
                raise ValueError(f"request {request_id!r}: runner sampled {sampled} for a partial prompt chunk")
            return
        num_drafts = scheduled.num_draft_tokens
        if not 1 <= len(sampled) <= num_drafts + 1:
            raise ValueError(
                f"request {request_id!r}: runner emitted {len(sampled)} tokens, expected 1 .. {num_drafts + 1}"
            )
        verified = self._verified_drafts(request, scheduled)
        if len(verified) < num_drafts:
            raise ValueError(
                f"request {request_id!r}: the step verified {num_drafts} draft placeholders but the runner proposed "
                f"only {len(verified)} drafts in the step before; a drafter must propose max_num_draft_tokens"
            )
        num_accepted = len(sampled) - 1
        if tuple(sampled[:num_accepted]) != verified[:num_accepted]:
            raise ValueError(
                f"request {request_id!r}: accepted tokens {sampled[:num_accepted]} differ from the drafts {verified}"
            )

    def _num_tokens_in_later_steps(self, request_id: str) -> int:
        """Tokens of the request reserved by steps in flight (the step being committed is no longer listed)."""
        return sum(s.requests[request_id].num_scheduled_tokens for s in self._in_flight if request_id in s.requests)

    def _commit(
        self,
        request: Request,
        scheduled: ScheduledRequest,
        sampled: tuple[int, ...],
        logprobs: tuple[float, ...] | None,
        drafts: tuple[int, ...],
        step: int,
        stop_checker: StopChecker | None,
    ) -> RequestOutput | None:
        """Append one request's emitted tokens (checked by `_check_result`); returns its output, or None for a
        prompt chunk that sampled nothing."""
        request_id = request.request_id
        if not scheduled.samples_token:
            return None
        num_drafts = scheduled.num_draft_tokens
        num_accepted = len(sampled) - 1
        request.num_output_placeholders -= 1 + num_drafts
        request.num_verified_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += num_accepted
        num_rejected = num_drafts - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            self.cache_manager.rollback(request_id, num_rejected, self._num_tokens_in_later_steps(request_id))
        request.draft_token_ids = []
        if request.first_token_step is None:
            request.first_token_step = step
        num_emitted = 0
        finish: tuple[RequestStatus, int | str | None] | None = None
        for token_id in sampled:
            request.append_output_token(token_id, logprobs[num_emitted] if logprobs is not None else None)
            num_emitted += 1
            finish = self._check_stop(request, token_id, stop_checker)
            if finish is not None:
                break
        new_tokens = tuple(sampled[:num_emitted])
        new_logprobs = tuple(logprobs[:num_emitted]) if logprobs is not None else None
        if finish is None:
            request.draft_token_ids = list(drafts)
            return RequestOutput(request_id, new_tokens, new_logprobs, request.num_output_tokens)
        status, stop_reason = finish
        return self._finish(request, status, step, new_tokens, new_logprobs, stop_reason)

    def _check_stop(
        self, request: Request, token_id: int, stop_checker: StopChecker | None
    ) -> tuple[RequestStatus, int | str | None] | None:
        stop = request.stop
        if token_id == stop.eos_token_id and not stop.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token_id in stop.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token_id
        if stop_checker is not None:
            stop_string = stop_checker(request)
            if stop_string is not None:
                return RequestStatus.FINISHED_STOPPED, stop_string
        if request.num_tokens > self.config.max_model_len or request.num_output_tokens >= stop.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None

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
        metrics = RequestMetrics(
            arrival_step=request.arrival_step,
            first_scheduled_step=request.first_scheduled_step,
            first_token_step=request.first_token_step,
            finished_step=step,
            num_preemptions=request.num_preemptions,
            num_verified_draft_tokens=request.num_verified_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_draft_tokens,
        )
        reason = status.finish_reason
        assert reason is not None  # status.is_finished was checked by set_status's transition table
        completion = CompletionOutput(
            request_id=request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            token_ids=tuple(request.output_token_ids),
            logprobs=tuple(request.output_logprobs) if request.output_logprobs else None,
            finish_reason=reason,
            stop_reason=stop_reason,
            error_message=error_message,
            metrics=metrics,
        )
        return RequestOutput(request_id, new_token_ids, new_logprobs, request.num_output_tokens, reason, completion)

    def _release_cache(self, request_id: str) -> None:
        """Free a finished request's cache now, or once the last step in flight that computes it is committed."""
        steps = [s.output.step for s in self._in_flight if request_id in s.requests]
        if steps:
            self._frees_after_step.setdefault(max(steps), []).append(request_id)
        else:
            self.cache_manager.free(request_id)
