"""`EngineArgs`: the keyword arguments of `LLM(...)`, and how they and the environment become one `EngineConfig`.

`EngineArgs` holds what a user may pass, validated on construction (each error names the argument, its value and
what is allowed). `build_engine_config` folds in the parsed environment (`deepinfer_engine.envs.read_env`, read once
by the entrypoint) and what only the loaded checkpoint and the cache budget can tell (vocabulary, position limit,
number of cache blocks):

- `max_model_len` defaults to the checkpoint's `max_position_embeddings`, capped by `MAX_MODEL_LEN_CAP` and by the
  tokens the whole cache can hold (so a default request can always run alone).
- `max_num_batched_tokens` defaults to `max(min(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS), max_num_seqs)`;
  prompts longer than it are prefilled in chunks.
- state slots = `int(max_num_seqs * DEEPINFER_NUM_STATE_SLOTS_RATIO) + 1` (docs/design/scheduler.md, "Engine limits").
- `nextn` > 0 (DSpark speculative decoding, `deepinfer_engine.speculative`) needs a checkpoint with DSpark blocks and
  raises the default token budget to at least `max_num_seqs * (1 + nextn)` (docs/design/scheduler.md, "Engine limits").
- YOCO prefill truncation (`prefill_truncation`) comes from the environment only; the model checks it against its
  layers and rings when it is built (docs/design/attention.md, "YOCO prefill truncation").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from deepinfer_engine.cache_manager import CacheManager
from deepinfer_engine.config import CacheConfig, EngineConfig, Precision, SchedulerConfig
from deepinfer_engine.envs import EnvSettings
from deepinfer_engine.model_source import default_cache_root
from deepinfer_model.cache_spec import CacheSpec
from deepinfer_model.config import ModelConfig
from deepinfer_model.deepseek_v41.context import DSPARK_GROUP
from deepinfer_model.deepseek_v41.truncation import PrefillTruncation
from deepinfer_model.loading.checkpoint_dir import CONFIG_FILE
from deepinfer_sampling.config import SamplerConfig, parse_token_blacklist

__all__ = [
    "DEFAULT_CPU_CACHE_MEMORY_BYTES",
    "DEPENDENT_LAUNCH_AUTO_TOKENS",
    "MAX_MODEL_LEN_CAP",
    "MAX_NEXTN",
    "EngineArgs",
    "build_engine_config",
    "default_nextn",
    "prefill_truncation",
]

MAX_MODEL_LEN_CAP = 131072
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_CPU_CACHE_MEMORY_BYTES = 256 * 1024**2
MAX_NEXTN = 32  # the reference's draft-block kernel limit (docs/design/model.md, "DSpark blocks")
# Tokens up to which a forward launches its Triton kernels as dependent launches by default (dependent_launch=None):
# on an H100 they took 5.1, 3.6, 1.9 and 0.7 % off decode steps of 1, 4, 16 and 64 requests, and added 2.3-2.7 % at
# 256 (docs/performance.md, "Thirty-first session").
DEPENDENT_LAUNCH_AUTO_TOKENS = 64
_PARALLEL_SIZES = ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size", "context_parallel_size")
_WIRED_PARALLEL_SIZES = ("data_parallel_size", "expert_parallel_size", "context_parallel_size")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class EngineArgs:
    """User-facing engine arguments (the keyword arguments of `LLM`).

    Attributes:
        model: checkpoint directory or Hugging Face repo id; None for the built-in trained tiny checkpoint; "tiny"
            for the random tiny checkpoint.
        tokenizer: tokenizer directory; None for the checkpoint directory.
        revision: Hub revision of `model`.
        seed: engine seed.
        max_model_len: most positions per request; None derives it (module docstring).
        gpu_memory_utilization: fraction of device memory the engine may use (weights, activations, cache); CUDA.
        cache_memory_bytes: explicit cache budget in bytes; None: derived from `gpu_memory_utilization` on CUDA,
            `DEFAULT_CPU_CACHE_MEMORY_BYTES` on CPU.
        num_cache_blocks: cache blocks (null block included) instead of what the budget holds (tests, tuning).
        block_size: raw tokens per cache block; must be a multiple of every compression ratio.
        max_num_seqs: most requests holding cache at once.
        max_num_batched_tokens: token budget of one step; None derives it.
        data_parallel_size, expert_parallel_size: attention-DP ranks and EP ranks (`deepinfer_engine.executor`).
        context_parallel_size: CP ranks per DP rank; prefill chunks are split over them
            (docs/design/parallelism.md, "Context parallelism").
        tensor_parallel_size: only 1 is wired.
        enforce_eager: never capture CUDA graphs (also set by DEEPINFER_ENFORCE_EAGER). When False (the default)
            an engine on a CUDA device captures its decode forwards at start and replays them for pure decode
            steps (`deepinfer_engine.cuda_graphs`); on CPU, in "fp32" precision and under expert parallelism every
            step runs eagerly whatever this says.
        dependent_launch: launch the Triton kernels of the forward as programmatic dependent launches, so each
            starts while the one before it finishes (NVIDIA Hopper and later; the same results; docs/design/kernels.md,
            "Dependent launches"); ignored elsewhere. True: every forward; False: none; None (the default): the
            forwards of at most `DEPENDENT_LAUNCH_AUTO_TOKENS` tokens (decode steps of up to 64 requests; on an H100
            5.1 % faster at batch 1, 0.7 % at 64, 2.3-2.7 % slower at 256: docs/performance.md).
        branch_streams: run the forward's independent branches (the shared expert, the window keys, the next Engram
            projection) on side CUDA streams beside the work they do not depend on (the same results;
            docs/design/kernels.md, "Branch streams"). On by default; ignored off CUDA.
        flashmla: prompt-sized attention calls (prefill chunks of at least 1,024 tokens) run FlashMLA's SM90 sparse
            prefill kernel where the `flash_mla` module (the `sgl-flash-mla` wheel) imports on an SM90 GPU: about 6x
            faster than the package's kernel at an 8K prompt, with probabilities rounded against a running maximum
            (not the same bits; docs/design/kernels.md, "FlashMLA sparse prefill"). On by default; ignored without the
            module, in "fp32" precision and in the batch-invariant mode.
        precision: "exact" or "fp32" (FP32 activations and caches, for parity with the reference model).
        device: "cpu", "cuda" or "cuda:N"; None picks CUDA when the kernels platform is NVIDIA.
        async_scheduling: overrides DEEPINFER_ZERO_OVERHEAD_SCHEDULING when not None.
        cache_dir: where the random tiny checkpoint (`model="tiny"`) is written; None for ~/.cache/deepinfer.
        nextn: draft tokens the DSpark drafter proposes per request after each sampling step; the next step
            verifies all of them (fewer near `max_tokens` or `max_model_len`, or as `mtp_varlen` chooses). The
            reference's `nextn`, there set by DEEPINFER_USE_NEXTN_DECODE. 0 disables speculative decoding; else
            1 … `MAX_NEXTN`, and the checkpoint must have DSpark blocks (`deepinfer_engine.speculative`). `LLM`
            fills it when not given: `default_nextn` (DEEPINFER_USE_NEXTN_DECODE, default 5, on a checkpoint with
            DSpark blocks; 0 without them). Built directly, `EngineArgs` defaults to 0.
        mtp_varlen: overrides DEEPINFER_ENABLE_MTP_VARLEN (confidence-scheduled verification) when not None.
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    cache_memory_bytes: int | None = None
    num_cache_blocks: int | None = None
    block_size: int = 128
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    enforce_eager: bool = False
    dependent_launch: bool | None = None
    branch_streams: bool = True
    flashmla: bool = True
    precision: Precision = "exact"
    device: str | None = None
    async_scheduling: bool | None = None
    cache_dir: str | None = None
    nextn: int = 0
    mtp_varlen: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("cache_memory_bytes", self.cache_memory_bytes, allow_none=True)
        _positive_int("block_size", self.block_size)
        _positive_int("num_cache_blocks", self.num_cache_blocks, allow_none=True)
        if self.num_cache_blocks is not None and self.num_cache_blocks < 2:
            raise ValueError(f"num_cache_blocks must be >= 2 (block 0 is reserved), got {self.num_cache_blocks}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
        for name in _PARALLEL_SIZES:
            value = getattr(self, name)
            _positive_int(name, value)
            if value != 1 and name not in _WIRED_PARALLEL_SIZES:
                raise ValueError(
                    f"{name}={value}: multi-rank execution is not wired into the engine yet; only 1 is supported"
                )
        if self.precision not in ("exact", "fp32"):
            raise ValueError(f"precision must be 'exact' or 'fp32', got {self.precision!r}")
        for flag in ("enforce_eager", "branch_streams", "flashmla"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.dependent_launch is not None and not isinstance(self.dependent_launch, bool):
            raise ValueError(
                f"dependent_launch must be a bool or None (automatic: the forwards of at most"
                f" {DEPENDENT_LAUNCH_AUTO_TOKENS} tokens), got {self.dependent_launch!r}"
            )
        nextn = self.nextn
        if isinstance(nextn, bool) or not isinstance(nextn, int) or not 0 <= nextn <= MAX_NEXTN:
            raise ValueError(f"nextn must be an int in [0, {MAX_NEXTN}] (0 disables drafting), got {nextn!r}")
        if self.mtp_varlen is not None and not isinstance(self.mtp_varlen, bool):
            raise ValueError(f"mtp_varlen must be a bool or None, got {self.mtp_varlen!r}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or None to detect), got {self.device!r}")

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
        """Build from `LLM(model, **kwargs)`; an unknown keyword is a `TypeError` naming the closest known one and
        listing them all."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = [f"{name} -> {close[0]}?" for name in unknown if (close := get_close_matches(name, known, n=1))]
            did_you_mean = f" (did you mean {', '.join(hints)})" if hints else ""
            raise TypeError(f"unknown engine arguments {unknown}{did_you_mean}; known: {sorted(known - {'model'})}")
        return cls(model=model, **kwargs)


def build_engine_config(
    args: EngineArgs,
    env: EnvSettings,
    *,
    model_dir: Path,
    device: str,
    max_position_embeddings: int,
    cache_spec: CacheSpec,
    cache_budget_bytes: int,
) -> EngineConfig:
    """The engine's frozen config.

    Args:
        args: the user's arguments.
        env: the parsed environment.
        model_dir: the resolved checkpoint directory.
        device: the device the engine runs on.
        max_position_embeddings: the checkpoint's position limit.
        cache_spec: the model's cache groups.
        cache_budget_bytes: bytes the cache (state slots and blocks) may take.

    Raises:
        ValueError: `max_model_len` exceeds the checkpoint's limit or what the cache can hold, the budget does
            not hold the state slots and two blocks, or `nextn` > 0 for a checkpoint without DSpark blocks.
    """
    from deepinfer_sampling.structured.compiler import StructuredOutputConfig

    if args.nextn and DSPARK_GROUP not in {group.name for group in cache_spec.groups}:
        raise ValueError(
            f"nextn={args.nextn} needs DSpark draft blocks, but the checkpoint has none "
            f"(num_nextn_predict_layers = 0); use nextn=0"
        )
    num_state_slots = int(args.max_num_seqs * env["DEEPINFER_NUM_STATE_SLOTS_RATIO"]) + 1
    cache = CacheConfig(block_size=args.block_size, num_state_slots=num_state_slots)
    if args.num_cache_blocks is not None:
        num_blocks = args.num_cache_blocks
    else:
        num_blocks = CacheManager.num_blocks_for_budget(cache_spec, cache, cache_budget_bytes)

    cache_tokens = (num_blocks - 1) * args.block_size
    if args.max_model_len is None:
        # The longest sequence can reach max_model_len + 1 tokens (docs/design/scheduler.md, "Stop conditions"), so
        # leave room for it.
        max_model_len = min(max_position_embeddings, MAX_MODEL_LEN_CAP, cache_tokens - 1)
    else:
        max_model_len = args.max_model_len
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the checkpoint's max_position_embeddings="
                f"{max_position_embeddings}"
            )
        if max_model_len + 1 > cache_tokens:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit the cache: {num_blocks - 1} blocks of "
                f"{args.block_size} tokens hold {cache_tokens}; raise the cache budget or lower max_model_len"
            )
    if max_model_len < 1:
        raise ValueError(f"the cache of {num_blocks - 1} blocks is too small to hold any request")
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(
            min(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS), args.max_num_seqs * (1 + args.nextn)
        )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_num_draft_tokens=args.nextn,
        stop_preempted_requests=False,
    )
    cache_limit = env["DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES"]
    structured = StructuredOutputConfig(
        num_compile_threads=env["DEEPINFER_SO_BUILDER_CPUS"],
        compile_timeout_s=env["DEEPINFER_XGRAMMAR_TIMEOUT"],
        cache_limit_bytes=0 if env["DEEPINFER_XGRAMMAR_DISABLE_CACHE"] else (cache_limit if cache_limit > 0 else None),
        # A verify step tentatively accepts up to nextn drafts, and a preempted in-flight token can be undone.
        max_rollback_tokens=scheduler.max_num_draft_tokens + 2,
    )
    async_scheduling = env["DEEPINFER_ZERO_OVERHEAD_SCHEDULING"]
    if args.async_scheduling is not None:
        async_scheduling = args.async_scheduling
    mtp_varlen = (env["DEEPINFER_ENABLE_MTP_VARLEN"] if args.mtp_varlen is None else args.mtp_varlen) and args.nextn > 0
    parallel = {name: getattr(args, name) for name in _PARALLEL_SIZES if getattr(args, name) > 1}
    if mtp_varlen and parallel:
        raise ValueError(
            f"confidence-scheduled verification (DEEPINFER_ENABLE_MTP_VARLEN / mtp_varlen) runs in one-process "
            f"engines only, got {parallel}; turn it off or use one process"
        )
    perf_dir = env["DEEPINFER_DECODE_PERF_CACHE_DIR"]
    if perf_dir is None:
        perf_dir = (Path(args.cache_dir) if args.cache_dir is not None else default_cache_root()) / "decode_perf"
    return EngineConfig(
        model_dir=model_dir,
        tokenizer_dir=Path(args.tokenizer) if args.tokenizer is not None else model_dir,
        scheduler=scheduler,
        cache=cache,
        num_blocks=num_blocks,
        sampler=_sampler_config(env),
        structured_output=structured,
        seed=args.seed,
        precision=args.precision,
        device=device,
        async_scheduling=async_scheduling,
        enforce_eager=args.enforce_eager or env["DEEPINFER_ENFORCE_EAGER"],
        cudagraph_batch_size_interval=env["DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL"],
        draft_cudagraph_batch_size_interval=env["DEEPINFER_DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL"],
        engram_pad_token_id=env["DEEPINFER_ENGRAM_PAD_TOKEN"],
        prefill_truncation=prefill_truncation(args, env),
        mtp_varlen=mtp_varlen,
        decode_perf_cache_dir=Path(perf_dir),
        decode_perf_cache_ttl_s=env["DEEPINFER_DECODE_PERF_CACHE_TTL_SEC"],
        confidence_temperatures=_confidence_temperatures(env, args.nextn),
    )


def _confidence_temperatures(env: EnvSettings, nextn: int) -> tuple[float, ...]:
    """DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE: one float, or exactly `nextn` comma-separated ones; each clamped
    to >= 1e-5."""
    name = "DEEPINFER_DFLASH_CONFIDENCE_HEAD_TEMPERATURE"
    text = env[name]
    message = f"environment variable {name}={text!r} must be a finite float or a comma list of them"
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(message) from None
    if not all(math.isfinite(v) for v in values):
        raise ValueError(message)
    if nextn and len(values) > 1 and len(values) != nextn:
        raise ValueError(
            f"environment variable {name}={text!r} lists {len(values)} values; nextn={nextn} needs 1 or {nextn}"
        )
    return tuple(max(v, 1e-5) for v in values)


def default_nextn(model_dir: Path, env: EnvSettings) -> int:
    """`nextn` when the user gives none, as the reference: DEEPINFER_USE_NEXTN_DECODE (default 5) when the checkpoint
    has DSpark blocks (`num_nextn_predict_layers` > 0); 0 without them, since there is nothing to draft with (an
    explicit `nextn` > 0 on such a checkpoint is an error instead, `build_engine_config`)."""
    config = ModelConfig.from_json(model_dir / CONFIG_FILE)
    return env["DEEPINFER_USE_NEXTN_DECODE"] if config.text.num_nextn_predict_layers else 0


def prefill_truncation(args: EngineArgs, env: EnvSettings) -> PrefillTruncation:
    """The YOCO prefill truncation setting of the environment (its errors name the variables).

    Raises:
        ValueError: an unknown mode, truncation on with a keep length <= 0, or `compact` with context parallelism
            (its split steps keep every row on every rank).
    """
    mode_name, keep_name = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
    truncation = PrefillTruncation(env[mode_name], env[keep_name], mode_name=mode_name, keep_tokens_name=keep_name)
    if truncation.mode == "compact" and args.context_parallel_size > 1:
        raise ValueError(
            f"{mode_name}='compact' does not run with context_parallel_size={args.context_parallel_size}; "
            "use 'mask' or context_parallel_size=1"
        )
    return truncation


def _sampler_config(env: EnvSettings) -> SamplerConfig:
    text = env["DEEPINFER_DECODE_TOKEN_BLACKLIST"]
    try:
        banned = parse_token_blacklist(text)
    except ValueError as exc:
        raise ValueError(f"environment variable DEEPINFER_DECODE_TOKEN_BLACKLIST={text!r} is invalid: {exc}") from None
    return SamplerConfig(
        batch_invariant=env["DEEPINFER_BATCH_INVARIANT"],
        banned_token_ids=banned,
        force_top_k=env["DEEPINFER_SAMPLER_FORCE_TOPK"],
    )
