"""Stage-boundary records of one engine step.

    request → Request → Scheduler.schedule() → SchedulerOutput → ModelRunner → ForwardBatch → model → logits
            → Sampler → SamplerOutput → ModelRunnerOutput → Scheduler.update_from_output() → RequestOutput
            → OutputProcessor → GenerateOutput

- `SchedulerOutput` (CPU, this module): per scheduled request, which positions it computes this step, the input
  token ids for them, and the cache entries it newly got; the first time a request is scheduled also what the
  runner needs to serve it (`NewRequestData`: parameters, seed, prompt, grammar). Nothing reaches the runner any
  other way.
- The model runner turns it into a `ForwardBatch` (model package) in persistent device buffers, runs the model and
  the sampler (`SamplerOutput`, sampling package), and reports back a `ModelRunnerOutput` (this module): per request
  the emitted tokens, their logprobs and top logprobs, the prompt logprobs computed this step, the drafter's next
  draft tokens, and the requests it could not serve (`RequestFailure`). Nothing leaves the runner any other way.
- `Scheduler.update_from_output` commits those tokens, finishes failed requests, applies the stop conditions and
  returns one `RequestOutput` per request that emitted tokens or finished. A finished request's `RequestOutput`
  also carries its whole `CompletionOutput`.

Positions of one scheduled request (`c` = num_computed_tokens before the step, `n` = num_scheduled_tokens,
`d` = num_draft_tokens):

    position:   c      c+1    ...    c+n-d-1 | c+n-d  ...  c+n-1
    input:      known tokens (prompt/output) | draft tokens to verify
    sampling:   a token is sampled only when c + n - d reaches the request's known length (`samples_token`):
                the runner then emits the accepted drafts (<= d) followed by one sampled token.

Placeholders (asynchronous scheduling, see `deepinfer_engine.engine_core`): a request may be scheduled again while
its previous step is still running on the device. Its inputs are then not known on the host: `input_token_ids`
holds `PLACEHOLDER_TOKEN_ID` for each of its `num_placeholder_tokens` inputs, and the runner takes them from the
previous step's results in device memory: the last token that step emitted for the request, then the first
`num_placeholder_tokens - 1` draft tokens it proposed. `num_computed_tokens` is then optimistic (it assumes every
draft of the previous step was accepted); the true first position is `num_computed_tokens` minus the number of
drafts the previous step rejected for the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer_engine.request import FinishReason, RequestStatus, TopLogprobs
from deepinfer_sampling import SamplingParams

if TYPE_CHECKING:  # importing xgrammar takes seconds; it is imported on the first structured request
    from deepinfer_sampling.structured import RequestGrammarMatcher

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "CompletionOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "RequestFailure",
    "RequestMetrics",
    "RequestOutput",
    "ScheduledRequest",
    "SchedulerOutput",
]

PLACEHOLDER_TOKEN_ID = -1
"""Stands for an input token that only the device knows yet (see "Placeholders" above)."""


@dataclass(frozen=True)
class NewRequestData:
    """What the runner needs to serve a request, sent the first time the request is scheduled.

    Attributes:
        params: its sampling parameters.
        seed: its request seed.
        prompt_token_ids: its prompt.
        grammar: its grammar matcher when it has structured output (the runner advances it).
    """

    params: SamplingParams
    seed: int
    prompt_token_ids: tuple[int, ...]
    grammar: RequestGrammarMatcher | None = None


@dataclass(frozen=True)
class RequestFailure:
    """Why the runner could not serve a request in a step; the scheduler finishes it with `status`."""

    status: RequestStatus
    message: str


@dataclass(frozen=True)
class ScheduledRequest:
    """What one request computes in a step.

    Attributes:
        request_id: the request.
        is_new: the runner has no state for this request yet: first schedule, or first after a preemption (all
            earlier cache contents are gone and `num_computed_tokens` is 0).
        input_token_ids: `[num_scheduled_tokens]` token ids at positions `num_computed_tokens ...`; the last
            `num_draft_tokens` of them are draft tokens.
        num_computed_tokens: tokens already in the cache before this step (= position of the first input).
        num_draft_tokens: draft tokens among the inputs, to be verified.
        samples_token: whether this step reaches the end of the known tokens, so the runner samples (a partial
            prompt chunk samples nothing).
        num_prompt_tokens: the request's prompt length (positions below it are prompt tokens).
        num_known_tokens: the request's tokens known when the step was scheduled (prompt, outputs and outputs in
            flight): YOCO prefill truncation keeps the tail of that length (docs/design/attention.md, "YOCO prefill
            truncation"); 0 truncates nothing.
        state_slot: the request's state slot (sliding-window rings and compressor state).
        first_new_block_index: index in the request's block table where `new_block_ids` start; the table holds
            exactly `first_new_block_index + len(new_block_ids)` blocks after this step's allocation (entries
            at and after this index that the runner knew before were released by a rollback).
        new_block_ids: blocks appended to the block table for this step (all blocks when `is_new`).
        num_placeholder_tokens: inputs the runner takes from the previous step's results on the device (0, or all
            inputs: the previous step's last emitted token, then `num_draft_tokens` of its draft tokens); when
            non-zero, `num_computed_tokens` is optimistic (see the module docstring).
    """

    request_id: str
    is_new: bool
    input_token_ids: tuple[int, ...]
    num_computed_tokens: int
    num_draft_tokens: int
    samples_token: bool
    num_prompt_tokens: int
    state_slot: int
    first_new_block_index: int
    new_block_ids: tuple[int, ...]
    num_placeholder_tokens: int = 0
    new_request: NewRequestData | None = None
    num_known_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed for this request this step."""
        return len(self.input_token_ids)

    @classmethod
    def whole_prompt(
        cls,
        request_id: str,
        prompt: tuple[int, ...],
        state_slot: int,
        block_ids: tuple[int, ...],
        params: SamplingParams,
        seed: int,
    ) -> ScheduledRequest:
        """A new request whose whole prompt runs in this step and samples its first token (what start-up
        measurements schedule without a scheduler)."""
        return cls(
            request_id=request_id,
            is_new=True,
            input_token_ids=prompt,
            num_computed_tokens=0,
            num_draft_tokens=0,
            samples_token=True,
            num_prompt_tokens=len(prompt),
            state_slot=state_slot,
            first_new_block_index=0,
            new_block_ids=block_ids,
            new_request=NewRequestData(params, seed, prompt),
        )


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the model runner needs to run one step.

    Attributes:
        step: scheduler step counter (0-based).
        scheduled_requests: requests computed this step, in batch order.
        finished_request_ids: requests that finished or were aborted since the previous step; the runner drops
            their state.
        preempted_request_ids: requests preempted while scheduling this step; their cache is released and the
            runner drops their state (they come back later with `is_new`).
    """

    step: int
    scheduled_requests: tuple[ScheduledRequest, ...]
    finished_request_ids: frozenset[str]
    preempted_request_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed this step over all requests."""
        return sum(r.num_scheduled_tokens for r in self.scheduled_requests)

    @property
    def is_empty(self) -> bool:
        """Whether no request computes anything this step."""
        return not self.scheduled_requests


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the runner reports for one step, index-aligned with `SchedulerOutput.scheduled_requests`.

    Attributes:
        request_ids: ids in the order of the scheduled requests.
        sampled_token_ids: per request, the accepted draft tokens followed by the one sampled token; empty when
            the request's `samples_token` was False.
        logprobs: per request, the logprob of each emitted token, or None when the runner computes none.
        draft_token_ids: per request, draft tokens proposed for the next step, or None without a drafter. Under
            asynchronous scheduling the next step may verify up to `max_num_draft_tokens` of them as placeholders
            before the host sees them, so a drafter proposes that many for every request it samples.
        top_logprobs: per request, the alternatives of each emitted token (empty tuples where none were asked
            for), or None when the runner computes none.
        draft_confidences: per request, the drafter's confidence (conditional acceptance probability) of each of
            its `draft_token_ids`, or None without a drafter (docs/design/speculative.md, "Confidence-scheduled
            verification").
        prompt_logprobs: per request, the (prompt position, processed log-prob of its token) pairs computed this
            step (requests that asked for prompt logprobs), or None.
        failures: requests of the step the runner could not serve (nothing to sample, a grammar that rejected a
            token); their `sampled_token_ids` are empty and the scheduler finishes them with the failure.
    """

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...] | None = None
    draft_token_ids: tuple[tuple[int, ...], ...] | None = None
    top_logprobs: tuple[tuple[TopLogprobs, ...], ...] | None = None
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    failures: dict[str, RequestFailure] = field(default_factory=dict)
    draft_confidences: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        names = ("sampled_token_ids", "logprobs", "draft_token_ids", "top_logprobs", "prompt_logprobs")
        for name in (*names, "draft_confidences"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"ModelRunnerOutput.{name} has {len(value)} entries for {n} requests")
        if self.logprobs is not None:
            rows = zip(self.request_ids, self.sampled_token_ids, self.logprobs, strict=True)
            for request_id, tokens, logprobs in rows:
                if len(tokens) != len(logprobs):
                    raise ValueError(
                        f"request {request_id!r}: {len(logprobs)} logprobs for {len(tokens)} sampled tokens"
                    )


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request counters, in scheduler steps so they are deterministic.

    Attributes:
        arrival_step: step at which the request was added.
        first_scheduled_step: first step that computed any of its tokens (None if it never ran).
        first_token_step: step whose output carried its first generated token.
        finished_step: step at which it finished.
        num_preemptions: times it was preempted.
        num_verified_draft_tokens: draft tokens verified over its lifetime.
        num_accepted_draft_tokens: of those, the accepted ones.
        num_sampling_steps: steps that sampled a token for it.
    """

    arrival_step: int
    first_scheduled_step: int | None
    first_token_step: int | None
    finished_step: int | None
    num_preemptions: int
    num_verified_draft_tokens: int
    num_accepted_draft_tokens: int
    num_sampling_steps: int


@dataclass(frozen=True)
class CompletionOutput:
    """The whole result of one finished request.

    Attributes:
        request_id: the request.
        prompt_token_ids: its prompt.
        token_ids: every generated token (a stop token is included).
        logprobs: logprob of each generated token, or None when the runner reported none.
        top_logprobs: per generated token, its alternatives (empty tuples where none were asked for; empty when the
            runner reported none).
        prompt_logprobs: processed log-probs of prompt tokens 1 … P−1 when the request asked for them, else None.
        finish_reason: why it finished.
        stop_reason: the stop token id or stop string that finished it; None otherwise (EOS included).
        error_message: what went wrong, for error finish reasons.
        metrics: its counters.
        text: detokenized `token_ids`; the scheduler leaves it empty and the engine's `OutputProcessor` fills it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    top_logprobs: tuple[TopLogprobs, ...]
    prompt_logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    error_message: str | None
    metrics: RequestMetrics
    text: str = ""


@dataclass(frozen=True)
class RequestOutput:
    """What one request produced in one step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens emitted this step (may be empty for a request finished without running).
        new_logprobs: their logprobs, or None when the runner reported none.
        num_output_tokens: generated tokens so far, these included.
        finish_reason: set on the request's last output only.
        completion: the whole result, set on the request's last output only.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...] | None
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    completion: CompletionOutput | None = None

    @property
    def finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None
