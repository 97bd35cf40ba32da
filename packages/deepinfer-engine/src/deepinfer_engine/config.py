"""Frozen configuration of the engine: scheduler, cache, and the `EngineConfig` that composes every package's config.

`SchedulerConfig` bounds what one step may schedule; `CacheConfig` fixes the cache geometry the cache manager hands
out (the number of blocks itself is derived from a memory budget by `CacheManager.num_blocks_for_budget`).
`EngineConfig` is built once at the entrypoint from `LLM` keyword arguments and the environment
(`deepinfer_engine.engine_args.build_engine_config`); nothing below the entrypoint reads either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from deepinfer_model.deepseek_v41.truncation import PrefillTruncation
from deepinfer_sampling.config import SamplerConfig

if TYPE_CHECKING:  # importing xgrammar takes seconds; only engines with structured requests pay for it
    from deepinfer_sampling.structured.compiler import StructuredOutputConfig

__all__ = ["CacheConfig", "EngineConfig", "Precision", "SchedulerConfig"]

Precision = Literal["exact", "fp32"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_seqs: most requests holding cache at once (running, including partially prefilled ones).
        max_num_batched_tokens: most tokens computed in one step, summed over requests (the token budget).
        max_model_len: most positions a request may compute; a request finishes with "length" once its total
            length exceeds it (docs/design/scheduler.md, "Stop conditions"), and a longer prompt is rejected.
        max_num_draft_tokens: most draft tokens verified per request per step (nextn; 0 disables speculation).
        stop_preempted_requests: True finishes a preempted request with "insufficient_system_resource";
            False (the `LLM` default) recomputes it later.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    max_num_draft_tokens: int = 0
    stop_preempted_requests: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be >= 0, got {self.max_num_draft_tokens}")
        # Every running request must be able to take a full decode step (docs/design/scheduler.md, "Engine limits").
        min_budget = self.max_num_seqs * (1 + self.max_num_draft_tokens)
        if self.max_num_batched_tokens < min_budget:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs * (1 + max_num_draft_tokens) = {min_budget}, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Cache geometry.

    Attributes:
        block_size: raw tokens per block of the shared block table (128 for DeepSeek-V4.1-Flash).
        num_state_slots: per-request state slots, including the never-used slot 0:
            `int(max_num_seqs * DEEPINFER_NUM_STATE_SLOTS_RATIO) + 1` (docs/design/scheduler.md, "Engine limits").
    """

    block_size: int = 128
    num_state_slots: int = 2

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_state_slots < 2:
            raise ValueError(f"num_state_slots must be >= 2 (slot 0 is reserved), got {self.num_state_slots}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance runs with.

    Attributes:
        model_dir: the resolved checkpoint directory.
        tokenizer_dir: directory of `tokenizer.json`.
        scheduler: step limits (max_model_len included).
        cache: block size and state slots.
        num_blocks: cache blocks including the null block 0.
        sampler: sampler settings.
        structured_output: grammar compilation settings.
        seed: engine seed; request seeds without `seq_seed` derive from it and the request counter.
        precision: "exact" (the checkpoint's numerics) or "fp32" (FP32 activations and caches; parity tests).
        device: torch device the model and caches live on ("cpu", "cuda", "cuda:1", ...).
        async_scheduling: schedule step N+1 while step N runs (docs/design/scheduler.md, "Asynchronous scheduling").
        enforce_eager: never capture CUDA graphs (see `EngineArgs`); graphs are only captured on CUDA devices.
        cudagraph_batch_size_interval: spacing of decode graph sizes (docs/design/scheduler.md, "CUDA graphs"), >= 1.
        draft_cudagraph_batch_size_interval: spacing of the DSpark draft-forward graph sizes, >= 1.
        engram_pad_token_id: raw pad id of Engram n-gram windows.
        prefill_truncation: YOCO prefill truncation of prompt chunks (docs/design/attention.md, "YOCO prefill
            truncation"), from DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE and DEEPINFER_YOCO_PREFILL_KEEP_TOKENS; the
            model is built with it, and requests asking for prompt logprobs are refused while it is on.
        mtp_varlen: confidence-scheduled verification (docs/design/speculative.md, "Confidence-scheduled
            verification"): each step verifies as many of a request's drafts as the decode cost curve says pay off;
            off: every draft held is verified. Only with `scheduler.max_num_draft_tokens` > 0.
        decode_perf_cache_dir: directory of the cached decode cost curves (`deepinfer_engine.decode_cost`).
        decode_perf_cache_ttl_s: age in seconds after which a cached curve is measured again.
        confidence_temperatures: the drafter's confidence-head temperature, one value or one per draft slot, each
            >= 1e-5 (docs/design/model.md, "Draft heads").
    """

    model_dir: Path
    tokenizer_dir: Path
    scheduler: SchedulerConfig
    cache: CacheConfig
    num_blocks: int
    sampler: SamplerConfig
    structured_output: StructuredOutputConfig
    seed: int = 0
    precision: Precision = "exact"
    device: str = "cpu"
    async_scheduling: bool = True
    enforce_eager: bool = True
    cudagraph_batch_size_interval: int = 8
    draft_cudagraph_batch_size_interval: int = 8
    engram_pad_token_id: int = 2
    prefill_truncation: PrefillTruncation = field(default_factory=PrefillTruncation)
    mtp_varlen: bool = False
    decode_perf_cache_dir: Path | None = None
    decode_perf_cache_ttl_s: int = 3600
    confidence_temperatures: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.precision not in ("exact", "fp32"):
            raise ValueError(f"precision must be 'exact' or 'fp32', got {self.precision!r}")
        for name in ("cudagraph_batch_size_interval", "draft_cudagraph_batch_size_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
