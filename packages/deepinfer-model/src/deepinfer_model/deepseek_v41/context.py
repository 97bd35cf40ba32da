"""``StepContext``: what one forward step carries from layer to layer (docs/design/attention.md, "Cross-layer sharing").

Cross-layer items are transient: the compressed rows a kv source produced this step (and their pre-RoPE values,
which index-K sources project), the top-k row sets of index sources, candidate blocks of the candidate source and
the YOCO shared hidden. Nothing here outlives the step; persistent state lives in ``ModelState``.

Under ``compact`` YOCO prefill truncation (``deepseek_v41.truncation``) the consumer half runs on fewer rows: at the
boundary layer ``enter_consumer_half`` switches the query and key metadata to the kept rows and gathers the
cross-layer values carried over; compressed rows and index keys still come from every token (``step_meta``).

How the step's tokens are shared out is the context's ``TokenSplit`` strategy: the whole step here (every token's
query and key on this process), or the context-parallel split of ``deepseek_v41.context_parallel`` (this rank's
queries, every chunk token's keys). The forward and the layers are the same code for both; they only ask the
strategy for the local rows of a step tensor, and for the key tokens of a layer's input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer_kernels.branch_streams import Forked
from deepinfer_model.state import ModelState, StepMemo, StepMetadata

if TYPE_CHECKING:
    from deepinfer_model.deepseek_v41.engram import EngramVocab
    from deepinfer_model.deepseek_v41.truncation import Compaction

__all__ = ["NewRows", "StepContext", "TokenSplit", "compressed_group", "index_k_group"]

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


class TokenSplit:
    """Which of the step's tokens this process computes: the whole step (every method is the identity).

    A subclass splits the queries over ranks while keys stay those of every token (see the module docstring).
    """

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This process's rows ``[T_local, ...]`` of a tensor over every token of the step ``[T, ...]``."""
        return full

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every token's rows ``[T, ...]`` (packed-batch order) from this process's rows ``[T_local, ...]``."""
        return local

    def query_meta(self, meta: StepMetadata) -> StepMetadata:
        """The metadata whose per-token arrays address this process's query rows (``meta`` covers every token)."""
        return meta


WHOLE_STEP = TokenSplit()


@dataclass
class StepContext:
    """Per-step cross-layer values (mutable, filled while layers run).

    Attributes:
        meta: index math of the queries this process computes (per-token arrays of its rows only).
        key_meta: index math of the key tokens, whose window keys a layer computes and stores: every token of the
            step, or the kept rows in the consumer half of a ``compact`` step.
        step_meta: index math of every token of the step (compressor and index-key inputs, whole-step outputs).
        state: the cache pools.
        split: how the step's tokens are shared out (``TokenSplit``).
        new_rows: kv source → rows it completed this step.
        topk: index source → [T, K] selected rows.
        candidates: candidate source → [T, nb] candidate blocks.
        shared_hidden: [T_local, H] YOCO shared hidden (attention input of the first consumer layer).
        shared_hidden_keys: the shared hidden of every key token, gathered once by the first consumer kv source.
        engram_rows: [T, N_g] compressed n-gram rows (models with Engram).
        engram_active: [T] bool, tokens the Engram applies to.
        engram_vocab: the compressed vocabulary.
        engram_kv: Engram layer → its started projection (``DecoderBlock.start_engram``), until the layer takes it.
        capture_layers: layers whose incoming trunk mean is captured (DSpark target features).
        features: layer → [T, H] captured mean of the trunk entering the layer's attention.
        draft: the step is a DSpark draft forward (each request's tokens are one non-causal draft block).
        compaction: the consumer half's rows of a ``compact`` prefill step, or None.
        memo: index tensors derived from ``meta``, ``key_meta`` and the cross-layer items (``StepMemo``), built
            once per step by the first layer that asks; cleared when ``enter_consumer_half`` replaces them.
    """

    meta: StepMetadata
    key_meta: StepMetadata
    step_meta: StepMetadata
    state: ModelState
    split: TokenSplit = WHOLE_STEP
    new_rows: dict[int, NewRows] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)
    shared_hidden: torch.Tensor | None = None
    shared_hidden_keys: torch.Tensor | None = None
    engram_rows: torch.Tensor | None = None
    engram_active: torch.Tensor | None = None
    engram_vocab: EngramVocab | None = None
    engram_kv: dict[int, Forked[torch.Tensor]] = field(default_factory=dict)
    capture_layers: frozenset[int] = frozenset()
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    draft: bool = False
    compaction: Compaction | None = None
    memo: StepMemo = field(default_factory=StepMemo)

    @classmethod
    def for_step(
        cls,
        meta: StepMetadata,
        state: ModelState,
        split: TokenSplit = WHOLE_STEP,
        *,
        capture_layers: frozenset[int] = frozenset(),
        draft: bool = False,
        compaction: Compaction | None = None,
    ) -> StepContext:
        """The context of a step over ``meta`` (every token) shared out by ``split``."""
        return cls(
            meta=split.query_meta(meta),
            key_meta=meta,
            step_meta=meta,
            state=state,
            split=split,
            capture_layers=capture_layers,
            draft=draft,
            compaction=compaction,
        )

    def enter_consumer_half(self, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Called once, at the first YOCO consumer layer: under ``compact`` switch to the kept rows (queries and
        window keys), gather the carried top-k and candidate rows, and return ``rows`` (per-token tensors of the
        layer) gathered; otherwise return ``rows`` unchanged."""
        compaction = self.compaction
        if compaction is None:
            return rows
        self.meta = self.key_meta = compaction.meta
        self.memo.clear()
        self.topk = {layer: compaction.gather(value) for layer, value in self.topk.items()}
        self.candidates = {layer: compaction.gather(value) for layer, value in self.candidates.items()}
        return tuple(compaction.gather(value) for value in rows)

    def key_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's input rows of every key token ``[T, ...]`` from the local rows ``x`` (a collective when split)."""
        return self.split.gather(x)

    def key_shared_hidden(self) -> torch.Tensor:
        """The YOCO shared hidden of every key token, gathered on the first call of the step."""
        if self.shared_hidden is None:
            raise RuntimeError("the YOCO shared hidden is read before the first consumer layer set it")
        if self.shared_hidden_keys is None:
            self.shared_hidden_keys = self.split.gather(self.shared_hidden)
        return self.shared_hidden_keys
