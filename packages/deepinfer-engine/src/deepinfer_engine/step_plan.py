"""Planning one request's share of a step: how many tokens it computes, and the `ScheduledRequest` that says so.

Both are the scheduler's (`deepinfer_engine.scheduler`); they are here because they read and advance only the one
request's counters. Under asynchronous scheduling a request whose sampling step is in flight is planned with
placeholders (outputs.py, "Placeholders"): one token (the one that step samples) plus `max_num_draft_tokens` drafts
(the ones it proposes), all read by the runner on the device, at optimistic positions that assume the drafts in
flight are accepted. A request that the step in flight surely finishes (max_tokens, max_model_len) is not planned
again; one that it finishes by a stop token is, and that extra result is discarded. A request is planned in flight
only when it verifies the drafts synchronous scheduling would verify whatever the step in flight emits: near
max_tokens or max_model_len, where that number depends on the accepted drafts, it waits for the results instead, so
seeded sampling gives the tokens of synchronous scheduling (a verify row and a fresh row draw different random
numbers for the same position).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_engine.cache_manager import AllocationResult
from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.outputs import PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest, SchedulerOutput
from deepinfer_engine.request import Request

__all__ = ["StepInFlight", "num_allowed_drafts", "num_new_tokens", "num_remaining", "scheduled_request"]


@dataclass(frozen=True)
class StepInFlight:
    """A scheduled step whose results are not committed yet: its output and its requests by id."""

    output: SchedulerOutput
    requests: dict[str, ScheduledRequest]


def num_remaining(request: Request) -> int:
    """Known or in-flight tokens of the request whose cache is not written or reserved yet."""
    return request.num_tokens + request.num_output_placeholders - request.num_computed_tokens


def num_allowed_drafts(request: Request, config: SchedulerConfig) -> int | None:
    """Drafts a decoding request (one known token left to compute) may verify this step; None when the step in
    flight surely finishes it (it is then not planned)."""
    in_flight = request.num_output_placeholders > 0
    # The step in flight appends at least one token.
    min_num_outputs = request.num_output_tokens + int(in_flight)
    if in_flight and (min_num_outputs >= request.stop.max_tokens or request.num_tokens + 1 > config.max_model_len):
        return None
    # In flight, the drafts are the ones that step proposes (a drafter proposes max_num_draft_tokens).
    num_available = config.max_num_draft_tokens if in_flight else len(request.draft_token_ids)
    # Drafts beyond the last token the request may still emit would be wasted.
    return min(num_available, config.max_num_draft_tokens, request.stop.max_tokens - min_num_outputs - 1)


def num_new_tokens(
    request: Request, budget: int, config: SchedulerConfig, max_drafts: int | None = None
) -> tuple[int, int]:
    """Tokens to compute this step and how many of them are draft tokens (at most `max_drafts` when given, the
    confidence-scheduled choice); (0, 0) to skip the request."""
    remaining = num_remaining(request)
    num_drafts = 0
    in_flight = request.num_output_placeholders > 0
    max_tokens = request.stop.max_tokens
    if remaining == 1:
        allowed = num_allowed_drafts(request, config)
        if allowed is None:
            return 0, 0  # the step in flight surely finishes it
        num_drafts = allowed if max_drafts is None else min(allowed, max_drafts)
        # The step in flight appends at most all its placeholders.
        max_num_outputs = request.num_output_tokens + request.num_output_placeholders
        if in_flight and max_tokens - max_num_outputs - 1 < num_drafts:
            # How many drafts synchronous scheduling verifies depends on what the step in flight emits, and a
            # verified draft's row draws other random numbers than a fresh row: wait for its results.
            return 0, 0
    room = config.max_model_len - request.num_computed_tokens  # optimistic in flight: at most the true room
    if in_flight and room < remaining + num_drafts:
        return 0, 0  # synchronous scheduling may cut fewer drafts (or none): wait for the results
    num_new = min(remaining + num_drafts, budget, room)
    if num_new <= 0:
        return 0, 0
    return num_new, max(0, num_new - remaining)


def scheduled_request(
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
    new_request = None
    if request.first_scheduled_step is None:
        request.first_scheduled_step = step
        new_request = NewRequestData(request.params, request.seed, tuple(request.prompt_token_ids), request.grammar)
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
        new_request=new_request,
        num_known_tokens=num_known,
    )
