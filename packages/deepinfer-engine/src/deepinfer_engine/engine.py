"""`Engine`: the engine of one process — build, admit, step loop, outputs.

Built from `EngineArgs` (`LLM` builds one; each rank of a parallel world builds one too, `deepinfer_engine.worker`):
tokenizer, model (`deepinfer_engine.model_loading`), cache budget and `EngineConfig`, cache pools, `CacheManager`,
`Scheduler`, `ModelRunner`, and the `EngineCore` step loop over them. A rank's engine also gets its expert placement
and a vote group: its runner is then wrapped in a `LockstepRunner` (`deepinfer_engine.lockstep`) and it steps
synchronously, one forward per step on every rank.

One `generate` call, stage by stage (docs/architecture.md, "From request to output"):

    prompt ──Admission──► Request ──EngineCore.step: Scheduler → ModelRunner → Scheduler──► RequestOutput
           ──OutputProcessor──► GenerateOutput          (stop-string hits go back as Scheduler.finish_request)

A step that raises (out of memory, a kernel error, KeyboardInterrupt) never breaks the engine: the runner and the
core forget the steps in flight, the scheduler finishes every unfinished request with an "error" finish reason and
frees its cache (`Scheduler.abort_all`), and the call returns those outputs (the error named in each message); a
KeyboardInterrupt is re-raised after that clean-up. The next `generate` then runs exactly like one on a fresh engine.
A rank of a parallel world re-raises at once: its peers wait in collectives, and the executor stops every rank.

Start-up sizing (`deepinfer_engine.startup`): with default arguments the cache budget and the step token budget come
from what the device memory holds after the weights, measured by a profiling step that takes the path of a real
step; `max_model_len` follows from the cache and the checkpoint. The engine logs one line saying what it chose.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from deepinfer_engine._prompts import ParamsLike
from deepinfer_engine.admission import Admission, Admitted
from deepinfer_engine.cache_manager import CacheManager
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.decode_cost import decode_cost_curve
from deepinfer_engine.engine_args import EngineArgs, build_engine_config, prefill_truncation
from deepinfer_engine.engine_core import EngineCore, ModelRunnerProtocol
from deepinfer_engine.envs import EnvSettings
from deepinfer_engine.eplb import EplbController, EplbSettings, EplbStats
from deepinfer_engine.generate_output import GenerateOutput
from deepinfer_engine.lockstep import LockstepRunner
from deepinfer_engine.model_loading import load_model
from deepinfer_engine.model_runner import ModelRunner, StepHandle
from deepinfer_engine.output_processor import OutputProcessor, rejected_output
from deepinfer_engine.progress import GenerateProgress
from deepinfer_engine.request import FinishReason, RequestStatus
from deepinfer_engine.scheduler import Scheduler
from deepinfer_engine.startup import describe, describe_prompt_attention, size_engine
from deepinfer_engine.tokenizer import Tokenizer
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_parallel.groups import RankGroup

__all__ = ["Engine", "resolve_device"]

logger = logging.getLogger(__name__)


def resolve_device(device: str | None) -> str:
    """The engine device: `device`, or "cuda" when the kernels platform is NVIDIA and "cpu" otherwise.

    Raises:
        ValueError: a CUDA device is asked for but no CUDA GPU is visible.
    """
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    if device is None:
        return "cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}, but no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); "
            "use device='cpu', or leave device unset to pick what is there"
        )
    return device


def _log_to_stderr_unless_configured() -> None:
    """Let the engine's INFO lines (what it chose at start-up) reach stderr when the application has not configured
    logging itself."""
    package = logging.getLogger("deepinfer_engine")
    if not package.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        package.addHandler(handler)
        package.setLevel(logging.INFO)


class Engine:
    """The engine of one process over one checkpoint (see the module docstring).

    Args:
        args: the engine arguments.
        env: the parsed environment.
        model_dir: the resolved checkpoint directory.
        expert_parallel: this rank's expert placement (parallel ranks only).
        vote_group: the group whose ranks step in lockstep (parallel ranks only).
        eplb: expert-parallel load balancing settings (an EPLB controller runs when rearrangement is on and the EP
            group has more than one rank).
    """

    def __init__(
        self,
        args: EngineArgs,
        env: EnvSettings,
        model_dir: Path,
        expert_parallel: ExpertParallelMoE | None = None,
        vote_group: RankGroup | None = None,
        eplb: EplbSettings | None = None,
    ) -> None:
        device = torch.device(resolve_device(args.device))
        self.tokenizer = Tokenizer(args.tokenizer if args.tokenizer is not None else model_dir)
        self.model = load_model(
            model_dir,
            self.tokenizer,
            args.precision,
            device,
            env["DEEPINFER_ENGRAM_PAD_TOKEN"],
            expert_parallel,
            max_backtracking_tokens=args.nextn + 1,
            prefill_truncation=prefill_truncation(args, env),
            batch_invariant=env["DEEPINFER_BATCH_INVARIANT"],
            dependent_launch=args.dependent_launch,
            branch_streams=args.branch_streams,
            flashmla=args.flashmla,
        )
        text = self.model.config.text
        spec = self.model.cache_spec()
        sizing = size_engine(self.model, args, env, model_dir, device)
        if sizing.max_num_batched_tokens is not None:
            args = dataclasses.replace(args, max_num_batched_tokens=sizing.max_num_batched_tokens)
        self.config: EngineConfig = build_engine_config(
            args,
            env,
            model_dir=model_dir,
            device=str(device),
            max_position_embeddings=text.max_position_embeddings,
            cache_spec=spec,
            cache_budget_bytes=sizing.cache_budget_bytes,
        )
        config = self.config
        cache_bytes = (
            spec.bytes_per_block(config.cache.block_size) * config.num_blocks
            + spec.bytes_per_request() * config.cache.num_state_slots
        )
        _log_to_stderr_unless_configured()
        logger.info(describe(config, sizing, cache_bytes, text.max_position_embeddings))
        if device.type == "cuda":
            prompt_attention = describe_prompt_attention(
                args, env["DEEPINFER_BATCH_INVARIANT"], device, text.num_attention_heads, text.head_dim
            )
            logger.info(prompt_attention)
        # Measured before the cache is allocated: the measurement runs on a temporary cache of its own.
        verify_cost = decode_cost_curve(self.model, args, env, config) if config.mtp_varlen else None
        state = self.model.allocate_state(
            config.cache.block_size, config.num_blocks, config.cache.num_state_slots, device
        )
        self.cache_manager = CacheManager(spec, config.cache, config.num_blocks)
        self.scheduler = Scheduler(config.scheduler, self.cache_manager, verify_cost)
        self.runner = ModelRunner(self.model, state, config)
        self._eplb: EplbController | None = None
        rearranges = eplb is not None and eplb.schedule is not None
        if expert_parallel is not None and rearranges and expert_parallel.group.size > 1:
            assert eplb is not None and eplb.schedule is not None
            moes = self.model.moe_layers()
            self._eplb = EplbController(eplb.schedule, eplb.rearrange_after_prefill, expert_parallel, moes)
        core_runner: ModelRunnerProtocol[StepHandle] = self.runner
        self._lockstep: LockstepRunner | None = None
        if vote_group is not None:
            self._lockstep = LockstepRunner(self.runner, vote_group, self._eplb)
            core_runner = self._lockstep
        # One forward per step on every rank: the asynchronous loop's collect-only steps would break lockstep.
        async_scheduling = config.async_scheduling and self._lockstep is None
        self.core: EngineCore[StepHandle] = EngineCore(self.scheduler, core_runner, async_scheduling=async_scheduling)
        eos_token_id = self.tokenizer.eos_token_id
        if eos_token_id is None:
            eos_token_id = self.model.config.eos_token_id
        self.admission = Admission(
            self.tokenizer,
            text.vocab_size,
            eos_token_id,
            config.seed,
            config.structured_output,
            refuses_prompt_logprobs=config.prefill_truncation.enabled,
        )
        self.outputs = OutputProcessor(self.tokenizer)

    def generate(
        self,
        indices: Sequence[int],
        texts: Sequence[str | None],
        ids: Sequence[Sequence[int] | None],
        params: Sequence[ParamsLike],
        streams: Sequence[int],
        first_request_id: int,
        use_tqdm: bool,
    ) -> list[GenerateOutput]:
        """Run some prompts of one `generate` call to completion; one output per prompt, in the given order.

        Args:
            indices: each prompt's index in the call (the request id is `first_request_id + index`).
            texts, ids, params: each prompt's text, token ids and sampling parameters (aligned with `indices`).
            streams: each prompt's stream index (`deepinfer_engine._prompts.stream_indices`; with `seq_seed` it keys
                the request seed).
            first_request_id: the request number of the call's first prompt.
            use_tqdm: show a progress bar and a summary line.

        Raises:
            KeyboardInterrupt: after cleaning up (see the module docstring).
        """
        results: dict[int, GenerateOutput] = {}
        progress = GenerateProgress(len(indices), use_tqdm)
        interrupted = False
        try:
            for index, text, token_ids, params_like, stream in zip(indices, texts, ids, params, streams, strict=True):
                request_id = str(first_request_id + index)
                admitted = self.admission.admit(index, request_id, text, token_ids, params_like, stream)
                if isinstance(admitted, GenerateOutput):
                    results[index] = admitted
                    progress.update(0, 1)
                elif admitted is not None:
                    self._enqueue(admitted, progress)
            self._run(results, progress)
        except BaseException as exc:
            if self._lockstep is not None:
                raise
            message = self._recover(exc, results, progress)
            for index, text, token_ids in zip(indices, texts, ids, strict=True):
                if index not in results:  # not admitted yet when the call stopped
                    prompt_ids = tuple(token_ids) if token_ids is not None else ()
                    request_id = str(first_request_id + index)
                    now = time.perf_counter()
                    results[index] = rejected_output(request_id, text, prompt_ids, FinishReason.ERROR, message, now)
            if not isinstance(exc, Exception):
                interrupted = True
                raise
        finally:
            progress.close(sum(not output.ok for output in results.values()), interrupted)
        assert len(results) == len(indices), "a request finished without an output"
        return [results[index] for index in indices]

    def eplb_stats(self) -> list[EplbStats]:
        """What this process's EPLB controller did; empty when EPLB is inactive."""
        return [self._eplb.stats()] if self._eplb is not None else []

    def close(self) -> None:
        """Stop the grammar compile threads and release the CUDA graphs."""
        self.admission.close()
        self.runner.close()

    def _enqueue(self, admitted: Admitted, progress: GenerateProgress) -> None:
        request = admitted.request
        progress.num_prompt_tokens += request.num_prompt_tokens
        stop = tuple(request.params.stop)
        self.outputs.add(request.request_id, admitted.index, admitted.prompt, stop, admitted.arrival)
        self.core.add_request(request)

    def _run(self, results: dict[int, GenerateOutput], progress: GenerateProgress) -> None:
        """The step loop: admit compiled requests, step, collect outputs, end stop-string hits."""
        while self._any_busy(self.admission.has_pending or self.core.has_unfinished_requests()):
            if self.admission.has_pending:
                wait_s = 0.0 if self.core.has_unfinished_requests() else 0.05
                for ready in self.admission.poll(wait_s):
                    if isinstance(ready, Admitted):
                        self._enqueue(ready, progress)
                    else:
                        results[ready[0]] = ready[1]
                        progress.update(0, 1)
            if not self.core.has_unfinished_requests():
                if self._lockstep is not None:
                    self._lockstep.pad_step()
                continue
            finished, hits = self.outputs.process(self.core.step(), progress)
            results.update(finished)
            for hit in hits:
                self.scheduler.finish_request(
                    hit.request_id,
                    RequestStatus.FINISHED_STOPPED,
                    stop_reason=hit.stop,
                    num_output_tokens=hit.num_output_tokens,
                )

    def _recover(self, exc: BaseException, results: dict[int, GenerateOutput], progress: GenerateProgress) -> str:
        """Finish every unfinished request of the call with an error and make the engine as good as new; returns the
        error message."""
        reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else "a step failed"
        message = f"{reason} ({type(exc).__name__}: {exc}); the request was stopped and its cache freed"
        logger.error("generate: %s", message)
        self.core.reset()
        self.runner.reset()
        finished, _ = self.outputs.process(self.scheduler.abort_all(message), progress)
        results.update(finished)
        for index, output in self.admission.drop_pending(message):
            results[index] = output
            progress.update(0, 1)
        return message

    def _any_busy(self, busy: bool) -> bool:
        """Whether this engine (or, on a rank, any rank) has work left."""
        return self._lockstep.any_busy(busy) if self._lockstep is not None else busy
