"""Attention of every layer kind (model-attention §3): MLA-style low-rank q, one shared K=V vector per token in a
sliding window, plus — on compressed layers — ``index_topk`` compressed rows chosen by the indexer.

Per step and layer, in order (§11 rule 6): project q and the SWA KV; read the SWA history from the ring; write the
chunk's tail into the ring; (kv source) form and store compressed rows; (index-K source) store index keys; (index
source) select top-k rows, else reuse the source's; attend over ``window ∪ selected rows`` with the per-head sink;
de-rotate; grouped ``wo_a``; ``wo_b``. Sharing roles come from the layer's ``LayerSpec``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_model.config import LayerSpec, TextConfig
from deepinfer_model.deepseek_v41.compressor import Compressor
from deepinfer_model.deepseek_v41.context import StepContext, compressed_group
from deepinfer_model.deepseek_v41.context_parallel import ContextParallelContext
from deepinfer_model.deepseek_v41.indexer import Indexer, IndexSelection
from deepinfer_model.layers.linear import Fp8BlockLinear, Fp8GroupedLinear, make_parameter
from deepinfer_model.layers.mode import ComputeMode, round_activation
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RotaryEmbedding

__all__ = ["Attention", "sparse_attention"]


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float, mode: ComputeMode
) -> torch.Tensor:
    """One softmax per head over a per-query key list plus a sink logit with a zero value (K = V).

    FP32 logits and statistics; in exact mode the unnormalized probabilities are rounded to BF16 before the value
    product (as FlashMLA does; model-attention §3 step 6, A4) while the denominator keeps them in FP32.

    Args:
        q: [T, n_h, D] bf16/fp32.
        keys: [T, N, D] fp32 dequantized keys (also the values).
        valid: [T, N] bool.
        sink: [n_h] fp32 sink logits.
        scale: softmax scale ``D^−0.5``.
        mode: compute mode.

    Returns:
        [T, n_h, D] fp32; zero for a query without valid keys.
    """
    logits = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    peak = torch.maximum(logits.amax(dim=-1), sink[None, :])
    probs = torch.exp(logits - peak[..., None])
    denom = probs.sum(dim=-1) + torch.exp(sink[None, :] - peak)
    weights = round_activation(probs, mode).float()
    return torch.einsum("thn,tnd->thd", weights, keys) / denom[..., None]


class Attention(nn.Module):
    """``attn.*`` of one backbone or DSpark layer."""

    def __init__(self, cfg: TextConfig, spec: LayerSpec, mode: ComputeMode, swa_group: str) -> None:
        super().__init__()
        self.spec = spec
        self.mode = mode
        self.swa_group = swa_group
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.softmax_scale = cfg.softmax_scale
        hidden, q_rank, eps = cfg.hidden_size, cfg.q_lora_rank, cfg.rms_norm_eps
        self.wq_a = Fp8BlockLinear(hidden, q_rank, mode)
        self.q_norm = RMSNorm(q_rank, eps, mode)
        self.wq_b = Fp8BlockLinear(q_rank, self.n_heads * self.head_dim, mode)
        self.wkv = Fp8BlockLinear(hidden, self.head_dim, mode)
        self.kv_norm = RMSNorm(self.head_dim, eps, mode)
        heads_per_group = self.n_heads // cfg.o_groups
        self.wo_a = Fp8GroupedLinear(cfg.o_groups, heads_per_group * self.head_dim, cfg.o_lora_rank, mode)
        self.wo_b = Fp8BlockLinear(cfg.o_groups * cfg.o_lora_rank, hidden, mode)
        self.attn_sink = make_parameter((self.n_heads,), torch.float32)
        yarn = None
        if spec.uses_yarn and cfg.rope_scaling is not None:
            s = cfg.rope_scaling
            yarn = (s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow)
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, spec.rope_theta, yarn)
        self.compressor = (
            Compressor(hidden, self.head_dim, spec.compress_ratio, eps, mode) if spec.owns_compressor else None
        )
        self.indexer = (
            Indexer(
                hidden,
                q_rank,
                self.head_dim,
                cfg.index_n_heads,
                cfg.index_head_dim,
                eps,
                mode,
                owns_query=spec.owns_indexer,
                owns_key=spec.owns_index_k,
            )
            if spec.owns_indexer or spec.owns_index_k
            else None
        )
        self.selection = (
            IndexSelection(
                layer_id=spec.layer_id,
                ratio=spec.compress_ratio,
                topk=cfg.index_topk,
                index_k_layer=spec.index_k_source,
                candidate_source=None if spec.is_candidate_source else spec.candidate_source,
                candidate_topk_blocks=cfg.candidate_topk_blocks or 0,
                candidate_block_size=cfg.candidate_block_size or 1,
                produces_candidates=spec.is_candidate_source,
            )
            if spec.owns_indexer
            else None
        )

    def forward(self, x: torch.Tensor, ctx: StepContext, compressor_input: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer for the step's tokens.

        Args:
            x: [T, H] ``attn_norm`` output (activation dtype).
            ctx: step context with metadata, state and cross-layer values.
            compressor_input: [T, H] input of the compressor (the YOCO shared hidden on consumer kv sources);
                defaults to ``x``.

        Returns:
            [T, H] activation dtype.
        """
        meta = ctx.meta
        num_tokens = meta.num_tokens
        q_latent = self.q_norm(self.wq_a(x))
        q = self.rope.rotate(self.wq_b(q_latent).view(num_tokens, self.n_heads, self.head_dim), meta.positions)
        kv_x, kv_ctx, kv_hidden = self._key_tokens(x, ctx, compressor_input)
        keys, valid = self._draft_keys(x, ctx) if ctx.draft else self._swa_keys(ctx, kv_x, kv_ctx)
        if self.spec.is_compressed:
            comp_keys, comp_valid = self._compressed_keys(q_latent, x, ctx, kv_ctx, kv_hidden)
            keys = torch.cat([keys, comp_keys], dim=1)
            valid = torch.cat([valid, comp_valid], dim=1)
        out = sparse_attention(q, keys, valid, self.attn_sink, self.softmax_scale, self.mode)
        # De-rotation and both FP8 quantizations of the output path read FP32 values (§3 steps 7–8).
        out = self.rope.rotate(out, meta.positions, inverse=True)
        return self.wo_b(self.wo_a(out.reshape(num_tokens, -1)))

    def _key_tokens(
        self, x: torch.Tensor, ctx: StepContext, compressor_input: torch.Tensor | None
    ) -> tuple[torch.Tensor, StepContext, torch.Tensor | None]:
        """The tokens whose keys this layer computes and stores, with their context: the step's own tokens, or in a
        context-parallel split step every chunk token, gathered over the CP group (collective), so that the full
        cache is written on every rank while queries stay local.

        Returns:
            (attention input [T_kv, H], the context that addresses those tokens, the compressor input [T_kv, H] on
            layers that own a compressor, else None).
        """
        needs_hidden = self.compressor is not None
        if isinstance(ctx, ContextParallelContext):
            x_all = ctx.gather(x)
            hidden = None
            if needs_hidden:
                hidden = x_all if compressor_input is None else ctx.gather_shared_hidden(compressor_input)
            return x_all, ctx.full, hidden
        hidden = (x if compressor_input is None else compressor_input) if needs_hidden else None
        return x, ctx, hidden

    def _window_kv(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """SWA KV of the step's tokens: ``RoPE(kv_norm(x · wkvᵀ))``, encoded in the ring format.

        Returns:
            ``(encoded [T, bytes] uint8, dequantized [T, D] fp32)``.
        """
        kv = self.rope.rotate(self.kv_norm(self.wkv(x)), ctx.meta.positions)
        codec = ctx.state.codec(self.swa_group)
        encoded = codec.encode(kv)
        return encoded, codec.decode(encoded)

    def _write_window(self, encoded: torch.Tensor, ctx: StepContext) -> None:
        """Store the last ``min(q_len, ring)`` tokens of every request in the ring (model-attention §10.1)."""
        rows, keep = ctx.meta.ring_tail(ctx.state.ring_size(self.swa_group))
        ctx.state.write_encoded(self.swa_group, self.spec.layer_id, rows, encoded if keep is None else encoded[keep])

    def store_window_keys(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Project and store window keys without attending (DSpark context keys, dspark.md §4).

        Args:
            x: [T, H] the projected target features (activation dtype).
        """
        encoded, _ = self._window_kv(x, ctx)
        self._write_window(encoded, ctx)

    def _swa_keys(self, ctx: StepContext, kv_x: torch.Tensor, kv_ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every query's window (history read before this step's ring write), then store the chunk's tail.

        Args:
            ctx: the queries' context.
            kv_x: [T_kv, H] attention input of the key tokens (see ``_key_tokens``).
            kv_ctx: their context.

        Returns:
            ([T, W, D] fp32 keys, [T, W] bool validity).
        """
        meta, kv_meta, state = ctx.meta, kv_ctx.meta, ctx.state
        encoded, kv_hat = self._window_kv(kv_x, kv_ctx)
        ring = state.ring_size(self.swa_group)
        offsets = torch.arange(self.window, device=kv_hat.device) - (self.window - 1)
        positions = meta.positions[:, None] + offsets[None, :]
        request = meta.token_request[:, None].expand_as(positions)
        history = state.read(self.swa_group, self.spec.layer_id, kv_meta.ring_rows(request, positions, ring))
        in_chunk = kv_meta.in_chunk(request, positions)
        keys = torch.where(in_chunk[..., None], kv_hat[kv_meta.chunk_index(request, positions)], history)
        self._write_window(encoded, kv_ctx)
        return keys, positions >= 0

    def _draft_keys(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of a DSpark draft block (dspark.md §5 step 4): the ``W`` context keys before the block, read from the
        ring, then every draft key of the same request (non-causal); the draft keys are then stored in the ring.

        Returns:
            ([T, W + B, D] fp32 keys, [T, W + B] bool validity), ``B`` the longest block of the step.
        """
        meta, state = ctx.meta, ctx.state
        encoded, kv_hat = self._window_kv(x, ctx)
        ring = state.ring_size(self.swa_group)
        request = meta.token_request
        offsets = torch.arange(self.window, device=kv_hat.device) - self.window
        context = meta.q_start[request][:, None] + offsets[None, :]
        history = state.read(self.swa_group, self.spec.layer_id, meta.ring_rows(request[:, None], context, ring))
        block = meta.max_query_len
        slots = torch.arange(block, device=kv_hat.device)[None, :]
        in_block = slots < meta.q_len[request][:, None]
        drafts = kv_hat[(meta.cu_query_lens[request][:, None] + slots).clamp(max=max(meta.num_tokens - 1, 0))]
        self._write_window(encoded, ctx)
        return torch.cat([history, drafts], dim=1), torch.cat([context >= 0, in_block], dim=1)

    def _compressed_keys(
        self,
        q_latent: torch.Tensor,
        x: torch.Tensor,
        ctx: StepContext,
        kv_ctx: StepContext,
        kv_hidden: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the compressor / indexer roles of this layer and gather the selected rows.

        Args:
            q_latent: [T, q_r] ``q_norm`` output of the queries.
            x: [T, H] the queries' ``attn_norm`` output.
            ctx: the queries' context.
            kv_ctx: the context of the key tokens (see ``_key_tokens``).
            kv_hidden: [T_kv, H] compressor input of the key tokens on layers that own a compressor.

        Returns:
            ([T, K, D] fp32 dequantized rows, [T, K] bool).
        """
        spec, meta, state = self.spec, ctx.meta, ctx.state
        layer = spec.layer_id
        if self.compressor is not None:
            assert kv_hidden is not None
            ctx.new_rows[layer] = self.compressor(kv_hidden, kv_ctx, layer, self.rope)
        if spec.owns_index_k:
            assert self.indexer is not None
            self.indexer.write_keys(ctx.new_rows[spec.kv_source], spec.compress_ratio, kv_ctx, layer, self.rope)
        if self.selection is not None:
            assert self.indexer is not None
            ctx.topk[layer] = self.indexer.select(q_latent, x, ctx, self.rope, self.selection)
        selected = ctx.topk[spec.index_source]
        group = compressed_group(spec.compress_ratio)
        request = meta.token_request[:, None].expand_as(selected)
        rows = meta.paged_rows(request, selected, state.rows_per_block(group))
        return state.read(group, spec.kv_source, rows), selected >= 0
