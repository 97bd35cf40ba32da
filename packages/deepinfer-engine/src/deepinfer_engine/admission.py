"""The admission stage: one prompt of a `generate` call → a validated `Request`, or at once its error output.

`Admission.admit` encodes a text prompt, checks the prompt and the sampling parameters, and builds the request's one
record (`deepinfer_engine.request.Request`: stop criteria, sampling parameters, request seed). A request with
structured output waits until its grammar has compiled in the background: `poll` hands it over with
its matcher, or its error output when compilation failed. Nothing about a request is registered anywhere else: the
scheduler gives the runner what it needs the first time it schedules the request.

Seeds: each request's seed is `deepinfer_sampling.request_seed(seq_seed, index_in_call=stream index,
engine_seed=seed, request_counter=request number)`, where the stream index counts the earlier prompts of the call that
share the prompt's parameters object (`deepinfer_engine._prompts.stream_indices`). So a `SamplingParams` shared by
many prompts still gives each its own random stream, a prompt with its own parameters and `seq_seed` gets the same
tokens wherever it sits in the call, and the same `seq_seed` reproduces a call exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer_engine._prompts import ParamsLike, as_params
from deepinfer_engine.generate_output import GenerateOutput
from deepinfer_engine.output_processor import rejected_output
from deepinfer_engine.request import FinishReason, Request, StopCriteria
from deepinfer_engine.tokenizer import Tokenizer
from deepinfer_sampling import request_seed

if TYPE_CHECKING:  # importing xgrammar takes seconds; it is imported on the first structured request
    from deepinfer_sampling.structured import GrammarCompilationService, StructuredOutputConfig

__all__ = ["Admission", "Admitted"]


@dataclass(frozen=True)
class Admitted:
    """A request ready for the scheduler, and what the output stage needs to know about it."""

    index: int
    prompt: str | None
    request: Request
    arrival: float


class Admission:
    """Validates prompts and builds requests for one engine.

    Args:
        tokenizer: the engine tokenizer.
        vocab_size: the model's vocabulary size (prompt ids must lie in [0, vocab_size)).
        eos_token_id: the EOS id requests stop at (None: none).
        engine_seed: the engine seed.
        structured: grammar compilation settings.
        refuses_prompt_logprobs: YOCO prefill truncation is on: the consumer layers skip or narrow the windows of
            early prompt tokens, so their logits are not the model's, and a request asking for prompt logprobs gets
            an error output instead (docs/design/attention.md, "YOCO prefill truncation").
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_id: int | None,
        engine_seed: int,
        structured: StructuredOutputConfig,
        refuses_prompt_logprobs: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.engine_seed = engine_seed
        self.structured = structured
        self.refuses_prompt_logprobs = refuses_prompt_logprobs
        self._grammar_service: GrammarCompilationService | None = None
        self._pending: dict[str, Admitted] = {}

    @property
    def has_pending(self) -> bool:
        """Whether a request waits for its grammar."""
        return bool(self._pending)

    def admit(
        self,
        index: int,
        request_id: str,
        text: str | None,
        token_ids: Sequence[int] | None,
        params_like: ParamsLike,
        stream_index: int,
    ) -> Admitted | GenerateOutput | None:
        """Validate one prompt: its request, its error output when it cannot run, or None while its grammar
        compiles (`poll` hands it over later). `stream_index` keys its seed with `seq_seed` (module docstring)."""
        now = time.perf_counter()
        try:
            params = as_params(params_like)
            ids = list(token_ids) if token_ids is not None else self.tokenizer.encode(text or "")
            self._check_prompt(ids)
            if params.n != 1:
                raise ValueError(f"n={params.n}: LLM.generate returns one sample per prompt; only n=1 is supported")
            if params.prompt_logprobs and self.refuses_prompt_logprobs:
                raise ValueError(
                    "prompt_logprobs=True is not available while YOCO prefill truncation is on "
                    "(DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE): the consumer layers skip or narrow early prompt "
                    "tokens, so their logits are not the model's; unset the variable (or set it to 'off')"
                )
        except (TypeError, ValueError) as exc:
            prompt_ids = tuple(token_ids) if isinstance(token_ids, Sequence) else ()
            return rejected_output(request_id, text, prompt_ids, FinishReason.ERROR, str(exc), now)
        if self.eos_token_id is not None:
            params = dataclasses.replace(params, eos_id=self.eos_token_id)
        stop = StopCriteria(
            max_tokens=params.max_tokens,
            eos_token_id=self.eos_token_id,
            ignore_eos=params.ignore_eos,
            stop_token_ids=frozenset(params.stop_token_ids),
        )
        seed = request_seed(
            params.seq_seed, index_in_call=stream_index, engine_seed=self.engine_seed, request_counter=int(request_id)
        )
        admitted = Admitted(index, text, Request(request_id, ids, stop, params=params, seed=seed), now)
        if params.so_args is None:
            return admitted
        self._grammars().submit(request_id, params.so_args)
        self._pending[request_id] = admitted
        return None

    def poll(self, wait_s: float) -> list[Admitted | tuple[int, GenerateOutput]]:
        """Requests whose grammar compiled (with their matcher), and (index, error output) of those whose grammar
        failed; waits up to `wait_s` seconds for the first result."""
        if not self._pending:
            return []
        ready: list[Admitted | tuple[int, GenerateOutput]] = []
        for result in self._grammars().poll(wait_s):
            admitted = self._pending.pop(result.request_id, None)
            if admitted is None:
                continue  # dropped by `drop_pending`
            if result.matcher is not None:
                admitted.request.grammar = result.matcher
                ready.append(admitted)
                continue
            assert result.error is not None  # a build result carries exactly one of matcher and error
            message = f"structured output failed ({result.error.kind}): {result.error.message}"
            request = admitted.request
            output = rejected_output(
                request.request_id,
                admitted.prompt,
                tuple(request.prompt_token_ids),
                FinishReason.STRUCTURED_OUTPUT_FAILED,
                message,
                admitted.arrival,
            )
            ready.append((admitted.index, output))
        return ready

    def drop_pending(self, message: str) -> list[tuple[int, GenerateOutput]]:
        """Give up on every request still waiting for its grammar: (index, error output) of each."""
        dropped = [
            (
                a.index,
                rejected_output(
                    a.request.request_id,
                    a.prompt,
                    tuple(a.request.prompt_token_ids),
                    FinishReason.ERROR,
                    message,
                    a.arrival,
                ),
            )
            for a in self._pending.values()
        ]
        self._pending.clear()
        return dropped

    def close(self) -> None:
        """Stop the grammar compile threads."""
        if self._grammar_service is not None:
            self._grammar_service.shutdown()
            self._grammar_service = None

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")

    def _grammars(self) -> GrammarCompilationService:
        if self._grammar_service is None:
            from deepinfer_sampling.structured import GrammarCompilationService, build_tokenizer_info

            info = build_tokenizer_info(
                self.tokenizer.encoded_vocab(),
                self.tokenizer.vocab_type,
                self.vocab_size,
                [self.eos_token_id] if self.eos_token_id is not None else [],
            )
            self._grammar_service = GrammarCompilationService(info, self.structured)
        return self._grammar_service
