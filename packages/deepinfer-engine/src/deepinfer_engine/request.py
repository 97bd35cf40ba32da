"""A request inside the engine: its tokens, progress, status state machine and stop criteria.

`num_computed_tokens` is the one progress counter: the number of leading tokens of the request (prompt, then
generated tokens) whose cache entries have been written, or are being written by the step in flight. The scheduler
advances it when it schedules a step and lowers it when draft tokens are rejected or the request is preempted.

Status state machine (docs/design/scheduler.md, "Request lifecycle"):

    WAITING ──schedule──► RUNNING ──preempt──► PREEMPTED ──schedule──► RUNNING
       │                     │                     │
       └──────────┬──────────┴──────────┬──────────┘
                  ▼                     ▼
     FINISHED_IGNORED / ABORTED   FINISHED_STOPPED / LENGTH_CAPPED / ABORTED / PREEMPTED / ERROR / ...

A finished status is final. FINISHED_IGNORED is reachable only before the request ever ran.

Under asynchronous scheduling a request may be scheduled while its previous step is still in flight; the scheduler
then counts that step's sampled tokens as *output placeholders* (`num_output_placeholders`: the most tokens the
steps in flight may still append) and `num_computed_tokens` optimistically assumes every draft is accepted. Both are
corrected when the step's results are committed.

Glossary:
- draft tokens: tokens proposed by the drafter for the next step; verified by the target model, accepted ones are
  appended and rejected ones rolled back.
- output placeholder: a generated token that a step in flight will append but the host does not know yet.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer_sampling import SamplingParams

if TYPE_CHECKING:  # importing xgrammar takes seconds; it is imported on the first structured request
    from deepinfer_sampling.structured import RequestGrammarMatcher

__all__ = ["FinishReason", "Request", "RequestStatus", "StopCriteria", "TopLogprobs"]

TopLogprobs = tuple[tuple[int, float], ...]
"""The best (token id, log-prob) pairs of one sampled position."""


class FinishReason(enum.Enum):
    """Why a request finished; values are the `finish_reason` strings (docs/design/scheduler.md, "Request outputs")."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    PROMPT_LENGTH_EXCEEDED = "prompt_length_exceeded"
    INSUFFICIENT_SYSTEM_RESOURCE = "insufficient_system_resource"
    STRUCTURED_OUTPUT_FAILED = "xgrammar runtime errors or timeout"
    ERROR = "error"


