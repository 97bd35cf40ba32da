"""Attention of every layer kind (docs/design/attention.md, "Per-query attention"): MLA-style low-rank q, one shared K=V
vector per token in a sliding window, plus — on compressed layers — ``index_topk`` compressed rows chosen by the
indexer.

Per step and layer, in order: project q and the SWA KV of the key tokens; (kv source) form and store compressed
rows; (index-K source) store index keys; (index source) select top-k rows, else reuse the source's; attend over
``window ∪ selected rows`` with the per-head sink; store the chunk's tail in the SWA ring (after the attention read
the history it may overwrite); de-rotate; grouped ``wo_a``; ``wo_b``. Sharing roles come from the layer's
``LayerSpec``. Keys reach ``deepinfer_kernels.sparse_attention`` as row lists into cached pools (``KeySource``): the
ring history, the step's fresh window keys (encoded into a scratch pool, so they read back exactly as the cache will
hold them) and the selected compressed rows — never as a gathered ``[tokens, keys, D]`` tensor of the whole step
(docs/design/attention.md, "Sparse attention").
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import KeySource, sparse_attention, window_key_rows
from deepinfer_kernels.branch_streams import fork
from deepinfer_model.config import LayerSpec, TextConfig
from deepinfer_model.deepseek_v41.compressor import Compressor
from deepinfer_model.deepseek_v41.context import StepContext, compressed_group
from deepinfer_model.deepseek_v41.indexer import Indexer, IndexSelection
from deepinfer_model.layers.linear import Fp8BlockLinear, Fp8Copy, Fp8GroupedLinear, make_parameter
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RopeTable, RotaryEmbedding
from deepinfer_model.state import ModelState, StepMetadata

__all__ = ["FUSED_OUTPUT_HEADS", "Attention"]

# Head counts whose attention output is quantized to FP8 straight from the FP32 accumulator (the fused kernel of the
# reference release); any other head count leaves the attention as BF16
# (docs/design/numerics.md, "Attention output rounding").
FUSED_OUTPUT_HEADS = frozenset({64, 128})


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
                candidate_block_size=cfg.candidate_block_size or 0,
                produces_candidates=spec.is_candidate_source,
            )
            if spec.owns_indexer
            else None
        )

    def forward(self, x: torch.Tensor, ctx: StepContext, x_fp8: Fp8Copy | None = None) -> torch.Tensor:
        """Attention of one layer for the step's tokens.

        The layer computes and stores the keys of every key token of the step (``ctx.key_tokens``: its own tokens,
        or under context parallelism every chunk token gathered over the CP group), while queries stay local.

        Args:
            x: [T, H] ``attn_norm`` output of the local tokens (activation dtype).
            ctx: step context with metadata, state and cross-layer values.
            x_fp8: the FP8 copy of ``x`` from a fused norm, or None (``Fp8BlockLinear.forward``).

        Returns:
            [T, H] activation dtype.
        """
        meta = ctx.meta
        num_tokens = meta.num_tokens
        kv_x = ctx.key_tokens(x)
        # The window keys run beside the queries (a side stream under branch streams; docs/design/kernels.md, "Branch
        # streams"); the step's rotations are built first, on this stream, as both read them.
        key_table, table = self.rope.table_at(ctx.key_meta), self.rope.table_at(meta)
        forked = fork(x.device, self._window_kv, kv_x, key_table, ctx.state, x_fp8 if kv_x is x else None)
        q_latent, q_latent_fp8 = self.q_norm.with_fp8_copy(self.wq_a(x, fp8_copy=x_fp8))
        q = self.wq_b(q_latent, fp8_copy=q_latent_fp8).view(num_tokens, self.n_heads, self.head_dim)
        q = self.rope.rotate_(q, table)
        fresh = forked.result()
        sources = self._draft_sources(fresh, ctx) if ctx.draft else self._window_sources(fresh, ctx)
        if self.spec.is_compressed:
            sources.append(self._compressed_source(q_latent, x, kv_x, ctx))
        # FlashMLA's BF16 output stays BF16 (widen=False): the fused head counts' de-rotation reads its values in FP32.
        out = sparse_attention(
            q, sources, self.attn_sink, self.softmax_scale, self.mode is ComputeMode.EXACT, widen=False
        )
        self._write_window(fresh, ctx.key_meta, ctx.state)
        # De-rotation and the FP8 quantization of ``wo_a`` read the attention output as it left the kernel: FP32
        # values for the fused head counts, de-rotated inside wo_a's quantization; BF16 otherwise
        # (docs/design/numerics.md, "Attention output rounding").
        inverse = self.rope.table_at(meta, inverse=True)
        if self.mode is ComputeMode.EXACT and self.n_heads not in FUSED_OUTPUT_HEADS:
            out = self.rope.rotate_(out.to(torch.bfloat16), inverse)
            return self.wo_b(self.wo_a(out.reshape(num_tokens, -1)))
        return self.wo_b(self.wo_a.forward_rotated(out, *inverse))

    def _window_kv(
        self, x: torch.Tensor, table: RopeTable, state: ModelState, x_fp8: Fp8Copy | None = None
    ) -> torch.Tensor:
        """SWA KV of the key tokens ``RoPE(kv_norm(x · wkvᵀ))`` (``table``: their rotations), encoded in the ring
        format: ``[T_kv, bytes]`` uint8, the scratch pool the step's fresh window keys are read from."""
        kv = self.rope.rotate_(self.kv_norm(self.wkv(x, fp8_copy=x_fp8)), table)
        return state.codec(self.swa_group).encode(kv)

    def _write_window(self, encoded: torch.Tensor, meta: StepMetadata, state: ModelState) -> None:
        """Store the last ``min(q_len, ring)`` tokens of every request in the ring (docs/design/cache.md, "Rings")."""
        rows, keep = meta.ring_tail(state.ring_size(self.swa_group))
        state.write_encoded(self.swa_group, self.spec.layer_id, rows, encoded if keep is None else encoded[keep])

    def store_window_keys(self, x: torch.Tensor, meta: StepMetadata, state: ModelState) -> None:
        """Project and store window keys without attending (DSpark context keys; docs/design/model.md, "Context keys").

        Args:
            x: [T, H] the projected target features of the tokens ``meta`` addresses (activation dtype).
            meta: index math of those tokens.
            state: the cache pools.
        """
        self._write_window(self._window_kv(x, self.rope.table_at(meta), state), meta, state)

    def _window_sources(self, fresh: torch.Tensor, ctx: StepContext) -> list[KeySource]:
        """Every query's window ``t − W + 1 … t`` (``window_rows``): positions before the step from the ring (read
        before this step's ring write), positions of the step from the fresh keys. A YOCO consumer layer of a
        truncated prefill step sees positions ``≥ window_floor`` only (docs/design/attention.md, "YOCO prefill
        truncation").

        Args:
            fresh: [T_kv, bytes] encoded window keys of the key tokens.
            ctx: the step context.

        Returns:
            [ring history, fresh keys], each with [T, W] rows.
        """
        state = ctx.state
        ring = state.ring_size(self.swa_group)
        floored = self.spec.is_yoco_consumer and ctx.meta.window_floor is not None
        history, own = ctx.memo.get(
            ("window_rows", ring, self.window, floored),
            lambda: window_rows(ctx.meta, ctx.key_meta, ring, self.window, floored),
        )
        fmt = state.codec(self.swa_group).row_format
        return [
            KeySource(state.pool(self.swa_group, self.spec.layer_id), history, fmt),
            KeySource(fresh, own, fmt),
        ]

    def _draft_sources(self, fresh: torch.Tensor, ctx: StepContext) -> list[KeySource]:
        """Keys of a DSpark draft block (``draft_rows``; docs/design/model.md, "Draft forward").

        Returns:
            [ring context with [T, W] rows, draft keys with [T, B] rows].
        """
        state = ctx.state
        ring = state.ring_size(self.swa_group)
        history, drafts = ctx.memo.get(
            ("draft_rows", ring, self.window), lambda: draft_rows(ctx.meta, ring, self.window)
        )
        fmt = state.codec(self.swa_group).row_format
        return [
            KeySource(state.pool(self.swa_group, self.spec.layer_id), history, fmt),
            KeySource(fresh, drafts, fmt),
        ]

    def _compressed_source(
        self, q_latent: torch.Tensor, x: torch.Tensor, kv_x: torch.Tensor, ctx: StepContext
    ) -> KeySource:
        """Run the compressor / indexer roles of this layer; the selected compressed rows of every query.

        Args:
            q_latent: [T, q_r] ``q_norm`` output of the queries.
            x: [T, H] the queries' ``attn_norm`` output.
            kv_x: [T_kv, H] ``attn_norm`` output of the key tokens.
            ctx: the step context.

        Returns:
            The kv source's compressed pool with [T, K] rows.
        """
        spec, state = self.spec, ctx.state
        layer = spec.layer_id
        if self.compressor is not None:
            # YOCO consumer kv sources compress the shared hidden, not their own input (docs/design/model.md, "YOCO").
            # They write rows for every token even when the consumer half computes fewer queries.
            hidden = ctx.key_shared_hidden() if spec.is_yoco_consumer else kv_x
            ctx.new_rows[layer] = self.compressor(hidden, ctx.step_meta, state, layer, self.rope)
        if spec.owns_index_k:
            assert self.indexer is not None
            self.indexer.write_keys(
                ctx.new_rows[spec.kv_source], spec.compress_ratio, ctx.step_meta, state, layer, self.rope
            )
        if self.selection is not None:
            assert self.indexer is not None
            ctx.topk[layer] = self.indexer.select(q_latent, x, ctx, self.rope, self.selection)
        group = compressed_group(spec.compress_ratio)
        rows_per_block = state.rows_per_block(group)
        # Every layer reading the same index source's selection reads the same flat rows. Memo key: the index source
        # and the page geometry; valid while ``ctx.topk`` holds that source's selection (the memo is cleared when
        # ``enter_consumer_half`` replaces it).
        rows = ctx.memo.get(
            ("selected_rows", spec.index_source, rows_per_block),
            lambda: selected_rows(ctx.meta, ctx.topk[spec.index_source], rows_per_block),
        )
        return KeySource(state.pool(group, spec.kv_source), rows, state.codec(group).row_format)


