"""Attention of the reference model (``deepinfer_model.reference``, the golden oracle): sliding window, compressor,
indexer, candidate blocks, cross-layer sharing and YOCO (docs/design/attention.md). Public names are re-exported by
``reference``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from deepinfer_model.config import TextConfig
from deepinfer_model.reference_blocks import (
    WeightSource,
    _bf16_linear,
    _fp8_linear,
    _RopeTable,
    apply_rope,
    rms_norm,
)
from deepinfer_model.reference_formats import (
    BF16,
    Precision,
    _Numerics,
    _numerics,
    fp4_e4m3_quant_dequant,
    fp4_ue8m0_quant_dequant,
    fp8_quant_dequant,
)

# ==================================================================================================================
# 8. Attention: SWA, compressor, indexer, candidate blocks, sharing, YOCO (docs/design/attention.md)
# ==================================================================================================================


def sparse_source_map(source_ids: Sequence[int], num_layers: int) -> list[int]:
    """Layer → nearest source id at or before it; layers below the first source map to themselves
    (docs/design/model.md, "Layer roles").

    Args:
        source_ids: non-empty source layer ids.
        num_layers: number of backbone layers ``L``.

    Returns:
        ``L`` layer ids.
    """
    sources = sorted(set(source_ids))
    if not sources:
        raise ValueError("a source layer id list must be non-empty")
    mapping = []
    for layer in range(num_layers):
        below = [s for s in sources if s <= layer]
        mapping.append(below[-1] if below else layer)
    return mapping


def compress_kv(
    hidden: Tensor,
    wkv: Tensor,
    wgate: Tensor | None,
    norm: Tensor,
    ratio: int,
    eps: float,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """Compressed rows before RoPE, ``pre_rope_kv`` (docs/design/attention.md, "Compressed rows"); one row per complete
    block of ``c`` tokens.

    Ratio ≥ 2: per channel, softmax over the block's tokens of the FP32 gate scores weights the FP32 latents; the
    FP32 sum is rounded to BF16. Ratio 1: the BF16 latent itself. Then RMSNorm with ``compressor.norm``.

    Args:
        hidden: ``[..., n, H]`` BF16 compressor input of one sequence or a batch of them (FP32 in fp32 precision).
        wkv: ``[D, H]`` BF16 ``compressor.wkv``.
        wgate: ``[D, H]`` BF16 ``compressor.wgate`` for ratio ≥ 2, None for ratio 1.
        norm: ``[D]`` BF16 ``compressor.norm``.
        ratio: compress ratio ``c``.
        eps: ``rms_norm_eps``.
        precision: ``"fp32"`` skips the BF16 roundings of the latent and of the norm output.

    Returns:
        ``[..., n // c, D]`` BF16 (FP32 in fp32 precision).
    """
    if (ratio == 1) != (wgate is None):
        raise ValueError(f"compress ratio {ratio} needs {'no' if ratio == 1 else 'a'} compressor gate weight")
    num = _numerics(precision)
    rows = hidden.shape[-2] // ratio
    if wgate is None:
        latent = num.bf16(_bf16_linear(hidden[..., :rows, :], wkv))
    else:
        blocks = hidden[..., : rows * ratio, :]
        score = _bf16_linear(blocks, wgate).unflatten(-2, (rows, ratio))
        value = _bf16_linear(blocks, wkv).unflatten(-2, (rows, ratio))
        latent = num.bf16((torch.softmax(score, dim=-2) * value).sum(-2))
    return rms_norm(latent, norm, eps, precision=precision)


def _rope_rows(rows: Tensor, cos: Tensor, sin: Tensor, ratio: int) -> Tensor:
    """RoPE of compressed row ``b`` (``rows``: ``[..., R, D]``) at position ``b·c`` (the block's first raw position)."""
    positions = torch.arange(rows.shape[-2]) * ratio
    return apply_rope(rows, cos[positions], sin[positions])


def index_scores(query: Tensor, head_weights: Tensor, keys: Tensor, *, precision: Precision = "exact") -> Tensor:
    """Indexer logits ``I(t, b) = Σ_h w[t,h]·max(0, q̂[t,h]·û_b)`` in FP32, stored BF16
    (docs/design/attention.md, "Index scores").

    Args:
        query: ``[..., n, n_i, d_i]`` FP32 dequantized FP4 index queries (leading dims: a batch of sequences).
        head_weights: ``[..., n, n_i]`` BF16 ``weights_proj`` output.
        keys: ``[..., R, d_i]`` FP32 dequantized FP4 index keys.
        precision: ``"fp32"`` skips the BF16 rounding of the logits.

    Returns:
        ``[..., n, R]`` BF16 (FP32 in fp32 precision).
    """
    dots = torch.einsum("...thd,...bd->...thb", query, keys).clamp_min(0)
    return _numerics(precision).bf16((dots * head_weights.float()[..., None]).sum(-2))


def select_topk(scores: Tensor, eligible: Tensor, k: int) -> Tensor:
    """Top-``k`` eligible rows per query, larger score first and ties to the lower row
    (docs/design/attention.md, "Top-k selection").

    Args:
        scores: ``[..., n, R]`` BF16 or FP32 (leading dims: a batch of sequences).
        eligible: ``[..., n, R]`` bool, broadcastable to ``scores``.
        k: rows to keep.

    Returns:
        ``[..., n, k]`` int64 row ids in ascending order, padded with −1 when fewer than ``k`` rows are eligible.
    """
    num_rows = scores.shape[-1]
    eligible = eligible.expand_as(scores)
    keyed = scores.float().masked_fill(~eligible, -math.inf)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.where(eligible.gather(-1, order), order, num_rows)
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((*scores.shape[:-1], k), -1, dtype=torch.int64)
    out[..., : chosen.shape[-1]] = torch.where(chosen < num_rows, chosen, -1)
    return out


def candidate_block_mask(scores: Tensor, valid: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """Rows inside the candidate blocks of each query (docs/design/attention.md, "Candidate blocks").

    Blocks of ``block_size`` rows score the max of their valid logits (capped at the largest finite BF16); the block
    holding row ``klen − 1`` scores +∞; the ``num_blocks`` best valid blocks are kept (ties to the lower block).

    Args:
        scores: ``[..., n, R]`` BF16 indexer logits of the candidate source (leading dims: a batch of sequences).
        valid: ``[..., n, R]`` bool, a prefix ``b < klen(t)`` per query, broadcastable to ``scores``.
        block_size: ``candidate_block_size``.
        num_blocks: ``candidate_topk_blocks``.

    Returns:
        ``[..., n, R]`` bool: valid rows inside a chosen block.
    """
    *lead, num_rows = scores.shape
    num_all = -(-num_rows // block_size)
    pad = num_all * block_size - num_rows
    valid = valid.expand_as(scores)
    keyed = scores.float().masked_fill(~valid, -math.inf)
    keyed = torch.cat([keyed, torch.full((*lead, pad), -math.inf)], -1).unflatten(-1, (num_all, block_size))
    has_valid = torch.cat([valid, torch.zeros(*lead, pad, dtype=torch.bool)], -1).unflatten(-1, (num_all, block_size))
    has_valid = has_valid.any(-1)
    block_score = keyed.amax(-1).clamp_max(torch.finfo(BF16).max)
    klen = valid.sum(-1)
    last = torch.arange(num_all) == ((klen - 1) // block_size)[..., None]
    block_score = torch.where(last & (klen[..., None] > 0), math.inf, block_score).masked_fill(~has_valid, -math.inf)
    order = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[..., :num_blocks]
    chosen = torch.zeros(*lead, num_all, dtype=torch.bool).scatter(-1, order, has_valid.gather(-1, order))
    return chosen.repeat_interleave(block_size, -1)[..., :num_rows] & valid


def attention_core(
    query: Tensor, keys: Tensor, mask: Tensor, sink: Tensor, softmax_scale: float, *, precision: Precision = "exact"
) -> Tensor:
    """One softmax per head over each query's keys plus the per-head sink; K = V
    (docs/design/attention.md, "Per-query attention"). ``attention_over_key_sets`` with one key set.

    Args:
        query: ``[..., nq, n_h, D]`` BF16 (RoPE applied; FP32 in fp32 precision).
        keys: ``[..., nq, nk, D]`` FP32 dequantized keys of each query, or ``[..., nk, D]`` keys every query reads
            (also the values).
        mask: ``[..., nq, nk]`` bool, True = visible.
        sink: ``[n_h]`` FP32 sink logits (zero value vector).
        softmax_scale: ``D^−0.5``.
        precision: ``"fp32"`` skips the BF16 rounding of the probabilities in the value product.

    Returns:
        ``[..., nq, n_h, D]`` FP32 (zeros for a query without visible keys).
    """
    return attention_over_key_sets(query, [(keys, mask)], sink, softmax_scale, precision=precision)


def attention_over_key_sets(
    query: Tensor,
    key_sets: Sequence[tuple[Tensor, Tensor]],
    sink: Tensor,
    softmax_scale: float,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """``attention_core`` with one softmax over the union of several key sets, each ``(keys, mask)`` as there.

    A set of keys shared by all queries (``[..., nk, D]``, e.g. a sequence's window keys under a ``[nq, nk]``
    visibility mask) is never copied per query: at 1,024 tokens a per-query copy of a sequence's keys is 0.5 GiB a
    layer. Sets of per-query keys (``[..., nq, nk, D]``, e.g. each query's selected compressed rows) are read as
    given. The max subtracted before ``exp`` cancels in the quotient, so no gradient is taken through it (and the
    scores are not kept for one).
    """
    if not key_sets:
        raise ValueError("attention needs at least one key set")
    logits = []
    for keys, mask in key_sets:
        shared = keys.dim() == query.dim() - 1
        scores = torch.einsum("...qhd,...kd->...qhk" if shared else "...qhd,...qkd->...qhk", query.float(), keys)
        logits.append((scores * softmax_scale).masked_fill(~mask[..., None, :], -math.inf))
    peak = torch.maximum(torch.stack([part.detach().amax(-1) for part in logits]).amax(0), sink.detach())
    denominator = torch.exp(sink - peak)
    numerator: Tensor | None = None
    for (keys, _), part in zip(key_sets, logits, strict=True):
        probs = torch.exp(part - peak[..., None])
        denominator = probs.sum(-1) + denominator
        shared = keys.dim() == query.dim() - 1
        spec = "...qhk,...kd->...qhd" if shared else "...qhk,...qkd->...qhd"
        term = torch.einsum(spec, _numerics(precision).bf16(probs).float(), keys)
        numerator = term if numerator is None else numerator + term
    assert numerator is not None
    return numerator / denominator[..., None]


def swa_visibility(num_tokens: int, window: int) -> Tensor:
    """Sliding-window visibility of a causal sequence: query ``t`` sees positions ``max(0, t−W+1) … t``.

    Returns:
        ``[n, n]`` bool, ``[t, s]`` True when key position ``s`` is visible to query ``t``.
    """
    positions = torch.arange(num_tokens)
    offset = positions[:, None] - positions[None, :]
    return (offset >= 0) & (offset < window)


def _project_query_and_key(
    text: TextConfig, w: WeightSource, num: _Numerics, prefix: str, x: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Q latent, heads and the layer's own SWA key (docs/design/attention.md, "Per-query attention").

    Args:
        x: ``[..., n, H]`` BF16 attention input; ``cos``/``sin`` ``[..., n, r/2]`` rows of the tokens' positions
            (broadcastable: one table serves a batch of sequences).

    Returns:
        q ``[..., n, n_h, D]`` BF16 roped; the FP8-read ``q_norm`` output ``[..., n, q_r]`` FP32 (indexer input);
        the SWA key ``[..., n, D]`` FP32 as read back from its FP8 storage.
    """
    eps, p = text.rms_norm_eps, num.precision
    x_q = num.act_quant(x)
    q_latent = rms_norm(num.bf16(x_q @ w.fp8(f"{prefix}.wq_a").T), w[f"{prefix}.q_norm.weight"], eps, precision=p)
    q_latent_q = num.act_quant(q_latent)
    q = num.bf16(q_latent_q @ w.fp8(f"{prefix}.wq_b").T).unflatten(-1, (text.num_attention_heads, text.head_dim))
    q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
    kv = rms_norm(num.bf16(x_q @ w.fp8(f"{prefix}.wkv").T), w[f"{prefix}.kv_norm.weight"], eps, precision=p)
    return q, q_latent_q, num.store(apply_rope(kv, cos, sin), fp8_quant_dequant)


FUSED_OUTPUT_HEADS = (64, 128)  # head counts whose attention output is FP8-quantized straight from FP32


def _attention_output(
    text: TextConfig, w: WeightSource, num: _Numerics, prefix: str, out: Tensor, cos: Tensor, sin: Tensor
) -> Tensor:
    """De-rotate, grouped ``wo_a`` and ``wo_b``: ``[..., n, n_h, D]`` FP32 → ``[..., n, H]`` BF16
    (docs/design/attention.md, "Per-query attention").

    Only the fused 64/128-head kernel hands the output on in FP32; any other head count leaves the attention as BF16,
    and de-rotation and the FP8 quantization read that (docs/design/numerics.md, "Attention output rounding").
    """
    groups = text.o_groups
    if text.num_attention_heads not in FUSED_OUTPUT_HEADS:
        out = num.bf16(out)
    out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True).flatten(-2).unflatten(-1, (groups, -1))
    wo_a = w.fp8(f"{prefix}.wo_a")
    rank = wo_a.shape[0] // groups
    grouped = [num.act_quant(out[..., g, :]) @ wo_a[g * rank : (g + 1) * rank].T for g in range(groups)]
    return _fp8_linear(num, torch.cat(grouped, dim=-1), w.fp8(f"{prefix}.wo_b"))


@dataclass
class _AttentionState:
    """Per-forward attention objects keyed by the layer that produced them.

    Consumer layers read compressed rows, index keys and top-k from their sources
    (docs/design/attention.md, "Cross-layer sharing"); the SWA keys, compressed keys and index keys are also what a
    cache would hold (read back from their storage formats).
    """

    swa_keys: dict[int, Tensor] = field(default_factory=dict)
    pre_rope_kv: dict[int, Tensor] = field(default_factory=dict)
    compressed_keys: dict[int, Tensor] = field(default_factory=dict)
    index_keys: dict[int, Tensor] = field(default_factory=dict)
    topk: dict[int, Tensor] = field(default_factory=dict)
    selected_rows: dict[int, Tensor] = field(default_factory=dict)
    candidates: Tensor | None = None
    shared_hidden: Tensor | None = None


def _source(produced: Mapping[int, Tensor], source: int, layer: int, what: str) -> Tensor:
    if source not in produced:
        raise ValueError(f"layer {layer} reads the {what} of layer {source}, which is not a compressed source layer")
    return produced[source]


def _selected_rows(
    text: TextConfig,
    w: WeightSource,
    num: _Numerics,
    layer: int,
    x: Tensor,
    q_latent: Tensor,
    state: _AttentionState,
    rope: _RopeTable,
) -> Tensor:
    """Compressed rows attended by each query of a compressed layer: ``[B, n, K]`` int64, −1 padded (``x``:
    ``[B, n, H]``, a batch of sequences; every object below is per sequence).

    Runs, in the write order of a step (docs/design/cache.md, "Write order within a step"), whatever this layer owns:
    compressor (KV source), index keys (index-K source), indexer top-k (index source, restricted to candidate blocks
    after the candidate source).
    """
    prefix = f"layers.{layer}.attn"
    eps, p = text.rms_norm_eps, num.precision
    n = x.shape[-2]
    ratio = text.compress_ratios[layer]
    num_layers = text.num_hidden_layers
    kv_source = sparse_source_map(text.kv_source_layer_ids, num_layers)[layer]
    index_source = sparse_source_map(text.index_source_layer_ids, num_layers)[layer]
    index_k_source = sparse_source_map(text.index_k_source_layer_ids, num_layers)[layer]
    if kv_source == layer:
        hidden = x
        if text.n_prefill_layer <= layer < num_layers:  # YOCO consumer: compress the shared hidden
            assert state.shared_hidden is not None  # set by the boundary layer, which runs first
            hidden = state.shared_hidden
        gate = w[f"{prefix}.compressor.wgate.weight"] if ratio > 1 else None
        wkv, norm = w[f"{prefix}.compressor.wkv.weight"], w[f"{prefix}.compressor.norm.weight"]
        pre = compress_kv(hidden, wkv, gate, norm, ratio, eps, precision=p)
        roped = _rope_rows(pre, rope.cos, rope.sin, ratio)
        state.pre_rope_kv[layer] = pre
        storage = fp4_e4m3_quant_dequant if text.use_fp4_sparse_kv else fp8_quant_dequant
        state.compressed_keys[layer] = num.store(roped, storage)
    if index_k_source == layer:
        pre = _source(state.pre_rope_kv, kv_source, layer, "compressed rows")
        k = num.bf16(_bf16_linear(pre, w[f"{prefix}.indexer.wk.weight"]))
        k = rms_norm(k, w[f"{prefix}.indexer.k_norm.weight"], eps, precision=p)
        state.index_keys[layer] = num.store(_rope_rows(k, rope.cos, rope.sin, ratio), fp4_ue8m0_quant_dequant)
    if index_source == layer:
        shape = (text.index_n_heads, text.index_head_dim)
        q_index = num.bf16(q_latent @ w.fp8(f"{prefix}.indexer.wq_b").T).unflatten(-1, shape)
        # The index query is quantized with the index-K storage recipe before scoring
        # (docs/design/numerics.md, "KV storage formats").
        q_index = num.store(apply_rope(q_index, rope.cos[:n, None], rope.sin[:n, None]), fp4_ue8m0_quant_dequant)
        head_weights = num.bf16(_bf16_linear(x, w[f"{prefix}.indexer.weights_proj.weight"]))
        index_keys = _source(state.index_keys, index_k_source, layer, "index keys")
        scores = index_scores(q_index, head_weights, index_keys, precision=p)
        klen = (torch.arange(n) + 1) // ratio
        valid = torch.arange(scores.shape[-1])[None, :] < klen[:, None]  # [n, R], the same in every sequence
        eligible = valid
        candidate_source = text.candidate_source_layer_id
        if candidate_source == layer:
            assert text.candidate_block_size is not None and text.candidate_topk_blocks is not None
            state.candidates = candidate_block_mask(
                scores, valid, text.candidate_block_size, text.candidate_topk_blocks
            )
        elif candidate_source is not None and layer > candidate_source:
            if state.candidates is None or state.candidates.shape != scores.shape:
                raise ValueError(f"layer {layer} needs the candidate blocks of layer {candidate_source}")
            eligible = valid & state.candidates
        state.topk[layer] = select_topk(scores, eligible, text.index_topk)
    return _source(state.topk, index_source, layer, "top-k rows")


def _attention_layer(
    text: TextConfig,
    w: WeightSource,
    num: _Numerics,
    layer: int,
    x: Tensor,
    state: _AttentionState,
    rope: _RopeTable,
    window_floor: int | None = None,
) -> Tensor:
    """One backbone attention sub-layer over a whole causal sequence (docs/design/attention.md, "Per-query attention");
    records into ``state``.

    Args:
        x: ``[B, n, H]`` BF16 ``attn_norm`` output of ``B`` sequences, tokens at positions ``0 … n−1``.
        rope: the layer kind's table with at least ``n`` positions.
        window_floor: ``rect_lo`` of ``mask`` YOCO prefill truncation (window keys below it are invisible), or None.

    Returns:
        the attention output ``[B, n, H]`` BF16.
    """
    prefix = f"layers.{layer}.attn"
    batch, n = x.shape[:2]
    if layer == text.n_prefill_layer:
        state.shared_hidden = x  # YOCO shared hidden: the boundary layer's attention input
    cos, sin = rope.cos[:n], rope.sin[:n]
    q, q_latent, swa_keys = _project_query_and_key(text, w, num, prefix, x, cos, sin)
    state.swa_keys[layer] = swa_keys
    # The window keys are shared by a sequence's queries: masked scores over [n, n], no per-query copy of them.
    mask = swa_visibility(n, text.sliding_window)
    if window_floor is not None:
        mask = mask & (torch.arange(n) >= window_floor)[None, :]
    key_sets = [(swa_keys, mask)]
    if text.compress_ratios[layer] > 0:
        rows = _selected_rows(text, w, num, layer, x, q_latent, state, rope)
        state.selected_rows[layer] = rows
        kv_source = sparse_source_map(text.kv_source_layer_ids, text.num_hidden_layers)[layer]
        compressed = _source(state.compressed_keys, kv_source, layer, "compressed rows")
        padded = torch.cat([compressed, torch.zeros(batch, 1, compressed.shape[-1])], dim=1)
        chosen = torch.where(rows >= 0, rows, compressed.shape[1])
        key_sets.append((padded[torch.arange(batch)[:, None, None], chosen], rows >= 0))  # [B, n, K, D]
    scale = 1.0 / math.sqrt(text.head_dim)
    out = attention_over_key_sets(q, key_sets, w[f"{prefix}.attn_sink"], scale, precision=num.precision)
    return _attention_output(text, w, num, prefix, out, cos, sin)
