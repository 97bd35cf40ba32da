"""`GenerateOutput`: what `LLM.generate` returns for one request, and its wall-clock `GenerateMetrics`.

Every request given to `generate` gets exactly one `GenerateOutput`, in input order, whether it ran to completion
or was rejected (bad prompt, bad parameters, grammar failure): then `finish_reason` says which kind of failure and
`error_message` says what was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_engine.request import FinishReason

__all__ = ["GenerateMetrics", "GenerateOutput"]


@dataclass(frozen=True)
class GenerateMetrics:
    """Wall-clock counters of one request.

    Attributes:
        num_prompt_tokens: prompt length.
        num_generated_tokens: generated tokens.
        time_to_first_token_s: seconds from `generate` adding the request to its first generated token; None if
            it generated nothing.
        decode_tokens_per_s: generated tokens after the first, per second after the first; None with fewer than two.
        wall_time_s: seconds from adding the request to its end.
        num_preemptions: times it was preempted and recomputed.
        num_accepted_draft_tokens: draft tokens accepted by verification (0 without speculative decoding); each
            step emits its accepted drafts plus one sampled token.
        num_verified_draft_tokens: draft positions verified by the target model, >= `num_accepted_draft_tokens`;
            0 without speculative decoding. Under asynchronous scheduling a request that cannot draft (structured
            output, penalties, golden tokens) still computes `nextn` placeholder drafts per step, counted here and
            always rejected.
        num_sampling_steps: steps that sampled tokens for it; mean acceptance length =
            1 + `num_accepted_draft_tokens` / `num_sampling_steps` (drafts a stop condition then cut included).
    """

    num_prompt_tokens: int
    num_generated_tokens: int
    time_to_first_token_s: float | None
    decode_tokens_per_s: float | None
    wall_time_s: float
    num_preemptions: int = 0
    num_accepted_draft_tokens: int = 0
    num_verified_draft_tokens: int = 0
    num_sampling_steps: int = 0


@dataclass(frozen=True)
class GenerateOutput:
    """The result of one request.

    Attributes:
        request_id: the engine's id for it.
        prompt: the text prompt, or None when token ids were given.
        prompt_token_ids: the prompt tokens (empty when they could not be produced).
        text: detokenized `token_ids` (special tokens dropped), cut before a matched stop string.
        token_ids: generated tokens (a stop token included).
        logprobs: log-prob of each generated token: processed (under the request's sampling parameters), or for a
            greedy request (temperature 0) the model's own (log-softmax of its logits).
        top_logprobs: per generated token, the `top_logprobs` best (token id, log-prob) pairs; empty tuples when
            none were asked for.
        prompt_logprobs: log-probs of prompt tokens 1 … P−1, processed under the request's own sampling parameters
            (the model's own for a greedy request), when asked for with `prompt_logprobs=True`; else
            None.
        finish_reason: why it ended.
        stop_reason: the stop token id or stop string that ended it, else None.
        error_message: what went wrong, for error finish reasons (and prompt_length_exceeded).
        metrics: its counters.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    prompt_logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    error_message: str | None
    metrics: GenerateMetrics

    @property
    def ok(self) -> bool:
        """Whether it finished normally (a stop condition or the length limit)."""
        return self.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
