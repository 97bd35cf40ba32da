"""The output stage: scheduler `RequestOutput`s → `GenerateOutput`s, with text, stop strings and wall-clock metrics.

`OutputProcessor` holds the output-side record of each request of a `generate` call (its index in the call, text
prompt, arrival time, first-token time and `IncrementalDetokenizer`). For each `RequestOutput` of a step it

1. detokenizes the new tokens, once, token by token;
2. when the text now holds one of the request's stop strings, reports a `StopStringHit`: the engine ends the request
   with `Scheduler.finish_request` (status "stop", the tokens after the match dropped), the path every finish from
   outside a step takes; the text is cut right before the stop string;
3. when the request finished, builds its `GenerateOutput` from the scheduler's `CompletionOutput` (filling
   `CompletionOutput.text`) and the wall-clock metrics, and forgets the request.

A finished output whose last tokens completed a stop string (the step that matched it also ended the request by
length, or emitted drafts past it) ends with "stop" and that string too, as if the string had been checked after
each token, before the length limit; an EOS or stop token on the very token that completed it keeps its own reason.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from deepinfer_engine.generate_output import GenerateMetrics, GenerateOutput
from deepinfer_engine.outputs import CompletionOutput, RequestOutput
from deepinfer_engine.progress import GenerateProgress
from deepinfer_engine.request import FinishReason
from deepinfer_engine.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["OutputProcessor", "StopStringHit", "rejected_output"]


@dataclass(frozen=True)
class StopStringHit:
    """A request whose text reached a stop string: keep its first `num_output_tokens` tokens, stop with `stop`."""

    request_id: str
    stop: str
    num_output_tokens: int


@dataclass
class _Tracked:
    index: int
    prompt: str | None
    arrival: float
    detokenizer: IncrementalDetokenizer
    first_token: float | None = None
    hit: StopStringHit | None = None


class OutputProcessor:
    """Output-side records of the requests in flight (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def add(self, request_id: str, index: int, prompt: str | None, stop: tuple[str, ...], arrival: float) -> None:
        """Track a request admitted into the engine (`index`: its place in the `generate` call)."""
        self._tracked[request_id] = _Tracked(index, prompt, arrival, IncrementalDetokenizer(self.tokenizer, stop))

    def process(
        self, outputs: list[RequestOutput], progress: GenerateProgress
    ) -> tuple[list[tuple[int, GenerateOutput]], list[StopStringHit]]:
        """One step's outputs → the finished requests' (index, output) pairs and the new stop-string hits."""
        finished: list[tuple[int, GenerateOutput]] = []
        hits: list[StopStringHit] = []
        now = time.perf_counter()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.new_token_ids and tracked.first_token is None:
                tracked.first_token = now
            detokenizer = tracked.detokenizer
            num_before = output.num_output_tokens - len(output.new_token_ids)
            num_kept = 0  # tokens up to and with a stop string's last token: what the output will hold
            for offset, token_id in enumerate(output.new_token_ids):
                if tracked.hit is None:
                    num_kept += 1
                stop = detokenizer.append(token_id)
                if stop is not None and tracked.hit is None:
                    tracked.hit = StopStringHit(output.request_id, stop, num_before + offset + 1)
                    if output.completion is None:
                        hits.append(tracked.hit)
            progress.update(num_kept, int(output.completion is not None))
            if output.completion is not None:
                del self._tracked[output.request_id]
                final = self._final(tracked, output.completion, now)
                metrics = final.metrics
                progress.count_drafts(
                    metrics.num_sampling_steps, metrics.num_accepted_draft_tokens, metrics.num_verified_draft_tokens
                )
                finished.append((tracked.index, final))
        return finished, hits

    def _final(self, tracked: _Tracked, completion: CompletionOutput, now: float) -> GenerateOutput:
        completion = _apply_stop_string(completion, tracked.hit)
        completion = dataclasses.replace(completion, text=tracked.detokenizer.final_text())
        tokens = completion.token_ids
        decode_rate = None
        if tracked.first_token is not None and len(tokens) > 1 and now > tracked.first_token:
            decode_rate = (len(tokens) - 1) / (now - tracked.first_token)
        metrics = GenerateMetrics(
            num_prompt_tokens=len(completion.prompt_token_ids),
            num_generated_tokens=len(tokens),
            time_to_first_token_s=None if tracked.first_token is None else tracked.first_token - tracked.arrival,
            decode_tokens_per_s=decode_rate,
            wall_time_s=now - tracked.arrival,
            num_preemptions=completion.metrics.num_preemptions,
            num_accepted_draft_tokens=completion.metrics.num_accepted_draft_tokens,
            num_verified_draft_tokens=completion.metrics.num_verified_draft_tokens,
            num_sampling_steps=completion.metrics.num_sampling_steps,
        )
        return GenerateOutput(
            request_id=completion.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=completion.prompt_token_ids,
            text=completion.text,
            token_ids=tokens,
            logprobs=completion.logprobs or (),
            top_logprobs=completion.top_logprobs or tuple(() for _ in tokens),
            prompt_logprobs=completion.prompt_logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            error_message=completion.error_message,
            metrics=metrics,
        )


def _apply_stop_string(completion: CompletionOutput, hit: StopStringHit | None) -> CompletionOutput:
    """The completion as ended by the stop string `hit` (see the module docstring)."""
    if hit is None or completion.stop_reason == hit.stop:
        return completion
    n = hit.num_output_tokens
    token_level_stop = completion.finish_reason is FinishReason.STOP and len(completion.token_ids) == n
    if token_level_stop or completion.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return completion
    return dataclasses.replace(
        completion,
        token_ids=completion.token_ids[:n],
        logprobs=completion.logprobs[:n] if completion.logprobs is not None else None,
        top_logprobs=completion.top_logprobs[:n],
        finish_reason=FinishReason.STOP,
        stop_reason=hit.stop,
    )


def rejected_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: tuple[int, ...],
    reason: FinishReason,
    message: str,
    arrival: float,
) -> GenerateOutput:
    """The output of a request that never ran."""
    metrics = GenerateMetrics(
        num_prompt_tokens=len(prompt_token_ids),
        num_generated_tokens=0,
        time_to_first_token_s=None,
        decode_tokens_per_s=None,
        wall_time_s=time.perf_counter() - arrival,
    )
    return GenerateOutput(request_id, prompt, prompt_token_ids, "", (), (), (), None, reason, None, message, metrics)
