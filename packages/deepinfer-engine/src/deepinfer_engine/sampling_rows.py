"""Sampling inputs and outputs of the model runner beyond the sampler: prompt-logprob rows, grammar bitmasks, and
the log-probs greedy rows report.

Prompt logprobs: for a request that asks for them, every prompt position of a prefill chunk that has a
next prompt token gets a logits row after the step's sampling rows (`add_prompt_rows`); right after the forward the
processed log-prob of that next token under the request's own sampling parameters is computed and copied to the host
without blocking (`prompt_logprob_values`). The runner reports the values with the step.

Structured output: the grammar matcher of a request must have accepted every earlier token before it can fill the
request's bitmask rows, one per verify row and one for the fresh row (`fill_bitmask`, on the CPU while the forward
runs); a matcher that rejects a committed token fails its request for the step.

Greedy rows (temperature 0) report the model's own log-probs — the log-softmax of the raw logits — for the emitted
token and its alternatives (`model_logprobs_for_greedy_rows`) and for prompt tokens, as vLLM does: their processed
distribution is one-hot, whose 0.0 / −9999 says nothing about the model. Sampled rows report processed log-probs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from deepinfer_engine.outputs import RequestFailure, SchedulerOutput
from deepinfer_engine.request import RequestStatus
from deepinfer_engine.runner_state import RunnerRequest, StepHandle
from deepinfer_sampling import LOGPROB_FLOOR, Sampler, SamplingBatch, SamplingRow
from deepinfer_sampling.logprobs import top_logprobs

__all__ = ["add_prompt_rows", "fill_bitmask", "model_logprobs_for_greedy_rows", "prompt_logprob_values"]


def add_prompt_rows(
    scheduler_output: SchedulerOutput,
    requests: Mapping[str, RunnerRequest],
    handle: StepHandle,
    logits_rows: torch.Tensor,
    num_rows: int,
) -> int:
    """Append a logits row for each computed prompt position whose next prompt token exists (recorded in
    `handle.prompt_rows`); returns the number of logits rows."""
    offset = 0
    for scheduled in scheduler_output.scheduled_requests:
        request = requests[scheduled.request_id]
        start = scheduled.num_computed_tokens
        last = min(start + scheduled.num_scheduled_tokens, request.prompt_len - 1)  # exclusive
        if request.params.prompt_logprobs and start < last:
            count = last - start
            logits_rows[num_rows : num_rows + count] = torch.arange(offset, offset + count, dtype=torch.int64)
            handle.prompt_rows.extend((scheduled.request_id, p + 1) for p in range(start, last))
            num_rows += count
        offset += scheduled.num_scheduled_tokens
    return num_rows


def prompt_logprob_values(
    sampler: Sampler, logits: torch.Tensor, handle: StepHandle, requests: Mapping[str, RunnerRequest]
) -> torch.Tensor:
    """Processed log-prob of each prompt row's next prompt token, in host memory (pinned and filled by a
    non-blocking copy on CUDA: valid once the step's `forward_done` event completed).

    Args:
        sampler: the runner's sampler.
        logits: [Q, V] fp32, one row per `handle.prompt_rows` entry.
        handle: the step.
        requests: the runner's requests.
    """
    rows, targets = [], []
    for request_id, position in handle.prompt_rows:
        request = requests[request_id]
        rows.append(SamplingRow(params=request.params, seed=request.seed, position=position))
        targets.append(request.tokens[position])
    device = logits.device
    batch = SamplingBatch.build(rows, sampler.vocab_size, device)
    logprobs, _ = sampler.processed_logprobs(logits, batch)
    if any(row.params.is_greedy for row in rows):  # greedy requests report the model's own (module docstring)
        greedy = batch.temperature == 0
        logprobs = torch.where(greedy[:, None], torch.log_softmax(logits.float(), dim=-1), logprobs)
    target_ids = torch.tensor(targets, dtype=torch.int64)
    if device.type == "cuda":
        target_ids = target_ids.pin_memory().to(device, non_blocking=True)
    values = logprobs.gather(1, target_ids[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
    if device.type != "cuda":
        return values.clone()
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def fill_bitmask(
    rows: list[tuple[int, RunnerRequest, str, int, list[int]]],
    num_rows: int,
    vocab_size: int,
    device: torch.device,
    failed: Collection[str],
    failures: dict[str, RequestFailure],
) -> torch.Tensor:
    """Advance each structured request's matcher to its sampling position and fill its mask rows (CPU): its first
    row with the matcher's state there, row j with the state after tentatively accepting drafts 1 … j (rolled back
    afterwards; rows after a draft the grammar rejects stay all-allowed, verification never reaches them).

    Args:
        rows: (first logits row, runner request, request id, position it samples, the drafts it verifies) per
            structured request.
        num_rows: logits rows of the step.
        vocab_size: V.
        device: where the mask goes.
        failed: requests already failed (their rows stay unmasked; their tokens are never reported).
        failures: the step's failures; a matcher that rejects a committed token adds its request here.

    Returns:
        int32 [num_rows, ceil(V / 32)] on `device` (copied without blocking).
    """
    from deepinfer_sampling.structured import StepMaskRequest, allocate_token_bitmask, fill_step_bitmask

    mask = allocate_token_bitmask(num_rows, vocab_size, pin_memory=device.type == "cuda")
    requests = []
    for row, request, request_id, position, drafts in rows:
        if request_id in failed or request_id in failures:
            continue
        matcher = request.matcher
        assert matcher is not None
        target = position - request.prompt_len
        if request.num_fed > target:  # a discarded in-flight token was fed before a preemption
            matcher.rollback(request.num_fed - target)
            request.num_fed = target
        committed = request.tokens[request.prompt_len + request.num_fed : position]
        request.num_fed = target
        requests.append(StepMaskRequest(request_id, matcher, row, committed, drafts))
    for request_id, error in fill_step_bitmask(mask, requests).items():
        failures[request_id] = RequestFailure(
            RequestStatus.FINISHED_STRUCTURED_OUTPUT_FAILED, f"structured output failed ({error.kind}): {error.message}"
        )
    return mask.to(device, non_blocking=True)


def model_logprobs_for_greedy_rows(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    tokens: torch.Tensor,
    token_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reported log-probs with greedy rows' replaced by the model's own (see the module docstring).

    Args:
        logits: [R, V] fp32 raw logits of the rows.
        greedy: [R] bool, rows sampled at temperature 0.
        tokens: [R] int64 emitted tokens (−1 on rows with none).
        token_logprobs: [R] float32 their processed log-probs.
        top_ids, top_values: [R, N] the processed top-N alternatives.

    Returns:
        (token_logprobs, top_ids, top_values), greedy rows from log-softmax(logits), clamped to >= −9999.
    """
    raw = torch.log_softmax(logits.float(), dim=-1)
    raw_token = raw.gather(1, tokens.clamp(min=0)[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
    token_logprobs = torch.where(greedy & (tokens >= 0), raw_token, token_logprobs)
    if top_ids.shape[1]:
        raw_ids, raw_values = top_logprobs(raw, top_ids.shape[1])
        top_ids = torch.where(greedy[:, None], raw_ids, top_ids)
        top_values = torch.where(greedy[:, None], raw_values, top_values)
    return token_logprobs, top_ids, top_values
