"""What kind of layer each runtime layer is, and which shared objects it owns (docs/design/model.md, "Layer roles").

``TextConfig.layers`` builds one ``LayerSpec`` per runtime layer from the config; everything else reads these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["LayerKind", "LayerSpec"]


class LayerKind(enum.Enum):
    """Attention variant of a runtime layer (docs/design/model.md, "Layer kinds")."""

    SWA = "swa"  # compress ratio 0: sliding window only
    C1 = "c1"  # compress ratio 1: SWA + sparse compressed rows, one row per token
    C2 = "c2"  # compress ratio 2: SWA + sparse compressed rows, one row per two tokens
    DSPARK = "dspark"  # DSpark drafter block: SWA only, base RoPE


@dataclass(frozen=True)
class LayerSpec:
    """Everything structural about one runtime layer
    (docs/design/model.md, "Layer kinds", "Layer stack and runtime layer ids", "RoPE and YaRN").

    Attributes:
        layer_id: runtime layer id (backbone ``0 … L−1``, DSpark ``L …``).
        kind: attention variant.
        compress_ratio: 0, 1 or 2 (0 for DSpark blocks).
        kv_source: runtime layer owning the compressed KV this layer reads (itself if a source).
        index_source: runtime layer running the indexer whose top-k this layer uses.
        index_k_source: runtime layer owning the index-K cache and ``indexer.wk``/``k_norm``.
        candidate_source: layer producing the candidate block set restricting this layer's top-k, or None.
        is_yoco_consumer: layer lies in ``n_prefill_layer … L−1`` (only when YOCO is on).
        has_engram: layer carries an Engram.
        rope_theta: RoPE base of the layer.
        uses_yarn: the layer's RoPE table uses YaRN.
    """

    layer_id: int
    kind: LayerKind
    compress_ratio: int
    kv_source: int
    index_source: int
    index_k_source: int
    candidate_source: int | None
    is_yoco_consumer: bool
    has_engram: bool
    rope_theta: float
    uses_yarn: bool

    @property
    def is_compressed(self) -> bool:
        return self.kind in (LayerKind.C1, LayerKind.C2)

    @property
    def owns_compressor(self) -> bool:
        """Has ``attn.compressor.wkv``/``norm`` (compressed KV source)."""
        return self.is_compressed and self.kv_source == self.layer_id

    @property
    def owns_compressor_gate(self) -> bool:
        """Has ``attn.compressor.wgate`` (ratio-2 KV source)."""
        return self.owns_compressor and self.kind is LayerKind.C2

    @property
    def owns_indexer(self) -> bool:
        """Has ``attn.indexer.wq_b``/``weights_proj`` (compressed index source)."""
        return self.is_compressed and self.index_source == self.layer_id

    @property
    def owns_index_k(self) -> bool:
        """Has ``attn.indexer.wk``/``k_norm`` (compressed index-K source)."""
        return self.is_compressed and self.index_k_source == self.layer_id

    @property
    def is_candidate_source(self) -> bool:
        return self.candidate_source == self.layer_id
