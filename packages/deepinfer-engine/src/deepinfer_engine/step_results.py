"""Checking and packaging a step's results for one request: is the runner's answer possible, and the final output.

`check_result` guards the scheduler against a runner that emits tokens a step cannot have produced (tokens for a
partial prompt chunk, more tokens than drafts + 1, accepted tokens that are not the verified drafts).
`append_emitted` appends a step's tokens one at a time with the token-level stop checks.
`completion_of` builds a finished request's `CompletionOutput` from its record.
"""

from __future__ import annotations

from deepinfer_engine.outputs import CompletionOutput, RequestMetrics, ScheduledRequest
from deepinfer_engine.request import FinishReason, Request, RequestStatus, TopLogprobs

__all__ = ["append_emitted", "check_result", "completion_of", "verified_drafts"]


def verified_drafts(request: Request, scheduled: ScheduledRequest) -> tuple[int, ...]:
    """The draft tokens the step verified for the request (placeholders: the ones committed before it)."""
    num_drafts = scheduled.num_draft_tokens
    if scheduled.num_placeholder_tokens:
        return tuple(request.draft_token_ids[:num_drafts])
    return scheduled.input_token_ids[len(scheduled.input_token_ids) - num_drafts :]


def check_result(request: Request, scheduled: ScheduledRequest, sampled: tuple[int, ...]) -> None:
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
    verified = verified_drafts(request, scheduled)
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


def append_emitted(
    request: Request,
    sampled: tuple[int, ...],
    logprobs: tuple[float, ...] | None,
    top: tuple[TopLogprobs, ...] | None,
    max_model_len: int,
) -> tuple[int, tuple[RequestStatus, int | str | None] | None]:
    """Append the emitted tokens until one stops the request; returns how many were appended and, when one stopped
    it, the finished status and stop reason.

    After each token, in this order: EOS unless ignore_eos → "stop"; a stop token id → "stop" (the id is the stop
    reason); total length > max_model_len or generated tokens == max_tokens → "length".
    """
    stop = request.stop
    for num_emitted, token_id in enumerate(sampled, start=1):
        request.append_output_token(
            token_id,
            logprobs[num_emitted - 1] if logprobs is not None else None,
            top[num_emitted - 1] if top is not None else None,
        )
        if token_id == stop.eos_token_id and not stop.ignore_eos:
            return num_emitted, (RequestStatus.FINISHED_STOPPED, None)
        if token_id in stop.stop_token_ids:
            return num_emitted, (RequestStatus.FINISHED_STOPPED, token_id)
        if request.num_tokens > max_model_len or request.num_output_tokens >= stop.max_tokens:
            return num_emitted, (RequestStatus.FINISHED_LENGTH_CAPPED, None)
    return len(sampled), None


def completion_of(request: Request, reason: FinishReason, step: int) -> CompletionOutput:
    """The whole result of `request`, which finished with `reason` at `step` (text left to the output processor)."""
    metrics = RequestMetrics(
        arrival_step=request.arrival_step,
        first_scheduled_step=request.first_scheduled_step,
        first_token_step=request.first_token_step,
        finished_step=step,
        num_preemptions=request.num_preemptions,
        num_verified_draft_tokens=request.num_verified_draft_tokens,
        num_accepted_draft_tokens=request.num_accepted_draft_tokens,
        num_sampling_steps=request.num_sampling_steps,
    )
    prompt_logprobs = None
    if request.params.prompt_logprobs:
        positions = range(1, request.num_prompt_tokens)
        prompt_logprobs = tuple(request.prompt_logprobs[p] for p in positions if p in request.prompt_logprobs)
    return CompletionOutput(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        token_ids=tuple(request.output_token_ids),
        logprobs=tuple(request.output_logprobs) if request.output_logprobs else None,
        top_logprobs=tuple(request.output_top_logprobs),
        prompt_logprobs=prompt_logprobs,
        finish_reason=reason,
        stop_reason=request.stop_reason,
        error_message=request.error_message,
        metrics=metrics,
    )