def window_rows(
    meta: StepMetadata, key_meta: StepMetadata, ring: int, window: int, floored: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every query's window keys ``t − W + 1 … t`` are read from: ring rows for positions before the step,
    fresh-key rows (chunk indices) for positions of the step. The same for every layer with the same ring size and
    window, and the same YOCO floor role (``floored``: positions below ``meta.window_floor`` are not seen), so a
    step builds it once (``StepContext.memo``).

    Args:
        meta: index math of the queries.
        key_meta: index math of the key tokens (their chunk and cache addressing).
        ring: ring size of the layer's SWA group.
        window: ``W``.
        floored: apply ``meta.window_floor``.

    Returns:
        ``(history, own)``: [T, W] int64 flat ring rows and [T, W] int64 fresh-key rows, −1 = not read.
    """
    if floored and meta.window_floor is None:
        raise RuntimeError("a floored window needs the step's window_floor (YOCO prefill truncation)")
    # The kernels' window_key_rows: one launch on a GPU.
    return window_key_rows(
        meta.positions,
        meta.token_request,
        key_meta.q_start,
        key_meta.cu_query_lens,
        key_meta.state_slots,
        meta.window_floor if floored else None,
        ring,
        window,
        key_meta.num_tokens,
    )


def draft_rows(meta: StepMetadata, ring: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a DSpark draft block's keys are read from (docs/design/model.md, "Draft forward"): the ``W`` context keys
    before the block from the ring, then every draft key of the same request (non-causal, ``B`` = the longest block
    of the step). The same for every DSpark layer with the same ring size and window (``StepContext.memo``).

    Returns:
        ``(history, drafts)``: [T, W] int64 flat ring rows and [T, B] int64 fresh-key rows, −1 = not read.
    """
    device = meta.positions.device
    request = meta.token_request
    offsets = torch.arange(window, device=device) - window
    context = meta.q_start[request][:, None] + offsets[None, :]
    history = torch.where(context >= 0, meta.ring_rows(request[:, None], context, ring), -1)
    slots = torch.arange(meta.max_query_len, device=device)[None, :]
    in_block = slots < meta.q_len[request][:, None]
    drafts = torch.where(in_block, meta.cu_query_lens[request][:, None] + slots, -1)
    return history, drafts


def selected_rows(meta: StepMetadata, selected: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """Flat paged rows [T, K] int64 of the selected logical rows ``selected`` [T, K] of each query, −1 = none."""
    return meta.paged_rows(meta.token_request, selected, rows_per_block)
