"""State records of the model runner: its view of each request and a launched step.

`RunnerRequest` is kept per request from its first schedule until the request finishes (across preemptions: a
preempted request keeps its host token record and grammar matcher; its cache addressing is reset when it is
scheduled again as new). `StepHandle` is what `ModelRunner.execute` returns and `ModelRunner.wait` consumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer_engine.outputs import RequestFailure, ScheduledRequest, SchedulerOutput
from deepinfer_sampling import SamplingParams

if TYPE_CHECKING:  # importing xgrammar takes seconds; only structured requests need it at run time
    from deepinfer_sampling.structured import RequestGrammarMatcher

__all__ = ["RunnerRequest", "SampledStep", "StepHandle", "copy_to_host", "start_request"]


@dataclass
class RunnerRequest:
    """The runner's view of one request (kept across preemptions; dropped when it finishes)."""

    params: SamplingParams
    seed: int
    prompt_len: int
    matcher: RequestGrammarMatcher | None
    tokens: list[int]  # host copy of the known tokens by position (prompt, then sampled ones)
    num_fed: int = 0  # tokens the matcher has accepted
    slot: int = 0
    block_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [nextn, V] fp32 device: distributions its current drafts came from
    num_rejected: int = 0  # drafts its last waited sampling step rejected (placeholder positions are optimistic)

    @property
    def needs_host_history(self) -> bool:
        """Whether sampling needs the request's earlier tokens on the host (grammar, penalties, or golden tokens:
        the forced token depends on the true number of outputs)."""
        return self.matcher is not None or self.params.has_penalties or self.params.golden_token_ids is not None


@dataclass
class SampledStep:
    """A step's sampling results in host memory (pinned on CUDA); valid once `event` completed."""

    token_ids: torch.Tensor  # [S] int64 host
    logprobs: torch.Tensor  # [S] float32 host
    top_ids: torch.Tensor  # [S, N] int64 host
    top_values: torch.Tensor  # [S, N] float32 host
    event: torch.cuda.Event | None
    num_accepted: torch.Tensor | None = None  # [Q] int64 host: accepted drafts per request (speculative steps)
    draft_ids: torch.Tensor | None = None  # [Q, nextn] int64 host: next drafts per request
    draft_confidences: torch.Tensor | None = None  # [Q, nextn] float32 host: their confidences


@dataclass
class StepHandle:
    """A launched step: what `wait` needs to report it."""

    scheduler_output: SchedulerOutput
    sample_indices: list[int]  # index into scheduled_requests of each sampling request
    sample_positions: list[int]  # first position each sampling request samples (P0)
    num_drafts: list[int] = field(default_factory=list)  # drafts each sampling request verifies (rows = d + 1)
    logits: torch.Tensor | None = None  # [S, V] fp32 while sampling is deferred
    sampled: SampledStep | None = None
    forward_done: torch.cuda.Event | None = None  # CUDA: the step's uploads and forward completed
    prompt_rows: list[tuple[str, int]] = field(default_factory=list)  # (request, prompt position) per prompt row
    prompt_values: torch.Tensor | None = None  # [Q] float32 host, filled by the copy `forward_done` covers
    failures: dict[str, RequestFailure] = field(default_factory=dict)  # requests of the step that failed


def copy_to_host(
    token_ids: torch.Tensor,
    logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
    num_accepted: torch.Tensor | None = None,
    draft_ids: torch.Tensor | None = None,
    draft_confidences: torch.Tensor | None = None,
) -> SampledStep:
    """Start the device-to-host copies of a step's results; the event marks their completion.

    Args:
        token_ids: [S] int64 sampled tokens (one per logits row).
        logprobs: [S] float32 their processed log-probs.
        top_ids: [S, N] int64 best tokens per row.
        top_values: [S, N] float32 their log-probs.
        num_accepted: [Q] int64 accepted drafts per sampling request, speculative steps only.
        draft_ids: [Q, nextn] int64 next drafts per sampling request, speculative steps only.
        draft_confidences: [Q, nextn] float32 their confidences, speculative steps only.
    """
    tensors = [token_ids, logprobs, top_ids, top_values]
    extras = [t for t in (num_accepted, draft_ids, draft_confidences) if t is not None]
    if token_ids.device.type != "cuda":
        host = [t.clone() for t in tensors + extras]
        event = None
    else:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors + extras]
        for dst, src in zip(host, tensors + extras, strict=True):
            dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    accepted, drafts, confidences = (host[4], host[5], host[6]) if extras else (None, None, None)
    return SampledStep(host[0], host[1], host[2], host[3], event, accepted, drafts, confidences)


def start_request(
    requests: dict[str, RunnerRequest], scheduled: ScheduledRequest, max_blocks_per_request: int
) -> RunnerRequest:
    """Apply a scheduled request's slot and block-table delta to the runner's records; returns its record (created
    from the request's `NewRequestData` on first sight)."""
    new = scheduled.new_request
    if new is not None and scheduled.request_id not in requests:
        requests[scheduled.request_id] = RunnerRequest(
            params=new.params,
            seed=new.seed,
            prompt_len=len(new.prompt_token_ids),
            matcher=new.grammar,
            tokens=list(new.prompt_token_ids),
        )
    request = requests.get(scheduled.request_id)
    if request is None:
        raise KeyError(f"request {scheduled.request_id!r} was scheduled without its NewRequestData first")
    if scheduled.is_new:
        request.slot = scheduled.state_slot
        request.block_ids = []
        request.draft_probs = None
    del request.block_ids[scheduled.first_new_block_index :]
    request.block_ids.extend(scheduled.new_block_ids)
    if len(request.block_ids) > max_blocks_per_request:
        raise RuntimeError(
            f"request {scheduled.request_id!r} holds {len(request.block_ids)} blocks; the block table has room "
            f"for {max_blocks_per_request}"
        )
    return request
