"""Lightning indexer (model-attention §5): index keys for compressed rows, index scores and top-k row selection,
and the candidate-block restriction.

Index scores for query ``t`` and row ``b < klen(t) = (t+1) // c``: ``I(t, b) = Σ_h w[t,h] · relu(q̂[t,h] · û_b)``
with index q and keys quantized by the index-K row recipe (FP4 in exact mode), rounded to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_model.deepseek_v41.context import NewRows, StepContext, index_k_group
from deepinfer_model.layers.linear import Bf16Linear, Fp8BlockLinear
from deepinfer_model.layers.mode import ComputeMode, round_activation
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RotaryEmbedding
from deepinfer_model.state import ModelState, StepMetadata

__all__ = ["IndexSelection", "Indexer"]

_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


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
        candidate_block_size: rows per candidate block.
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
        """Project, RoPE and store the index keys of this step's new compressed rows (§5.2)."""
        if self.wk is None or self.k_norm is None:
            raise RuntimeError(f"layer {layer_id} is not an index-K source")
        keys = rope.rotate(self.k_norm(self.wk(rows.pre_rope_kv)), rows.row * ratio)
        group = index_k_group(ratio)
        slots = meta.paged_rows(rows.request, rows.row, state.rows_per_block(group))
        state.write(group, layer_id, slots, keys)

    def select(
        self, q_latent: torch.Tensor, hidden: torch.Tensor, ctx: StepContext, rope: RotaryEmbedding, how: IndexSelection
    ) -> torch.Tensor:
        """Top-k compressed rows of every query (§5.3–5.5).

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
        q = rope.rotate(self.wq_b(q_latent).view(num_tokens, self.n_heads, self.index_dim), meta.positions)
        q = codec.decode(codec.encode(q.reshape(-1, self.index_dim))).view(num_tokens, self.n_heads, -1)
        weights = self.weights_proj(hidden).float()
        klen = torch.div(meta.positions + 1, how.ratio, rounding_mode="floor")
        max_rows = meta.max_context_len // how.ratio
        rows = torch.arange(max_rows, device=klen.device)[None, :].expand(num_tokens, -1)
        valid = rows < klen[:, None]
        request = meta.token_request[:, None].expand_as(rows)
        keys = state.read(group, how.index_k_layer, meta.paged_rows(request, rows, state.rows_per_block(group)))
        scores = torch.relu(torch.einsum("thd,tbd->thb", q, keys))
        logits = round_activation(torch.einsum("th,thb->tb", weights, scores), self.mode).float()
        if how.candidate_source is not None:
            block_of_row = torch.div(rows, how.candidate_block_size, rounding_mode="floor")
            chosen = ctx.candidates[how.candidate_source]
            valid &= (block_of_row[:, :, None] == chosen[:, None, :]).any(dim=-1)
        if how.produces_candidates:
            ctx.candidates[how.layer_id] = self._candidate_blocks(logits, valid, klen, how)
        return _topk_rows(logits, valid, how.topk)

    def _candidate_blocks(
        self, logits: torch.Tensor, valid: torch.Tensor, klen: torch.Tensor, how: IndexSelection
    ) -> torch.Tensor:
        """Best ``candidate_topk_blocks`` blocks by max logit, the last valid block always kept. Returns [T, nb]."""
        size = how.candidate_block_size
        num_tokens, max_rows = logits.shape
        num_blocks = -(-max_rows // size)
        padded = torch.full((num_tokens, num_blocks * size), float("-inf"), device=logits.device)
        padded[:, :max_rows] = torch.where(valid, logits.clamp(max=_BF16_MAX), float("-inf"))
        block_score = padded.view(num_tokens, num_blocks, size).amax(dim=-1)
        # Scatter rather than boolean indexing: no data-dependent shape, no host sync (CUDA graphs).
        last = torch.div(klen - 1, size, rounding_mode="floor").clamp(min=0)[:, None]
        kept = torch.where((klen > 0)[:, None], float("inf"), block_score.gather(1, last))
        block_score.scatter_(1, last, kept)
        block_valid = block_score > float("-inf")
        return _topk_rows(block_score, block_valid, how.candidate_topk_blocks)


def _topk_rows(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest valid scores per row (ties → lower index), returned as indices in ascending order (as the
    reference kernel's ``sorted_index``; it fixes the attention's summation order), −1 padded at the end.

    Returns:
        [T, k] int64.
    """
    num_rows = scores.shape[1]
    masked = torch.where(valid, scores, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.where(valid.gather(1, order), order, num_rows)
    chosen = torch.sort(chosen, dim=-1).values
    result = torch.where(chosen < num_rows, chosen, -1)
    if result.shape[1] < k:
        pad = torch.full((result.shape[0], k - result.shape[1]), -1, dtype=result.dtype, device=result.device)
        result = torch.cat([result, pad], dim=1)
    return result
