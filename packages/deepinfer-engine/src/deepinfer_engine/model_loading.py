"""Building the model on its device from a checkpoint directory.

`load_model` validates and reads the checkpoint strictly (`deepinfer_model.loading.load.load_checkpoint_dir`),
builds `DeepseekV41ForCausalLM` directly on the target device and loads the stored-format tensors into it. The
Engram vocabulary is derived from the tokenizer with the configured pad id.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_engine.config import Precision
from deepinfer_engine.engine_args import DEPENDENT_LAUNCH_AUTO_TOKENS
from deepinfer_engine.tokenizer import Tokenizer
from deepinfer_model.config import ModelConfig
from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.truncation import PrefillTruncation
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.loading.load import load_checkpoint_dir

__all__ = ["load_model"]


def load_model(
    model_dir: Path,
    tokenizer: Tokenizer,
    precision: Precision,
    device: torch.device,
    engram_pad_token_id: int,
    expert_parallel: ExpertParallelMoE | None = None,
    max_backtracking_tokens: int = 1,
    prefill_truncation: PrefillTruncation | None = None,
    batch_invariant: bool = False,
    dependent_launch: bool | None = False,
    branch_streams: bool = True,
    flashmla: bool = True,
) -> DeepseekV41ForCausalLM:
    """The checkpoint's model on `device`, weights loaded, in eval mode.

    With `expert_parallel` the model keeps (and loads) only this rank's routed experts and reaches the others over
    the EP group; None keeps every expert in this process. `max_backtracking_tokens` sizes the rings for rolled-back
    draft positions (`nextn + 1` with speculative decoding, 1 without). `prefill_truncation` (None: off) is the YOCO
    prefill truncation the model runs prompt chunks with. `batch_invariant` (DEEPINFER_BATCH_INVARIANT) makes the CPU
    and CUDA forward batch-invariant (docs/design/numerics.md, "Batch invariance"); `dependent_launch`
    (`EngineArgs.dependent_launch`) launches its Triton kernels as programmatic dependent launches (None: in the
    forwards of at most `DEPENDENT_LAUNCH_AUTO_TOKENS` tokens); `branch_streams`
    (`EngineArgs.branch_streams`) runs its independent branches on side CUDA streams; `flashmla`
    (`EngineArgs.flashmla`) lets prompt-sized attention calls run FlashMLA's sparse prefill kernel where importable.

    Raises:
        deepinfer_model.loading.errors.CheckpointError / CoverageError: the checkpoint is incomplete or corrupt.
        ValueError: the tokenizer does not fit the model's Engram rules, or the model cannot run
            `prefill_truncation` (`PrefillTruncation.check`).
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
            prefill_truncation=prefill_truncation,
            batch_invariant=batch_invariant,
            dependent_launch=dependent_launch is True,
            dependent_launch_max_tokens=DEPENDENT_LAUNCH_AUTO_TOKENS if dependent_launch is None else 0,
            branch_streams=branch_streams,
            flashmla=flashmla,
        )
    model.load_weights(checkpoint.tensors.items())
    model.to(device)  # buffers built from host data during construction follow the parameters
    model.eval()
    return model
