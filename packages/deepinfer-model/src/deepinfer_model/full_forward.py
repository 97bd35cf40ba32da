"""One full forward of the layered model over a token sequence, straight from a checkpoint directory.

``checkpoint_logits`` loads a checkpoint strictly (``loading.load``), builds ``DeepseekV41ForCausalLM`` in the
requested compute mode on the CPU, computes the whole sequence as one prefill of one request into a fresh cache
state, and returns the logits of every position. ``checkpoint_layer_rms`` runs the same forward and reports the
root-mean-square of each block's output trunk, the check that a generated checkpoint's weight magnitudes keep
activations O(1). They back ``deepinfer-model logits`` and ``deepinfer-model rms`` and are meant for small
checkpoints (the tiny preset, test models); the engine is the way to run the released model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from deepinfer_model.layers.mode import ComputeMode

if TYPE_CHECKING:
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM

__all__ = ["check_token_ids", "checkpoint_layer_rms", "checkpoint_logits"]

_BLOCK_SIZE = 16


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first token id outside ``[0, vocab_size)``, or for an empty sequence."""
    if not token_ids:
        raise ValueError("token ids must not be empty")
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise ValueError(f"token id {token} at index {index} is outside the vocabulary [0, {vocab_size})")


def checkpoint_logits(directory: str | Path, token_ids: Sequence[int], mode: ComputeMode) -> torch.Tensor:
    """Logits of every position of ``token_ids`` computed by the layered model loaded from ``directory``.

    Args:
        directory: checkpoint directory (``config.json``, index, shards, tokenizer files).
        token_ids: the sequence, position 0 first; every id in ``[0, vocab_size)``.
        mode: ``ComputeMode.FP32`` (FP32 activations and caches) or ``ComputeMode.EXACT`` (the inference numerics:
            BF16 activations, FP8/FP4 caches).

    Returns:
        [num_tokens, vocab_size] float32 CPU tensor.

    Raises:
        CheckpointError: the directory is not a valid checkpoint (the message names the problem).
        ValueError: empty ``token_ids`` or an id outside the vocabulary.
    """
    _, run = _prefill(directory, token_ids, mode)
    with torch.no_grad():
        return run().float()


def checkpoint_layer_rms(directory: str | Path, token_ids: Sequence[int], mode: ComputeMode) -> list[float]:
    """Root-mean-square of every backbone block's output trunk over one prefill of ``token_ids``.

    Args:
        directory: checkpoint directory.
        token_ids: the sequence; every id in ``[0, vocab_size)``.
        mode: compute mode (see :func:`checkpoint_logits`).

    Returns:
        One float per backbone block, in layer order: ``sqrt(mean(trunk²))`` over tokens, streams and width.
    """
    model, run = _prefill(directory, token_ids, mode)
    rms: list[float] = []

    def record(_module: torch.nn.Module, _inputs: object, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        rms.append(float(output[0].float().pow(2).mean().sqrt()))

    hooks = [block.register_forward_hook(record) for block in model.layers]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return rms


def _prefill(
    directory: str | Path, token_ids: Sequence[int], mode: ComputeMode
) -> tuple[DeepseekV41ForCausalLM, Callable[[], torch.Tensor]]:
    """Load the model from ``directory`` and return it with a closure computing one prefill of ``token_ids``."""
    from tokenizers import Tokenizer

    from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_model.loading.checkpoint_dir import TOKENIZER_FILE
    from deepinfer_model.loading.load import load_checkpoint_dir

    checkpoint = load_checkpoint_dir(directory)
    check_token_ids(token_ids, checkpoint.config.text.vocab_size)
    vocab = engram_vocab_from_tokenizer(Tokenizer.from_file(str(checkpoint.path / TOKENIZER_FILE)))
    model = DeepseekV41ForCausalLM(checkpoint.config, mode, vocab)
    model.load_weights(checkpoint.tensors.items())
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // _BLOCK_SIZE)
    state = model.allocate_state(block_size=_BLOCK_SIZE, num_blocks=num_blocks, num_state_slots=1)
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    batch = ForwardBatch.for_requests([list(token_ids)], [0], block_table, [0])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(num_tokens))
    return model, lambda: model(batch, state)
