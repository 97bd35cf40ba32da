"""DSpark draft blocks of the reference model (docs/design/model.md, "DSpark blocks"): the draft forward after the last
accepted token, its batched form over many anchors (what the built-in checkpoint's trainer runs), and the draft heads.

Built from the pieces of ``deepinfer_model.reference`` (the same decoder block, mHC, attention output and numerics),
so the oracle's target and drafter share one definition.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer_model.config import ModelConfig, TextConfig
from deepinfer_model.reference import _collapse, _decoder_layer, _expand, _Pending
from deepinfer_model.reference_attention import _attention_output, _project_query_and_key, attention_core
from deepinfer_model.reference_blocks import (
    WeightSource,
    _bf16_linear,
    _fp8_linear,
    _layer_rope_table,
    _RopeTable,
    _weight_source,
    apply_rope,
    hc_post,
    rms_norm,
)
from deepinfer_model.reference_formats import F32, Precision, _Numerics, _numerics, fp8_quant_dequant

__all__ = ["DSparkOutput", "reference_dspark_forward", "reference_dspark_forward_anchors", "reference_dspark_heads"]


@dataclass(frozen=True)
class DSparkOutput:
    """Result of one draft forward.

    Attributes:
        hidden: ``[B, H]`` BF16 (FP32 in fp32 precision) pre-norm hidden ``h_k`` of the draft slots (after the final
            mHC collapse).
        positions: ``[B]`` int64 slot positions ``p* + 1 + k``.
        context_positions: ``[min(W, p*+1)]`` int64 positions of the context keys every slot attends
            (``max(0, p*−W+1) … p*``), besides the ``B`` draft keys.
    """

    hidden: Tensor
    positions: Tensor
    context_positions: Tensor


def _dspark_attention(
    text: TextConfig,
    w: WeightSource,
    num: _Numerics,
    prefix: str,
    x: Tensor,
    context_keys: Tensor,
    positions: Tensor,
    rope: _RopeTable,
) -> Tensor:
    """Drafter attention: every slot sees the context keys and all draft keys, non-causal
    (docs/design/model.md, "Draft forward")."""
    cos, sin = rope.cos[positions], rope.sin[positions]
    q, _, draft_keys = _project_query_and_key(text, w, num, prefix, x, cos, sin)
    keys = torch.cat([context_keys, draft_keys])  # [n_ctx + B, D], read by every slot
    mask = torch.ones(x.shape[0], keys.shape[0], dtype=torch.bool)
    scale = 1.0 / math.sqrt(text.head_dim)
    out = attention_core(q, keys, mask, w[f"{prefix}.attn_sink"], scale, precision=num.precision)
    return _attention_output(text, w, num, prefix, out, cos, sin)


def reference_dspark_forward(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    target_features: Tensor,
    anchor_token: int,
    num_slots: int | None = None,
    *,
    precision: Precision = "exact",
) -> DSparkOutput:
    """Draft forward of the DSpark blocks after the last accepted token ``p* = n_ctx − 1``
    (docs/design/model.md, "Context keys", "Draft forward").

    Context keys (``RMSNorm(RMSNorm(F·main_projᵀ)·wkvᵀ)``, RoPE at their position, FP8-stored) are computed for the
    last ``W`` context positions; the slots hold ``[anchor, noise, …, noise]`` at positions ``p* + 1 + k``.

    Args:
        config: the model configuration (``num_nextn_predict_layers`` ≥ 1).
        weights: HF-named stored tensors (``mtp.{i}.*`` plus the shared ``embed.weight``), or a ``WeightSource``.
        target_features: ``[n_ctx, T·H]`` BF16 features of positions ``0 … p*`` (``ReferenceOutput.target_features``;
            FP32 in fp32 precision).
        anchor_token: the golden token ``g`` placed at position ``p* + 1``.
        num_slots: draft block length ``B`` (defaults to ``dspark_block_size``).
        precision: ``"exact"`` or ``"fp32"`` (see "Precision" in the module docstring).

    Returns:
        the slots' pre-norm hidden states and positions.
    """
    text = config.text
    if text.num_nextn_predict_layers < 1:
        raise ValueError("the model has no DSpark blocks (num_nextn_predict_layers = 0)")
    width = text.dspark_num_targets * text.hidden_size
    if target_features.dim() != 2 or target_features.shape[1] != width or target_features.shape[0] == 0:
        raise ValueError(f"target features must be [n_ctx >= 1, {width}], got {tuple(target_features.shape)}")
    slots = text.dspark_block_size if num_slots is None else num_slots
    if slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {slots}")
    num = _numerics(precision)
    w = _weight_source(weights)
    eps = text.rms_norm_eps
    last = target_features.shape[0] - 1
    context = torch.arange(max(0, last - text.sliding_window + 1), last + 1)
    positions = torch.arange(last + 1, last + 1 + slots)
    rope = _layer_rope_table(text, False, last + 1 + slots)
    main = _fp8_linear(num, target_features[context], w.fp8("mtp.0.main_proj"))
    main = rms_norm(main, w["mtp.0.main_norm.weight"], eps, precision=precision)
    tokens = torch.tensor([anchor_token] + [text.dspark_noise_token_id] * (slots - 1), dtype=torch.int64)
    trunk, read_mix = _expand(w, num, tokens, text)
    pending: _Pending | None = None
    for block in range(text.num_nextn_predict_layers):
        prefix = f"mtp.{block}"
        if pending is not None:
            trunk = hc_post(*pending, precision=precision)
        kv = _fp8_linear(num, main, w.fp8(f"{prefix}.attn.wkv"))
        kv = rms_norm(kv, w[f"{prefix}.attn.kv_norm.weight"], eps, precision=precision)
        context_keys = num.store(apply_rope(kv, rope.cos[context], rope.sin[context]), fp8_quant_dequant)

        def attention(x: Tensor, prefix: str = prefix, context_keys: Tensor = context_keys) -> Tensor:
            return _dspark_attention(text, w, num, f"{prefix}.attn", x, context_keys, positions, rope)

        pending, read_mix = _decoder_layer(
            text,
            w,
            num,
            prefix,
            trunk,
            read_mix,
            attention,
            text.dspark_n_routed_experts,
            text.dspark_num_experts_per_tok,
        )
    assert pending is not None
    hidden = _collapse(text, w, num, f"mtp.{text.num_nextn_predict_layers - 1}.", pending, read_mix)
    return DSparkOutput(hidden, positions, context)


def reference_dspark_forward_anchors(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    target_features: Tensor,
    last_positions: Tensor,
    anchor_tokens: Tensor,
    num_slots: int | None = None,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """Many independent draft forwards over one sequence's target features at once, or over each sequence of a batch
    (a trainer's batched form of ``reference_dspark_forward``; same math, each anchor's slots see only its own keys).

    Context keys are computed once for every position; anchor ``a`` (last accepted position ``p*_a``) attends the
    keys of ``max(0, p*_a−W+1) … p*_a`` of its own sequence and its own ``B`` draft keys
    (docs/design/model.md, "Draft forward").

    Args:
        config: the model configuration (``num_nextn_predict_layers`` ≥ 1).
        weights: HF-named stored tensors or a ``WeightSource``.
        target_features: ``[n, T·H]`` features of positions ``0 … n−1``, or ``[S, n, T·H]`` for ``S`` sequences.
        last_positions: ``[A]`` int64 ``p*`` of each anchor in ``[0, n)`` (``[S, A]``: ``A`` anchors per sequence).
        anchor_tokens: ``[A]`` (``[S, A]``) int64 golden token of each anchor (placed at ``p* + 1``).
        num_slots: draft block length ``B`` (defaults to ``dspark_block_size``).
        precision: ``"exact"`` or ``"fp32"``.

    Returns:
        ``[A, B, H]`` (``[S, A, B, H]``) pre-norm hidden of every anchor's slots (BF16; FP32 in fp32 precision).
    """
    text = config.text
    slots = text.dspark_block_size if num_slots is None else num_slots
    batched = target_features.dim() == 3
    shape = last_positions.shape
    if last_positions.dim() != 1 + batched or anchor_tokens.shape != shape or last_positions.numel() == 0:
        raise ValueError("last_positions and anchor_tokens must be equal non-empty 1-D tensors ([S, A] for a batch)")
    features = target_features if batched else target_features[None]  # one sequence is a batch of one
    last, tokens = (last_positions, anchor_tokens) if batched else (last_positions[None], anchor_tokens[None])
    (sequences, n), window = features.shape[:2], text.sliding_window
    if last.shape[0] != sequences:
        raise ValueError(f"got anchors for {last.shape[0]} sequences, target features of {sequences}")
    if bool(((last < 0) | (last >= n)).any()):
        raise ValueError(f"last_positions must lie in [0, {n})")
    num = _numerics(precision)
    w = _weight_source(weights)
    eps = text.rms_norm_eps
    num_anchors = last.shape[1]
    rope = _layer_rope_table(text, False, n + slots)
    context = last[..., None] - window + 1 + torch.arange(window)  # [S, A, W], negative = no key
    visible = torch.cat([context >= 0, torch.ones(sequences, num_anchors, slots, dtype=torch.bool)], -1)
    positions = last[..., None] + 1 + torch.arange(slots)  # [S, A, B]
    main = rms_norm(
        _fp8_linear(num, features, w.fp8("mtp.0.main_proj")),
        w["mtp.0.main_norm.weight"],
        eps,
        precision=precision,
    )
    noise = torch.full((sequences, num_anchors, slots - 1), text.dspark_noise_token_id, dtype=torch.int64)
    trunk, read_mix = _expand(w, num, torch.cat([tokens[..., None], noise], -1).flatten(0, 1), text)
    pending: _Pending | None = None
    for block in range(text.num_nextn_predict_layers):
        prefix = f"mtp.{block}"
        if pending is not None:
            trunk = hc_post(*pending, precision=precision)
        kv = rms_norm(
            _fp8_linear(num, main, w.fp8(f"{prefix}.attn.wkv")),
            w[f"{prefix}.attn.kv_norm.weight"],
            eps,
            precision=precision,
        )
        all_keys = num.store(apply_rope(kv, rope.cos[:n], rope.sin[:n]), fp8_quant_dequant)  # [S, n, D]
        context_keys = all_keys[torch.arange(sequences)[:, None, None], context.clamp_min(0)]  # [S, A, W, D]

        def attention(x: Tensor, prefix: str = f"{prefix}.attn", context_keys: Tensor = context_keys) -> Tensor:
            cos, sin = rope.cos[positions], rope.sin[positions]
            q, _, draft_keys = _project_query_and_key(text, w, num, prefix, x.unflatten(0, positions.shape), cos, sin)
            # An anchor's keys are read by all its slots: [S, A, W + B, D] under the [S, A, 1, W + B] mask.
            keys = torch.cat([context_keys, draft_keys], -2)
            scale = 1.0 / math.sqrt(text.head_dim)
            out = attention_core(q, keys, visible[..., None, :], w[f"{prefix}.attn_sink"], scale, precision=precision)
            return _attention_output(text, w, num, prefix, out, cos, sin).flatten(0, 2)

        pending, read_mix = _decoder_layer(
            text,
            w,
            num,
            prefix,
            trunk,
            read_mix,
            attention,
            text.dspark_n_routed_experts,
            text.dspark_num_experts_per_tok,
        )
    assert pending is not None
    hidden = _collapse(text, w, num, f"mtp.{text.num_nextn_predict_layers - 1}.", pending, read_mix)
    hidden = hidden.unflatten(0, positions.shape)
    return hidden if batched else hidden[0]


def reference_dspark_heads(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    hidden: Tensor,
    previous_tokens: Tensor,
    temperatures: float | Sequence[float] = 1.0,
    *,
    precision: Precision = "exact",
) -> tuple[Tensor, Tensor]:
    """Draft logits and confidences of the slots given each slot's previous token (docs/design/model.md, "Draft heads").

    ``ℓ_k = RMSNorm(h_k)·Eᵀ + markov_embed[prev_k]·markov_headᵀ``;
    ``c_k = σ(clamp([h_k; markov_embed[prev_k]]·proj / τ_k, −60, 60))`` on the pre-norm hidden.

    Args:
        config: the model configuration.
        weights: HF-named stored tensors, or a ``WeightSource``.
        hidden: ``[B, H]`` BF16 from ``reference_dspark_forward`` (FP32 in fp32 precision).
        previous_tokens: ``[B]`` int64, ``[g, d_0, …, d_{B−2}]``.
        temperatures: one confidence temperature or one per slot (each clamped to ≥ 1e−5).
        precision: ``"fp32"`` skips the BF16 rounding of the final norm output.

    Returns:
        logits ``[B, V]`` FP32 and confidences ``[B]`` FP32.
    """
    text = config.text
    w = _weight_source(weights)
    last = f"mtp.{text.num_nextn_predict_layers - 1}"
    normed = rms_norm(hidden, w[f"{last}.norm.weight"], text.rms_norm_eps, precision=precision)
    logits = _bf16_linear(normed, w["head.weight"])
    features = hidden
    if text.dspark_markov_rank > 0:
        markov = w[f"{last}.markov_head.embed.weight"][previous_tokens]
        logits = logits + _bf16_linear(markov, w[f"{last}.markov_head.head.weight"])
        features = torch.cat([hidden, markov.to(hidden.dtype)], dim=-1)
    tau = torch.tensor(temperatures, dtype=F32).clamp_min(1e-5)
    if tau.dim() == 1 and tau.shape[0] != hidden.shape[0]:
        raise ValueError(f"got {tau.shape[0]} confidence temperatures for {hidden.shape[0]} draft slots")
    score = _bf16_linear(features, w[f"{last}.confidence_head.proj.weight"])[:, 0]
    return logits, torch.sigmoid((score / tau).clamp(-60, 60))
