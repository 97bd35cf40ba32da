"""Lightning indexer (docs/design/attention.md, "Lightning indexer"): index keys for compressed rows, index scores and
top-k row selection, and the candidate-block restriction.

Index scores for query ``t`` and row ``b < klen(t) = (t+1) // c``: ``I(t, b) = Σ_h w[t,h] · relu(q̂[t,h] · û_b)``
with index q and keys quantized by the index-K row recipe (FP4 in exact mode), rounded to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_kernels import indexer_select
from deepinfer_model.deepseek_v41.compressor import new_rows_rope_table, new_rows_slots
from deepinfer_model.deepseek_v41.context import NewRows, StepContext, index_k_group
from deepinfer_model.layers.linear import Bf16Linear, Fp8BlockLinear
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RotaryEmbedding
from deepinfer_model.state import ModelState, StepMetadata

__all__ = ["IndexSelection", "Indexer"]


@dataclass(frozen=True)
class IndexSelection:
    """How an index-source layer selects rows.

    Attributes:
        layer_id: the selecting (index-source) layer.
        ratio: compress ratio ``c``.
        topk: ``index_topk`` ``K``.
        index_k_layer: layer owning the index-K cache to score against.
        candidate_source: candidate source restricting this layer (None if unrestricted or itself the source).
        candidate_topk_blocks: blocks kept by the candidate source (when this layer is the source).
        candidate_block_size: rows per candidate block (0 when the config has no candidate blocks).
        produces_candidates: this layer is the candidate source.
    """

    layer_id: int
    ratio: int
    topk: int
    index_k_layer: int
    candidate_source: int | None
    candidate_topk_blocks: int
    candidate_block_size: int
    produces_candidates: bool


class Indexer(nn.Module):
    """``attn.indexer``: query side (``wq_b``, ``weights_proj``) on index sources, key side (``wk``, ``k_norm``) on
    index-K sources."""

    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        head_dim: int,
        n_heads: int,
        index_dim: int,
        eps: float,
        mode: ComputeMode,
        owns_query: bool,
        owns_key: bool,
    ) -> None:
        super().__init__()
        self.mode = mode
        self.n_heads = n_heads
        self.index_dim = index_dim
        self.wq_b = Fp8BlockLinear(q_lora_rank, n_heads * index_dim, mode) if owns_query else None
        self.weights_proj = Bf16Linear(hidden, n_heads, mode) if owns_query else None
        self.wk = Bf16Linear(head_dim, index_dim, mode) if owns_key else None
        self.k_norm = RMSNorm(index_dim, eps, mode) if owns_key else None

    def write_keys(
        self,
        rows: NewRows,
        ratio: int,
        meta: StepMetadata,
        state: ModelState,
        layer_id: int,
        rope: RotaryEmbedding,
    ) -> None:
        """Project, RoPE and store the index keys of this step's new compressed rows
        (docs/design/attention.md, "Index keys"); ``rows`` are the kv source's rows of ``meta``
        (``new_compressed_rows(meta, ratio)``), so their positions and slots are the ones the kv source used."""
        if self.wk is None or self.k_norm is None:
            raise RuntimeError(f"layer {layer_id} is not an index-K source")
        keys = rope.rotate_(self.k_norm(self.wk(rows.pre_rope_kv)), new_rows_rope_table(rope, meta, ratio))
        group = index_k_group(ratio)
        state.write(group, layer_id, new_rows_slots(meta, ratio, state.rows_per_block(group)), keys)

    def select(
        self, q_latent: torch.Tensor, hidden: torch.Tensor, ctx: StepContext, rope: RotaryEmbedding, how: IndexSelection
    ) -> torch.Tensor:
        """Top-k compressed rows of every query, candidate blocks included, streamed over the paged index-K cache by
        ``deepinfer_kernels.indexer_select`` (no ``[tokens, rows]`` intermediate; docs/design/attention.md,
        "Lightning indexer").

        Args:
            q_latent: [T, q_r] ``q_norm`` output.
            hidden: [T, H] ``attn_norm`` output.
            ctx: step context; candidate blocks are read from / written to it.
            rope: the layer's RoPE.
            how: selection parameters.

        Returns:
            [T, K] int64 logical row indices in ascending order, −1 = none (at the end).
        """
        if self.wq_b is None or self.weights_proj is None:
            raise RuntimeError("select() needs an index-source indexer")
        meta, state = ctx.meta, ctx.state
        num_tokens = meta.num_tokens
        group = index_k_group(how.ratio)
        codec = state.codec(group)
        q = rope.rotate_(self.wq_b(q_latent).view(num_tokens, self.n_heads, self.index_dim), rope.table_at(meta))
        # The index query is read through the index-K row format, as the keys are
        # (docs/design/attention.md, "Index query and weights").
        q = codec.decode(codec.encode(q))
        weights = self.weights_proj(hidden).float()
        # Rows visible to each query (docs/design/attention.md, "Row visibility"); the same for every index source of
        # the ratio (memo key: the ratio).
        klen = meta.memo.get(
            ("visible_rows", how.ratio), lambda: torch.div(meta.positions + 1, how.ratio, rounding_mode="floor")
        )
        candidates = None if how.candidate_source is None else ctx.candidates[how.candidate_source]
        rows, blocks = indexer_select(
            q,
            weights,
            state.pool(group, how.index_k_layer),
            codec.row_format,
            meta.block_table,
            state.rows_per_block(group),
            meta.token_request,
            klen,
            # Only bounds the streamed row loop (a CUDA graph needs it fixed); nothing is sized [tokens, rows].
            meta.max_context_len // how.ratio,
            how.topk,
            self.mode is ComputeMode.EXACT,
            candidates,
            how.candidate_block_size,
            how.candidate_topk_blocks if how.produces_candidates else 0,
        )
        if blocks is not None:
            ctx.candidates[how.layer_id] = blocks
        return rows
