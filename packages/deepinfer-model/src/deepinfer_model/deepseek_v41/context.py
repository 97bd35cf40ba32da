"""``StepContext``: what one forward step carries from layer to layer (model-attention §6).

Cross-layer items are transient: the compressed rows a kv source produced this step (and their pre-RoPE values,
which index-K sources project), the top-k row sets of index sources, candidate blocks of the candidate source and
the YOCO shared hidden. Nothing here outlives the step; persistent state lives in ``ModelState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer_model.state import ModelState, StepMetadata

if TYPE_CHECKING:
    from deepinfer_model.deepseek_v41.engram import EngramVocab

__all__ = ["NewRows", "StepContext", "compressed_group", "index_k_group"]

SWA_GROUP = "swa"
COMPRESSOR_GROUP = "compressor_c2"
DSPARK_GROUP = "dspark_swa"


def compressed_group(ratio: int) -> str:
    """Cache group name of the compressed rows of ratio ``ratio``."""
    return f"compressed_c{ratio}"


def index_k_group(ratio: int) -> str:
    """Cache group name of the index-K rows of ratio ``ratio``."""
    return f"index_k_c{ratio}"


@dataclass(frozen=True)
class NewRows:
    """Compressed rows a kv source completed in this step.

    Attributes:
        request: [N] int64 request index of each row.
        row: [N] int64 logical row index ``b`` (covers raw positions ``b·c … b·c + c − 1``).
        pre_rope_kv: [N, D] activation dtype, ``compressor.norm`` output before RoPE.
    """

    request: torch.Tensor
    row: torch.Tensor
    pre_rope_kv: torch.Tensor


@dataclass
class StepContext:
    """Per-step cross-layer values (mutable, filled while layers run).

    Attributes:
        meta: index math of the step.
        state: the cache pools.
        new_rows: kv source → rows it completed this step.
        topk: index source → [T, K] selected rows.
        candidates: candidate source → [T, nb] candidate blocks.
        shared_hidden: [T, H] YOCO shared hidden (attention input of the first consumer layer).
        engram_rows: [T, N_g] compressed n-gram rows (models with Engram).
        engram_active: [T] bool, tokens the Engram applies to.
        engram_vocab: the compressed vocabulary.
        capture_layers: layers whose incoming trunk mean is captured (DSpark target features).
        features: layer → [T, H] captured mean of the trunk entering the layer's attention.
        draft: the step is a DSpark draft forward (each request's tokens are one non-causal draft block).
    """

    meta: StepMetadata
    state: ModelState
    new_rows: dict[int, NewRows] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    shared_hidden: torch.Tensor | None = None
    engram_rows: torch.Tensor | None = None
    engram_active: torch.Tensor | None = None
    engram_vocab: EngramVocab | None = None
    capture_layers: frozenset[int] = frozenset()
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    draft: bool = False
