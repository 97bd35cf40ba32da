"""`LLM`: offline batch generation, the user's entry point — a thin facade over one `Engine` or a parallel executor.

    llm = LLM()                                   # the built-in tiny checkpoint; LLM("/path/or/hub-id") otherwise
    outputs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))
    print(outputs[0].text, outputs[0].finish_reason)

Construction reads the environment once (`deepinfer_engine.envs.read_env`), resolves the checkpoint
(`deepinfer_engine.model_source`) and builds the `Engine` of this process (`deepinfer_engine.engine`: model,
tokenizer, cache, scheduler, runner, step loop; `EngineConfig` holds every setting).

`generate` returns exactly one `GenerateOutput` per prompt, in input order. A prompt that cannot run — empty, token
ids outside the vocabulary, parameters that fail validation, a grammar that fails to compile, a prompt longer than
`max_model_len` — finishes with an error finish reason and a message; every other request is unaffected. A step
that fails (out of memory, a kernel error) finishes the call's unfinished requests with an "error" finish reason and
leaves the `LLM` usable; Ctrl-C does the same, then raises KeyboardInterrupt.

Parallel: with `data_parallel_size`, `expert_parallel_size` or `context_parallel_size` > 1 the engines run in rank
processes (`deepinfer_engine.executor`: prompts assigned to attention-DP ranks round-robin, routed experts sharded over
the EP ranks, prefill chunks split over the CP ranks, ranks stepping in lockstep; on CUDA rank r uses GPU r and NCCL);
request ids and seeds are those of one process, so greedy and seeded outputs match it. The `LLM` process then holds
only the tokenizer (`engine` is None), and no progress bar is shown. The rank processes are started with "spawn" and
import the main module, so a script that builds a parallel `LLM` must do so under `if __name__ == "__main__":`.
Expert-parallel ranks balance their experts' load when the EPLB variables ask for it (`deepinfer_engine.eplb`;
`eplb_stats` reports what they did).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer_engine._prompts import ParamsLike, normalize_prompts, per_prompt_params, stream_indices
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine import Engine, resolve_device
from deepinfer_engine.engine_args import EngineArgs, default_nextn
from deepinfer_engine.envs import read_env
from deepinfer_engine.eplb import EplbSettings, EplbStats
from deepinfer_engine.executor import ParallelExecutor
from deepinfer_engine.generate_output import GenerateOutput
from deepinfer_engine.model_source import resolve_checkpoint
from deepinfer_engine.tokenizer import Tokenizer
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM

__all__ = ["LLM"]


class LLM:
    """Offline engine over one checkpoint.

    Args:
        model: checkpoint directory or Hugging Face repo id; None for the built-in trained tiny checkpoint;
            "tiny" for the random tiny checkpoint (written on first use into ~/.cache/deepinfer, or `cache_dir`).
        **kwargs: any `deepinfer_engine.engine_args.EngineArgs` field (tokenizer, seed, max_model_len,
            gpu_memory_utilization, cache_memory_bytes, block_size, max_num_seqs, max_num_batched_tokens, parallel
            sizes, enforce_eager, dependent_launch, branch_streams, flashmla, precision, device, async_scheduling,
            cache_dir, num_cache_blocks, nextn, mtp_varlen). Without `nextn` the engine drafts 5 tokens per step
            (DEEPINFER_USE_NEXTN_DECODE) when the checkpoint has DSpark blocks, and none otherwise.

    Attributes:
        engine: this process's `Engine` (None when the engines run in rank processes); `config` and `model` are
            its config and model.
        tokenizer: the engine tokenizer.

    Raises:
        TypeError: an unknown keyword argument.
        ValueError: an invalid argument or environment variable (the message names it), or a CUDA device without
            a visible GPU.
        RuntimeError: a parallel `LLM` built while a rank process imports the main module (no `__main__` guard).
        deepinfer_model.loading.errors.CheckpointError: the checkpoint cannot be found or is incomplete.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        env = read_env()
        args = EngineArgs.from_kwargs(model, kwargs)
        parallel = max(args.data_parallel_size, args.expert_parallel_size, args.context_parallel_size) > 1
        if parallel:
            _check_main_guard()
        # A parallel engine's device is checked against the rank count by the executor.
        device = args.device if parallel and args.device is not None else resolve_device(args.device)
        args = dataclasses.replace(args, device=device)
        cache_root = Path(args.cache_dir) if args.cache_dir is not None else None
        model_dir = resolve_checkpoint(
            args.model, local_model_dir=env["DEEPINFER_HF_MODEL_DIR"], revision=args.revision, cache_root=cache_root
        )
        if "nextn" not in kwargs:
            args = dataclasses.replace(args, nextn=default_nextn(model_dir, env))
        self._request_counter = 0
        self._executor: ParallelExecutor | None = None
        self.engine: Engine | None = None
        eplb = EplbSettings.from_env(env)
        if parallel:
            self.tokenizer = Tokenizer(args.tokenizer if args.tokenizer is not None else model_dir)
            self._executor = ParallelExecutor(args, model_dir, eplb)
            return
        self.engine = Engine(args, env, model_dir, eplb=eplb)
        self.tokenizer = self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """This process's engine config (`engine.config`)."""
        return self._local_engine().config

    @property
    def model(self) -> DeepseekV41ForCausalLM:
        """This process's model (`engine.model`)."""
        return self._local_engine().model

    def _local_engine(self) -> Engine:
        if self.engine is None:
            raise AttributeError("a parallel LLM runs its engines in rank processes; this process has no engine")
        return self.engine

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
            prompt_token_ids: token-id prompts, one list of ints per prompt; when both are given they must have
                equal lengths and ids win.
            use_tqdm: show a progress bar and print a summary line to stderr at the end.

        Raises:
            ValueError: no prompts, mismatched list lengths. (Problems of one prompt do not raise: that prompt's
                output carries the error.)
            TypeError: prompts that are not strings, or `prompt_token_ids` that is not a list of int lists.
            KeyboardInterrupt: after the call's requests were stopped and their cache freed.
        """
        texts, ids = normalize_prompts(prompts, prompt_token_ids)
        per_prompt = per_prompt_params(sampling_params, len(ids))
        streams = stream_indices(per_prompt)
        first_request_id = self._request_counter
        self._request_counter += len(ids)
        if self._executor is not None:
            return self._executor.generate(texts, ids, per_prompt, streams, first_request_id)
        assert self.engine is not None
        return self.engine.generate(range(len(ids)), texts, ids, per_prompt, streams, first_request_id, use_tqdm)

    def eplb_stats(self) -> list[EplbStats]:
        """What expert-parallel load balancing did so far: one entry per rank (in rank order) of a parallel engine
        whose EP ranks balance load; empty when EPLB is inactive (rearrangement off, EP size 1, one process).

        Raises:
            RuntimeError: a rank failed (its traceback is in the message).
        """
        if self._executor is not None:
            return self._executor.eplb_stats()
        assert self.engine is not None
        return self.engine.eplb_stats()

    def close(self) -> None:
        """Stop the grammar compile threads and the rank processes, and release this engine's CUDA graphs."""
        if self._executor is not None:
            self._executor.close()
        if self.engine is not None:
            self.engine.close()


def _check_main_guard() -> None:
    """Refuse to start rank processes from a rank process that is importing the user's main module: without an
    `if __name__ == "__main__":` guard the script would build the `LLM` again in every rank."""
    # A spawned process imports the parent's main script before it learns its parent (`parent_process()` is set
    # only once the child's own code starts); at that point it already carries its own process name.
    if multiprocessing.parent_process() is None and multiprocessing.current_process().name != "MainProcess":
        raise RuntimeError(
            "a parallel LLM (data/expert/context_parallel_size > 1) was built while a rank process imported your "
            "script: rank processes are spawned and import the main module, so build the LLM under "
            '`if __name__ == "__main__":` (see the README)'
        )
