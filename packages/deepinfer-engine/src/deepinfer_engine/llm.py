"""`LLM`: offline batch generation — tokenize → add requests → step until done → detokenize.

    llm = LLM()                                   # the built-in tiny checkpoint; LLM("/path/or/hub-id") otherwise
    outputs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))
    print(outputs[0].text, outputs[0].finish_reason)

Construction reads the environment once (`deepinfer_engine.envs.read_env`), resolves the checkpoint
(`deepinfer_engine.model_source`), loads the model and tokenizer, sizes the cache and builds the scheduler, the
model runner and the engine core (`EngineConfig` holds every setting).

`generate` returns exactly one `GenerateOutput` per prompt, in input order. A prompt that cannot run — empty, token
ids outside the vocabulary, parameters that fail validation, a grammar that fails to compile, a prompt longer than
`max_model_len` — finishes with an error finish reason and a message; every other request is unaffected. Requests
with structured output are admitted once their grammar has compiled (compiled in the background, runtime §4.2).

Seeds: each request's seed is `deepinfer_sampling.request_seed(seq_seed, index_in_call=prompt index,
engine_seed=seed, request_counter=request number)`, so a `SamplingParams` shared by many prompts still gives each its
own random stream, and the same `seq_seed` reproduces a call exactly.

Parallel: with `data_parallel_size`, `expert_parallel_size` or `context_parallel_size` > 1 the engine runs in rank
processes (`deepinfer_engine.executor`: prompts assigned to attention-DP ranks round-robin, routed experts sharded over
the EP ranks, prefill chunks split over the CP ranks, ranks stepping in lockstep — `deepinfer_engine.worker`; on CUDA
rank r uses GPU r and NCCL); request ids and seeds are those of one process, so greedy and seeded outputs match it.
The LLM process then holds only the tokenizer (no `model`, `runner` or `config`), and no progress bar is shown.
Expert-parallel ranks balance their experts' load when the EPLB variables ask for it (`deepinfer_engine.eplb`;
`eplb_stats` reports what they did).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer_engine._prompts import ParamsLike, as_params, normalize_prompts, per_prompt_params
from deepinfer_engine.cache_manager import CacheManager
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine_args import EngineArgs, build_engine_config
from deepinfer_engine.engine_core import EngineCore, ModelRunnerProtocol
from deepinfer_engine.envs import EnvSettings, read_env
from deepinfer_engine.eplb import EplbController, EplbSettings, EplbStats, backbone_moes
from deepinfer_engine.generate_output import GenerateMetrics, GenerateOutput
from deepinfer_engine.model_loading import cache_budget_bytes, load_model
from deepinfer_engine.model_runner import ModelRunner, StepHandle
from deepinfer_engine.model_source import resolve_checkpoint
from deepinfer_engine.outputs import CompletionOutput, RequestOutput
from deepinfer_engine.progress import GenerateProgress
from deepinfer_engine.request import FinishReason, Request, StopCriteria
from deepinfer_engine.scheduler import Scheduler
from deepinfer_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer_engine.worker import LockstepRunner
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_parallel.groups import RankGroup
from deepinfer_sampling import SamplingParams, request_seed

if TYPE_CHECKING:  # importing xgrammar takes seconds; it is imported on the first structured request
    from deepinfer_engine.executor import ParallelExecutor
    from deepinfer_sampling.structured import GrammarCompilationService, RequestGrammarMatcher

__all__ = ["LLM"]


@dataclasses.dataclass
class _Live:
    """Bookkeeping of one request of the current `generate` call."""

    index: int
    prompt: str | None
    params: SamplingParams
    request: Request
    arrival: float
    first_token: float | None = None


class LLM:
    """Offline engine over one checkpoint.

    Args:
        model: checkpoint directory or Hugging Face repo id; None for the built-in tiny checkpoint (written on
            first use into ~/.cache/deepinfer, or `cache_dir`).
        **kwargs: any `deepinfer_engine.engine_args.EngineArgs` field (tokenizer, seed, max_model_len,
            gpu_memory_utilization, cache_memory_bytes, block_size, max_num_seqs, max_num_batched_tokens, parallel
            sizes, enforce_eager, precision, device, async_scheduling, cache_dir, num_cache_blocks).

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: an invalid argument or environment variable (the message names it).
        deepinfer_model.loading.errors.CheckpointError: the checkpoint cannot be found or is incomplete.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        env = read_env()
        if "nextn" not in kwargs:
            kwargs = {**kwargs, "nextn": env["DEEPINFER_USE_NEXTN_DECODE"]}
        args = EngineArgs.from_kwargs(model, kwargs)
        eplb = EplbSettings.from_env(env)
        cache_root = Path(args.cache_dir) if args.cache_dir is not None else None
        model_dir = resolve_checkpoint(
            args.model, local_model_dir=env["DEEPINFER_HF_MODEL_DIR"], revision=args.revision, cache_root=cache_root
        )
        self._executor: ParallelExecutor | None = None
        self._request_counter = 0
        self._grammar_service: GrammarCompilationService | None = None
        if args.data_parallel_size > 1 or args.expert_parallel_size > 1 or args.context_parallel_size > 1:
            # Imported here: the executor's rank processes import this module.
            from deepinfer_engine.executor import ParallelExecutor

            self.tokenizer = Tokenizer(args.tokenizer if args.tokenizer is not None else model_dir)
            device = args.device if args.device is not None else _default_device()
            self._executor = ParallelExecutor(dataclasses.replace(args, device=device), model_dir, eplb)
            return
        self._build(args, env, model_dir, None, None, eplb)

    @classmethod
    def for_rank(
        cls,
        args: EngineArgs,
        model_dir: Path,
        expert_parallel: ExpertParallelMoE,
        vote_group: RankGroup,
        eplb: EplbSettings,
    ) -> LLM:
        """The engine of one rank of a parallel world (`deepinfer_engine.worker`): its own scheduler, cache and
        runner, the experts `expert_parallel` places here, steps kept in lockstep over `vote_group`, and an EPLB
        controller when `eplb` has rearrangement on and the EP group has more than one rank."""
        llm = cls.__new__(cls)
        llm._executor = None
        llm._request_counter = 0
        llm._grammar_service = None
        llm._build(args, read_env(), model_dir, expert_parallel, vote_group, eplb)
        return llm

    def _build(
        self,
        args: EngineArgs,
        env: EnvSettings,
        model_dir: Path,
        expert_parallel: ExpertParallelMoE | None,
        vote_group: RankGroup | None,
        eplb: EplbSettings,
    ) -> None:
        device = torch.device(args.device if args.device is not None else _default_device())
        self.tokenizer = Tokenizer(args.tokenizer if args.tokenizer is not None else model_dir)
        self.model = load_model(
            model_dir,
            self.tokenizer,
            args.precision,
            device,
            env["DEEPINFER_ENGRAM_PAD_TOKEN"],
            expert_parallel,
            max_backtracking_tokens=args.nextn + 1,
        )
        text = self.model.config.text
        spec = self.model.cache_spec()
        budget = 0  # unused when the number of blocks is given
        if args.num_cache_blocks is None:
            budget = cache_budget_bytes(
                self.model,
                device,
                explicit_bytes=args.cache_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                profile_num_tokens=args.max_num_batched_tokens or min(text.max_position_embeddings, 8192),
                profile_num_logits=args.max_num_seqs * (1 + args.nextn),  # verify rows with drafts
                block_size=args.block_size,
            )
        self.config: EngineConfig = build_engine_config(
            args,
            env,
            model_dir=model_dir,
            device=str(device),
            max_position_embeddings=text.max_position_embeddings,
            cache_spec=spec,
            cache_budget_bytes=budget,
        )
        config = self.config
        state = self.model.allocate_state(
            config.cache.block_size, config.num_blocks, config.cache.num_state_slots, device
        )
        self.cache_manager = CacheManager(spec, config.cache, config.num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.cache_manager)
        self.runner = ModelRunner(self.model, state, config)
        self._lockstep: LockstepRunner | None = None
        self._eplb: EplbController | None = None
        if expert_parallel is not None and eplb.schedule is not None and expert_parallel.group.size > 1:
            moes = backbone_moes(self.model)
            self._eplb = EplbController(eplb.schedule, eplb.rearrange_after_prefill, expert_parallel, moes)
        core_runner: ModelRunnerProtocol[StepHandle] = self.runner
        if vote_group is not None:
            self._lockstep = LockstepRunner(self.runner, self.model, state, vote_group, self._eplb)
            core_runner = self._lockstep
        self.core: EngineCore[StepHandle] = EngineCore(
            self.scheduler,
            core_runner,
            # One forward per step on every rank: the asynchronous loop's collect-only steps would break lockstep.
            async_scheduling=config.async_scheduling and self._lockstep is None,
            stop_checker=self._check_stop,
        )
        self.vocab_size = text.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.model.config.eos_token_id
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    # ---- public API ------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: ParamsLike | Sequence[ParamsLike] = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[GenerateOutput]:
        """Generate for every prompt; one output per prompt, in input order.

        Args:
            prompts: a text prompt or a list of them.
            sampling_params: one `SamplingParams` (or dict of its fields) for all prompts, or one per prompt; None
                for the defaults.
            prompt_token_ids: token-id prompts; when both are given they must have equal lengths and ids win.
            use_tqdm: show a progress bar and print a summary line to stderr at the end.

        Raises:
            ValueError: no prompts, mismatched list lengths. (Problems of one prompt do not raise: that prompt's
                output carries the error.)
        """
        texts, ids = normalize_prompts(prompts, prompt_token_ids)
        num = len(ids)
        per_prompt = per_prompt_params(sampling_params, num)
        first_request_id = self._request_counter
        self._request_counter += num
        if self._executor is not None:
            return self._executor.generate(texts, ids, per_prompt, first_request_id)
        return self.run_prompts(list(range(num)), texts, ids, per_prompt, first_request_id, use_tqdm)

    def run_prompts(
        self,
        indices: Sequence[int],
        texts: Sequence[str | None],
        ids: Sequence[Sequence[int] | None],
        params: Sequence[ParamsLike],
        first_request_id: int,
        use_tqdm: bool,
    ) -> list[GenerateOutput]:
        """Run some prompts of one `generate` call to completion; one output per prompt, in the given order.

        Args:
            indices: each prompt's index in the call (it keys the request seed; the request id is
                `first_request_id + index`).
            texts, ids, params: each prompt's text, token ids and sampling parameters (aligned with `indices`).
            first_request_id: the request number of the call's first prompt.
            use_tqdm: show a progress bar.
        """
        results: dict[int, GenerateOutput] = {}
        live: dict[str, _Live] = {}
        pending: dict[str, _Live] = {}
        progress = GenerateProgress(len(indices), use_tqdm)
        for index, text, token_ids, params_like in zip(indices, texts, ids, params, strict=True):
            rejected = self._add(
                index, str(first_request_id + index), text, token_ids, params_like, live, pending, progress
            )
            if rejected is not None:
                results[index] = rejected
                progress.update(0, 1)
        try:
            while self._any_busy(bool(pending) or self.core.has_unfinished_requests()):
                if pending:
                    wait_s = 0.0 if self.core.has_unfinished_requests() else 0.05
                    for index, rejected in self._admit_compiled(pending, live, wait_s):
                        results[index] = rejected
                        progress.update(0, 1)
                if not self.core.has_unfinished_requests():
                    if self._lockstep is not None:
                        self._lockstep.pad_step()
                    continue
                for output in self.core.step():
                    self._collect(output, live, results, progress)
                for request_id, failure in self.runner.take_failures().items():
                    if request_id in live and not live[request_id].request.is_finished:
                        self.scheduler.finish_request(request_id, failure.status, failure.message)
        finally:
            progress.close(len(indices))
        assert len(results) == len(indices), "a request finished without an output"
        return [results[index] for index in indices]

    def eplb_stats(self) -> list[EplbStats]:
        """What expert-parallel load balancing did so far: one entry per rank (in rank order) of a parallel engine
        whose EP ranks balance load; empty when EPLB is inactive (rearrangement off, EP size 1, one process).

        Raises:
            RuntimeError: a rank failed (its traceback is in the message).
        """
        if self._executor is not None:
            return self._executor.eplb_stats()
        return [self._eplb.stats()] if self._eplb is not None else []

    def close(self) -> None:
        """Stop the grammar compile threads and the rank processes, and release this engine's CUDA graphs."""
        if self._grammar_service is not None:
            self._grammar_service.shutdown()
            self._grammar_service = None
        if self._executor is not None:
            self._executor.close()
        else:
            self.runner.close()

    def _any_busy(self, busy: bool) -> bool:
        """Whether this engine (or, on a rank, any rank) has work left."""
        return self._lockstep.any_busy(busy) if self._lockstep is not None else busy

    # ---- adding requests -------------------------------------------------------------------------------------

    def _add(
        self,
        index: int,
        request_id: str,
        text: str | None,
        token_ids: Sequence[int] | None,
        params_like: ParamsLike,
        live: dict[str, _Live],
        pending: dict[str, _Live],
        progress: GenerateProgress,
    ) -> GenerateOutput | None:
        """Validate and queue one prompt; returns its output at once when it is rejected."""
        now = time.perf_counter()
        try:
            params = as_params(params_like)
            ids = list(token_ids) if token_ids is not None else self.tokenizer.encode(text or "")
            self._check_prompt(ids)
            if params.n != 1:
                raise ValueError(f"n={params.n}: LLM.generate returns one sample per prompt; only n=1 is supported")
        except (TypeError, ValueError) as exc:
            prompt_ids = tuple(token_ids) if isinstance(token_ids, Sequence) else ()
            return _rejected(request_id, text, prompt_ids, FinishReason.ERROR, str(exc), now)
        if self.eos_token_id is not None:
            params = dataclasses.replace(params, eos_id=self.eos_token_id)
        stop = StopCriteria(
            max_tokens=params.max_tokens,
            eos_token_id=self.eos_token_id,
            ignore_eos=params.ignore_eos,
            stop_token_ids=frozenset(params.stop_token_ids),
        )
        request = Request(request_id, ids, stop)
        progress.num_prompt_tokens += len(ids)
        entry = _Live(index, text, params, request, now)
        if params.stop:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        if params.so_args is not None:
            self._grammars().submit(request_id, params.so_args)
            pending[request_id] = entry
            return None
        self._enqueue(entry, None, live)
        return None

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")

    def _enqueue(self, entry: _Live, matcher: RequestGrammarMatcher | None, live: dict[str, _Live]) -> None:
        request = entry.request
        seed = request_seed(
            entry.params.seq_seed,
            index_in_call=entry.index,
            engine_seed=self.config.seed,
            request_counter=int(request.request_id),
        )
        self.runner.add_request(request.request_id, entry.params, seed, request.prompt_token_ids, matcher)
        live[request.request_id] = entry
        self.core.add_request(request)

    def _grammars(self) -> GrammarCompilationService:
        if self._grammar_service is None:
            from deepinfer_sampling.structured import GrammarCompilationService, build_tokenizer_info

            info = build_tokenizer_info(
                self.tokenizer.encoded_vocab(),
                self.tokenizer.vocab_type,
                self.vocab_size,
                [self.eos_token_id] if self.eos_token_id is not None else [],
            )
            self._grammar_service = GrammarCompilationService(info, self.config.structured_output)
        return self._grammar_service

    def _admit_compiled(
        self, pending: dict[str, _Live], live: dict[str, _Live], wait_s: float
    ) -> list[tuple[int, GenerateOutput]]:
        """Enqueue requests whose grammar compiled; returns outputs of those whose compilation failed."""
        failed = []
        for result in self._grammars().poll(wait_s):
            entry = pending.pop(result.request_id)
            if result.matcher is not None:
                self._enqueue(entry, result.matcher, live)
                continue
            self._detokenizers.pop(result.request_id, None)
            error = result.error
            assert error is not None  # a build result carries exactly one of matcher and error
            message = f"structured output failed ({error.kind}): {error.message}"
            request = entry.request
            output = _rejected(
                request.request_id,
                entry.prompt,
                tuple(request.prompt_token_ids),
                FinishReason.STRUCTURED_OUTPUT_FAILED,
                message,
                entry.arrival,
            )
            failed.append((entry.index, output))
        return failed

    # ---- collecting outputs ----------------------------------------------------------------------------------

    def _check_stop(self, request: Request) -> str | None:
        detokenizer = self._detokenizers.get(request.request_id)
        return detokenizer.append(request.last_token_id) if detokenizer is not None else None

    def _collect(
        self,
        output: RequestOutput,
        live: dict[str, _Live],
        results: dict[int, GenerateOutput],
        progress: GenerateProgress,
    ) -> None:
        entry = live.get(output.request_id)
        if entry is None:
            return
        now = time.perf_counter()
        if output.new_token_ids and entry.first_token is None:
            entry.first_token = now
        progress.update(len(output.new_token_ids), int(output.completion is not None))
        if output.completion is None:
            return
        del live[output.request_id]
        self._detokenizers.pop(output.request_id, None)
        results[entry.index] = self._final(entry, output.completion, now)

    def _final(self, entry: _Live, completion: CompletionOutput, now: float) -> GenerateOutput:
        tokens = completion.token_ids
        text = self.tokenizer.decode(list(tokens))
        if isinstance(completion.stop_reason, str) and completion.stop_reason in text:
            text = text[: text.index(completion.stop_reason)]
        top = self.runner.top_logprobs(completion.request_id, len(tokens)) if entry.params.top_logprobs else []
        message = completion.error_message
        if completion.finish_reason is FinishReason.PROMPT_LENGTH_EXCEEDED:
            message = (
                f"prompt of {len(completion.prompt_token_ids)} tokens exceeds max_model_len="
                f"{self.config.scheduler.max_model_len}, or its longest sequence cannot fit in the cache"
            )
        decode_rate = None
        if entry.first_token is not None and len(tokens) > 1 and now > entry.first_token:
            decode_rate = (len(tokens) - 1) / (now - entry.first_token)
        metrics = GenerateMetrics(
            num_prompt_tokens=len(completion.prompt_token_ids),
            num_generated_tokens=len(tokens),
            time_to_first_token_s=None if entry.first_token is None else entry.first_token - entry.arrival,
            decode_tokens_per_s=decode_rate,
            wall_time_s=now - entry.arrival,
            num_preemptions=completion.metrics.num_preemptions,
            num_accepted_draft_tokens=completion.metrics.num_accepted_draft_tokens,
            num_verified_draft_tokens=completion.metrics.num_verified_draft_tokens,
        )
        return GenerateOutput(
            request_id=completion.request_id,
            prompt=entry.prompt,
            prompt_token_ids=completion.prompt_token_ids,
            text=text,
            token_ids=tokens,
            logprobs=completion.logprobs or (),
            top_logprobs=tuple(top) if top else tuple(() for _ in tokens),
            prompt_logprobs=tuple(self.runner.prompt_logprobs(completion.request_id))
            if entry.params.prompt_logprobs
            else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            error_message=message,
            metrics=metrics,
        )


def _default_device() -> str:
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    return "cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"


def _rejected(
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