class RequestStatus(enum.Enum):
    """Where a request is in its lifecycle."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_IGNORED = "finished_ignored"
    FINISHED_PREEMPTED = "finished_preempted"
    FINISHED_STRUCTURED_OUTPUT_FAILED = "finished_structured_output_failed"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """Whether the status is final."""
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The reason reported for a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.PROMPT_LENGTH_EXCEEDED,
    RequestStatus.FINISHED_PREEMPTED: FinishReason.INSUFFICIENT_SYSTEM_RESOURCE,
    RequestStatus.FINISHED_STRUCTURED_OUTPUT_FAILED: FinishReason.STRUCTURED_OUTPUT_FAILED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

_ERROR_STATUSES = frozenset(
    {RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_STRUCTURED_OUTPUT_FAILED, RequestStatus.FINISHED_IGNORED}
)

_FINISHED_AFTER_RUNNING = frozenset(_FINISH_REASONS) - {RequestStatus.FINISHED_IGNORED}

_ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset(_FINISH_REASONS) | {RequestStatus.RUNNING},
    RequestStatus.RUNNING: _FINISHED_AFTER_RUNNING | {RequestStatus.PREEMPTED},
    RequestStatus.PREEMPTED: _FINISHED_AFTER_RUNNING | {RequestStatus.RUNNING},
}


@dataclass(frozen=True)
class StopCriteria:
    """A request's token-level stop conditions (docs/design/scheduler.md, "Stop conditions"), built from its params.

    Stop strings are not here: they need detokenized text; the engine's output processor finds them and finishes
    the request through `Scheduler.finish_request`, like any other finish from outside a step.

    Attributes:
        max_tokens: generated tokens after which the request finishes with "length".
        eos_token_id: tokenizer EOS id; None when the tokenizer has none.
        ignore_eos: EOS does not stop the request.
        stop_token_ids: further token ids that stop the request with "stop" (emitted, like EOS).
    """

    max_tokens: int = 16
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class Request:
    """One generation request and its progress: the one record of a request inside the engine.

    It carries everything the model runner needs to serve it (sampling parameters, seed, prompt, grammar matcher);
    the scheduler hands these to the runner the first time it schedules the request (`NewRequestData`).

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt; must be non-empty.
        stop: stop conditions.
        params: its sampling parameters.
        seed: its request seed (`deepinfer_sampling.request_seed`).
        grammar: its grammar matcher when it has structured output.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        stop: StopCriteria,
        *,
        params: SamplingParams | None = None,
        seed: int = 0,
        grammar: RequestGrammarMatcher | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt must not be empty")
        self.request_id = request_id
        self.stop = stop
        self.params = params if params is not None else SamplingParams()
        self.seed = seed
        self.grammar = grammar
        self.output_top_logprobs: list[TopLogprobs] = []
        self.prompt_logprobs: dict[int, float] = {}  # prompt position -> processed log-prob of its token
        self.num_prompt_tokens = len(prompt_token_ids)
        self._token_ids = list(prompt_token_ids)
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        self.draft_token_ids: list[int] = []
        self.draft_confidences: list[float] = []  # the drafter's confidence of each draft token (same length)
        self.num_output_placeholders = 0
        self._status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error_message: str | None = None
        # Step counters for metrics, filled in by the scheduler.
        self.arrival_step = 0
        self.first_scheduled_step: int | None = None
        self.first_token_step: int | None = None
        self.finished_step: int | None = None
        self.num_preemptions = 0
        self.num_verified_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.num_sampling_steps = 0

    def count_sampling_step(self, num_verified: int, num_accepted: int) -> None:
        """Count one step that sampled for this request: the drafts it verified and how many it accepted."""
        self.num_verified_draft_tokens += num_verified
        self.num_accepted_draft_tokens += num_accepted
        self.num_sampling_steps += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self._status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

    @property
    def status(self) -> RequestStatus:
        """Current status; change it with `set_status`."""
        return self._status

    def set_status(self, status: RequestStatus, error_message: str | None = None) -> None:
        """Move to `status`, which must be allowed from the current one.

        Args:
            status: the new status.
            error_message: why the request failed; only for FINISHED_ERROR, FINISHED_STRUCTURED_OUTPUT_FAILED and
                FINISHED_IGNORED (why it could never run).
        """
        if status not in _ALLOWED_TRANSITIONS.get(self._status, frozenset()):
            raise ValueError(f"request {self.request_id!r}: illegal status change {self._status.name} -> {status.name}")
        if error_message is not None and status not in _ERROR_STATUSES:
            raise ValueError(f"request {self.request_id!r}: an error message needs an error status, got {status.name}")
        self._status = status
        self.error_message = error_message

    @property
    def is_finished(self) -> bool:
        """Whether the status is final."""
        return self._status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason once finished, else None."""
        return self._status.finish_reason

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt."""
        return self._token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self._token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        """The most recent token (the last prompt token before any output)."""
        return self._token_ids[-1]

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens at positions `start .. stop - 1` of the prompt-plus-output sequence."""
        return self._token_ids[start:stop]

    def append_output_token(self, token_id: int, logprob: float | None, top: TopLogprobs | None = None) -> None:
        """Append one generated token (and its logprob and alternatives when the runner reports them)."""
        self._token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` generated tokens (a stop string ended the text earlier)."""
        del self._token_ids[self.num_prompt_tokens + num_output_tokens :]
        del self.output_logprobs[num_output_tokens:]
        del self.output_top_logprobs[num_output_tokens:]
