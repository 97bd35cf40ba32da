"""Building the model on its device from a checkpoint directory, and sizing the cache budget.

`load_model` validates and reads the checkpoint strictly (`deepinfer_model.loading.load.load_checkpoint_dir`),
builds `DeepseekV41ForCausalLM` directly on the target device and loads the stored-format tensors into it. The
Engram vocabulary is derived from the tokenizer with the configured pad id.

`cache_budget_bytes` decides how many bytes the cache may take: an explicit budget wins; on CPU the default is
`DEFAULT_CPU_CACHE_MEMORY_BYTES`; on CUDA it is `total · gpu_memory_utilization` minus what is in use after loading
and minus the activation peak of one full step, measured by a profiling forward of `max_num_batched_tokens` tokens
on a temporary small cache (runtime §6.2 step 3).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_engine.config import Precision
from deepinfer_engine.engine_args import DEFAULT_CPU_CACHE_MEMORY_BYTES
from deepinfer_engine.tokenizer import Tokenizer
from deepinfer_model.config import ModelConfig
from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.loading.load import load_checkpoint_dir

__all__ = ["cache_budget_bytes", "load_model"]


def load_model(
    model_dir: Path,
    tokenizer: Tokenizer,
    precision: Precision,
    device: torch.device,
    engram_pad_token_id: int,
    expert_parallel: ExpertParallelMoE | None = None,
    max_backtracking_tokens: int = 1,
) -> DeepseekV41ForCausalLM:
    """The checkpoint's model on `device`, weights loaded, in eval mode.

    With `expert_parallel` the model keeps (and loads) only this rank's routed experts and reaches the others over
    the EP group; None keeps every expert in this process. `max_backtracking_tokens` sizes the rings for rolled-back
    draft positions (`nextn + 1` with speculative decoding, runtime §3.7; 1 without).

    Raises:
        deepinfer_model.loading.errors.CheckpointError / CoverageError: the checkpoint is incomplete or corrupt.
        ValueError: the tokenizer does not fit the model's Engram rules.
    """
    checkpoint = load_checkpoint_dir(model_dir)
    config: ModelConfig = checkpoint.config
    vocab = None
    if config.text.engram_enabled:
        vocab = engram_vocab_from_tokenizer(tokenizer.hf_tokenizer, engram_pad_token_id).to(device)
    with torch.device(device):
        model = DeepseekV41ForCausalLM(
            config,
            ComputeMode(precision),
            vocab,
            max_backtracking_tokens=max_backtracking_tokens,
            expert_parallel=expert_parallel,
        )
    model.load_weights(checkpoint.tensors.items())
    model.to(device)  # buffers built from host data during construction follow the parameters
    model.eval()
    return model


def cache_budget_bytes(
    model: DeepseekV41ForCausalLM,
    device: torch.device,
    *,
    explicit_bytes: int | None,
    gpu_memory_utilization: float,
    profile_num_tokens: int,
    profile_num_logits: int,
    block_size: int,
) -> int:
    """Bytes the cache may take (see the module docstring).

    Args:
        model: the loaded model.
        device: its device.
        explicit_bytes: the user's budget, or None.
        gpu_memory_utilization: fraction of device memory the engine may use (CUDA).
        profile_num_tokens: tokens of the profiling step (the step token budget).
        profile_num_logits: logits rows of the profiling step (the most requests sampled in one step).
        block_size: raw tokens per block.

    Raises:
        ValueError: on CUDA, nothing is left for the cache.
    """
    if explicit_bytes is not None:
        return explicit_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_CACHE_MEMORY_BYTES
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_blocks = -(-(profile_num_tokens + 1) // block_size) + 1
    state = model.allocate_state(block_size, num_blocks, 2, device)
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    token_ids = [[(7 * i) % model.config.text.vocab_size for i in range(profile_num_tokens)]]
    batch = ForwardBatch.for_requests(token_ids, [0], table.cpu(), [1])
    batch = ForwardBatch(
        input_ids=batch.input_ids.to(device),
        positions=batch.positions.to(device),
        cu_query_lens=batch.cu_query_lens.to(device),
        context_lens=batch.context_lens.to(device),
        block_table=table,
        state_slots=batch.state_slots.to(device),
        engram_prefix_ids=torch.full((1, (model.config.text.engram_max_ngram_size or 1) - 1), -1, device=device)
        if model.config.text.engram_enabled
        else None,
        logits_indices=torch.arange(
            max(0, profile_num_tokens - profile_num_logits), profile_num_tokens, dtype=torch.int64, device=device
        ),
        max_query_len=profile_num_tokens,
        max_context_len=profile_num_tokens,
    )
    with torch.inference_mode():
        model(batch, state)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    del state, batch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * gpu_memory_utilization) - (total - free) - activation_peak
    if budget <= 0:
        raise ValueError(
            f"no device memory left for the cache: {total / 2**30:.1f} GiB x gpu_memory_utilization="
            f"{gpu_memory_utilization} minus {(total - free) / 2**30:.1f} GiB in use and a "
            f"{activation_peak / 2**30:.1f} GiB activation peak; raise gpu_memory_utilization"
        )
    return budget
