"""Sizing the engine at start-up: the profiling step, the step token budget and the cache budget.

`size_engine` decides, for one loaded model, how many bytes the cache may take and the step token budget, before the
engine's `EngineConfig` is built (`deepinfer_engine.engine_args.build_engine_config` then derives `max_model_len` and
the block count from them):

- an explicit `cache_memory_bytes` (or `num_cache_blocks`) wins; on CPU the cache budget is
  `DEFAULT_CPU_CACHE_MEMORY_BYTES`;
- on CUDA it is `total · gpu_memory_utilization` − what is in use after loading − the activation peak of one full
  step. The peak is measured by a *profiling step* that takes the same path as a real step: a
  `ModelRunner` over a temporary cache runs one `SchedulerOutput` of `max_num_batched_tokens` tokens spread over up
  to `max_num_seqs` sampling requests (input buffers, forward, sampler, drafter with `nextn`);
- when the token budget is not given and the profiling step runs out of device memory, the budget is halved (down
  to what `max_num_seqs` needs) and the step profiled again, so that default arguments start whenever the weights
  fit.

`describe` is the line the engine logs about what it chose; on CUDA `describe_prompt_attention` adds which kernel
runs the attention of prompt chunks, and why not FlashMLA where it does not.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine_args import (
    DEFAULT_CPU_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineArgs,
    build_engine_config,
)
from deepinfer_engine.envs import EnvSettings
from deepinfer_engine.model_runner import ModelRunner
from deepinfer_engine.outputs import ScheduledRequest, SchedulerOutput
from deepinfer_kernels.vendor_attention import vendor_attention_unavailable
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_sampling import SamplingParams

__all__ = [
    "EngineSizing",
    "cache_budget_from_memory",
    "describe",
    "fitting_token_budget",
    "profile_step",
    "size_engine",
]

logger = logging.getLogger(__name__)

_GIB = 2**30


@dataclass(frozen=True)
class EngineSizing:
    """What start-up sizing decided.

    Attributes:
        cache_budget_bytes: bytes the cache may take (0 when `num_cache_blocks` is given).
        max_num_batched_tokens: the step token budget, or None to leave it to `build_engine_config`'s default.
        source: how the cache budget was found, for the log line.
    """

    cache_budget_bytes: int
    max_num_batched_tokens: int | None
    source: str


def cache_budget_from_memory(total: int, in_use: int, activation_peak: int, utilization: float) -> int:
    """`total · utilization − in_use − activation_peak` (bytes).

    Raises:
        ValueError: nothing is left for the cache (the message gives the numbers).
    """
    budget = int(total * utilization) - in_use - activation_peak
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the cache: {total / _GIB:.1f} GiB x gpu_memory_utilization={utilization} "
            f"minus {in_use / _GIB:.1f} GiB in use and a {activation_peak / _GIB:.1f} GiB activation peak; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


def profile_step(
    model: DeepseekV41ForCausalLM,
    args: EngineArgs,
    env: EnvSettings,
    model_dir: Path,
    device: torch.device,
    num_tokens: int,
) -> int | None:
    """Run one step of `num_tokens` tokens through a `ModelRunner` on a temporary cache (module docstring).

    Returns:
        The step's activation peak in bytes on CUDA (temporary cache excluded); None on other devices.
    """
    text = model.config.text
    max_len = min(num_tokens, text.max_position_embeddings)
    sizes = [1] * min(args.max_num_seqs, num_tokens)  # every request samples: the most logits rows of a step
    left, index = num_tokens - len(sizes), 0
    while left:
        grow = min(left, max_len - sizes[index])
        sizes[index] += grow
        left -= grow
        index += 1
    block_size = args.block_size
    blocks = [-(-(size + 1) // block_size) for size in sizes]
    profile_args = dataclasses.replace(
        args,
        max_model_len=max_len,
        max_num_batched_tokens=num_tokens,
        num_cache_blocks=sum(blocks) + 1,
        enforce_eager=True,
        async_scheduling=False,
    )
    config = build_engine_config(
        profile_args,
        env,
        model_dir=model_dir,
        device=str(device),
        max_position_embeddings=text.max_position_embeddings,
        cache_spec=model.cache_spec(),
        cache_budget_bytes=0,
    )
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    state = model.allocate_state(block_size, config.num_blocks, config.cache.num_state_slots, device)
    state_bytes = torch.cuda.memory_allocated(device) - before if cuda else 0
    runner = ModelRunner(model, state, config)
    scheduled, first_block = [], 1
    for i, (size, num_blocks) in enumerate(zip(sizes, blocks, strict=True)):
        prompt = tuple((7 * (i + p)) % text.vocab_size for p in range(size))
        block_ids = tuple(range(first_block, first_block + num_blocks))
        params = SamplingParams(max_tokens=1)
        scheduled.append(ScheduledRequest.whole_prompt(f"profile-{i}", prompt, i + 1, block_ids, params, i))
        first_block += num_blocks
    try:
        runner.wait(runner.execute(SchedulerOutput(0, tuple(scheduled), frozenset(), ())))
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before - state_bytes
    finally:
        runner.close()
        del runner, state
        if cuda:
            torch.cuda.empty_cache()


def fitting_token_budget(
    profile: Callable[[int], int | None], num_tokens: int, floor: int, halve: bool
) -> tuple[int, int | None]:
    """Profile a step of `num_tokens` tokens; when it runs out of device memory and `halve` is set, halve the count
    (not below `floor`) and profile again. Returns the count that fitted and its measured peak.

    Raises:
        torch.OutOfMemoryError: even `floor` tokens (or the fixed count) do not fit.
    """
    while True:
        try:
            return num_tokens, profile(num_tokens)
        except torch.OutOfMemoryError:
            if not halve or num_tokens <= floor:
                raise
            smaller = max(floor, num_tokens // 2)
            logger.warning("a profiling step of %d tokens ran out of device memory; trying %d", num_tokens, smaller)
            num_tokens = smaller
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def size_engine(
    model: DeepseekV41ForCausalLM, args: EngineArgs, env: EnvSettings, model_dir: Path, device: torch.device
) -> EngineSizing:
    """The cache budget and token budget of an engine over `model` (see the module docstring)."""
    if args.num_cache_blocks is not None:
        return EngineSizing(0, None, f"num_cache_blocks={args.num_cache_blocks}")
    if args.cache_memory_bytes is not None:
        return EngineSizing(args.cache_memory_bytes, None, "cache_memory_bytes")
    if device.type != "cuda":
        return EngineSizing(DEFAULT_CPU_CACHE_MEMORY_BYTES, None, "the CPU default")
    text = model.config.text
    floor = args.max_num_seqs * (1 + args.nextn)
    initial = max(min(text.max_position_embeddings, DEFAULT_MAX_NUM_BATCHED_TOKENS), floor)
    num_tokens, peak = fitting_token_budget(
        lambda n: profile_step(model, args, env, model_dir, device, n),
        args.max_num_batched_tokens or initial,
        floor,
        halve=args.max_num_batched_tokens is None,
    )
    assert peak is not None
    free, total = torch.cuda.mem_get_info(device)
    budget = cache_budget_from_memory(total, total - free, peak, args.gpu_memory_utilization)
    # Only a halved budget overrides the default `build_engine_config` derives from max_model_len.
    chosen = num_tokens if args.max_num_batched_tokens is None and num_tokens < initial else None
    source = (
        f"{total / _GIB:.1f} GiB x {args.gpu_memory_utilization} - {(total - free) / _GIB:.2f} GiB in use after the "
        f"weights - a {peak / _GIB:.2f} GiB activation peak of a {num_tokens}-token profiling step"
    )
    return EngineSizing(budget, chosen, source)


def describe(config: EngineConfig, sizing: EngineSizing, cache_bytes: int, max_position_embeddings: int) -> str:
    """The start-up line: what the engine chose, and from what."""
    sched = config.scheduler
    return (
        f"engine on {config.device}: max_model_len={sched.max_model_len} (checkpoint limit {max_position_embeddings}), "
        f"max_num_batched_tokens={sched.max_num_batched_tokens}, max_num_seqs={sched.max_num_seqs}; cache of "
        f"{config.num_blocks} blocks x {config.cache.block_size} tokens and {config.cache.num_state_slots} state "
        f"slots ({cache_bytes / _GIB:.2f} GiB) from {sizing.source}"
    )


def describe_prompt_attention(
    args: EngineArgs, batch_invariant: bool, device: torch.device, heads: int, head_dim: int
) -> str:
    """The start-up line on which kernel runs the attention of prompt chunks of a model with ``heads`` query heads of
    ``head_dim`` (docs/design/kernels.md, "FlashMLA sparse prefill")."""
    ours = "prompt attention: the package's kernels"
    if not args.flashmla:
        return f"{ours} (flashmla=False)"
    if args.precision != "exact":
        return f"{ours} (FlashMLA takes the exact precision only, not {args.precision!r})"
    if batch_invariant:
        return f"{ours} (the batch-invariant mode never takes FlashMLA)"
    reason = vendor_attention_unavailable(device, heads, head_dim)
    if reason is not None:
        return f"{ours} (FlashMLA unavailable: {reason})"
    return "prompt attention: FlashMLA's sparse prefill for prompt-sized chunks, the package's kernels elsewhere"
