"""deepinfer-model: the DeepSeek-V4.1-Flash text model, its configuration, cache declaration and checkpoints.

What the package owns, by entry point:

- configuration: ``ModelConfig`` (frozen, validated ``config.json``; ``ModelConfig.from_json``), ``load_preset``
  (``"tiny"``, ``"v41-flash"``), ``LayerKind`` of each runtime layer;
- the layered model the engine runs: ``DeepseekV41ForCausalLM(config, mode, engram_vocab)`` with ``load_weights``,
  ``cache_spec`` (``CacheSpec`` of ``CacheGroupSpec``s, ``CacheGroupKind``), ``allocate_state`` (``ModelState``) and
  ``forward(ForwardBatch, ModelState)``; ``ComputeMode`` picks exact (inference) or FP32 numerics;
  ``engram_vocab_from_tokenizer`` builds the Engram vocabulary (``EngramVocab``);
- checkpoints: ``load_checkpoint`` / ``load_checkpoint_dir`` (strict, stored formats, keyed by HF name →
  ``LoadedCheckpoint``; errors ``CheckpointError`` / ``CoverageError``), ``map_hf_name`` (the one name table),
  ``build_catalogue`` (every tensor a config implies), ``write_checkpoint`` (random checkpoints in the released
  format);
- the single-file oracle: ``reference_forward`` (``deepinfer_model.reference``), and ``checkpoint_logits`` (one full
  forward of the layered model from a checkpoint directory, behind ``deepinfer-model logits``).

Importing this package is cheap and has no side effects: the names above are imported from their modules on first
access (PEP 562), so ``import deepinfer_model`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_model.cache_spec import CacheGroupKind, CacheGroupSpec, CacheSpec
    from deepinfer_model.checkpoint.writer import write_checkpoint
    from deepinfer_model.config import LayerKind, ModelConfig, load_preset
    from deepinfer_model.deepseek_v41.engram import EngramVocab
    from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_model.full_forward import checkpoint_logits
    from deepinfer_model.layers.mode import ComputeMode
    from deepinfer_model.loading.catalogue import build_catalogue
    from deepinfer_model.loading.errors import CheckpointError, CoverageError
    from deepinfer_model.loading.hf_names import map_hf_name
    from deepinfer_model.loading.load import LoadedCheckpoint, load_checkpoint, load_checkpoint_dir
    from deepinfer_model.reference import reference_forward
    from deepinfer_model.state import ModelState

_EXPORTS: dict[str, str] = {
    "CacheGroupKind": "deepinfer_model.cache_spec",
    "CacheGroupSpec": "deepinfer_model.cache_spec",
    "CacheSpec": "deepinfer_model.cache_spec",
    "CheckpointError": "deepinfer_model.loading.errors",
    "ComputeMode": "deepinfer_model.layers.mode",
    "CoverageError": "deepinfer_model.loading.errors",
    "DeepseekV41ForCausalLM": "deepinfer_model.deepseek_v41.model",
    "EngramVocab": "deepinfer_model.deepseek_v41.engram",
    "ForwardBatch": "deepinfer_model.forward_batch",
    "LayerKind": "deepinfer_model.config",
    "LoadedCheckpoint": "deepinfer_model.loading.load",
    "ModelConfig": "deepinfer_model.config",
    "ModelState": "deepinfer_model.state",
    "build_catalogue": "deepinfer_model.loading.catalogue",
    "checkpoint_logits": "deepinfer_model.full_forward",
    "engram_vocab_from_tokenizer": "deepinfer_model.deepseek_v41.engram_vocab",
    "load_checkpoint": "deepinfer_model.loading.load",
    "load_checkpoint_dir": "deepinfer_model.loading.load",
    "load_preset": "deepinfer_model.config",
    "map_hf_name": "deepinfer_model.loading.hf_names",
    "reference_forward": "deepinfer_model.reference",
    "write_checkpoint": "deepinfer_model.checkpoint.writer",
}

__all__ = [
    "CacheGroupKind",
    "CacheGroupSpec",
    "CacheSpec",
    "CheckpointError",
    "ComputeMode",
    "CoverageError",
    "DeepseekV41ForCausalLM",
    "EngramVocab",
    "ForwardBatch",
    "LayerKind",
    "LoadedCheckpoint",
    "ModelConfig",
    "ModelState",
    "build_catalogue",
    "checkpoint_logits",
    "engram_vocab_from_tokenizer",
    "load_checkpoint",
    "load_checkpoint_dir",
    "load_preset",
    "map_hf_name",
    "reference_forward",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first access (keeps ``import deepinfer_model`` cheap)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer_model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
