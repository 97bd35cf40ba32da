"""Plain-PyTorch reference model of DeepSeek-V4.1-Flash (text path): the single golden oracle.

This module owns the numerically faithful, slow, cache-free definition of the whole text forward of
DeepSeek-V4.1-Flash (docs/design/model.md, attention.md, numerics.md): number formats and dynamic activation
quantization (in ``reference_formats``), RMSNorm, RoPE/YaRN, manifold-constrained hyper-connections (mHC), Engram
(its hashing in ``reference_engram``), MoE, every attention layer kind with compressor, indexer, candidate blocks,
cross-layer sharing and YOCO, the final norm and LM head. Read in that order: the building blocks of sections 2–7
are ``reference_blocks``, the attention of section 8 is ``reference_attention``, and this module holds the decoder
blocks and the full forward (section 9) and re-exports the public names of all four siblings; the DSpark draft
block, built from its pieces, is ``reference_dspark``.
It is not fast and keeps no state between calls; every fast path in the project is checked against it.

Inputs are the frozen ``ModelConfig`` and a mapping from HF checkpoint tensor names to tensors in their STORED
formats: FP8 e4m3 (``torch.float8_e4m3fn``) with ``float8_e8m0fnu`` (or ``uint8``) 32×32 block scales, MXFP4 packed
``int8``/``uint8`` bytes with 1×32 UE8M0 scales, BF16 and FP32. Names may carry the ``model.`` prefix or not (both
forms are accepted; giving one tensor under both names is an error). The model math is spelled out here on purpose
instead of importing the kernel package, so that it is an independent oracle.

Glossary:
    trunk: the ``[n, m, H]`` BF16 residual state of mHC (``m`` = ``hc_mult`` streams).
    read-mix / write-mix / comb: the per-token mHC weights ``P`` (read one stream mix), ``Q`` (write the sub-layer
        output back) and ``C`` (doubly-stochastic stream mixing) (docs/design/model.md, "Hyper-connections (mHC)").
    compressed row: one entry of a layer's compressed KV (one per ``c`` raw tokens, ``c`` = compress ratio).
    quant-dequant: quantizing to a storage format and reading it back, which is how a stored cache entry or an FP8
        GEMM operand is seen by the math.

Choices where the spec leaves a point open (each follows what the spec attributes to the reference package):
    1. RMSNorm (and the mHC / Engram-gate normalizations): ``ρ = 1/sqrt(Σx²/d + ε)`` evaluated in FP64 from the
       FP32 sum of squares and rounded once to FP32 ("correctly rounded", docs/design/model.md, "RMSNorm"); the product
       ``x·ρ·w`` runs in FP32 with one BF16 rounding (the kernel, not the package's simple reference).
    2. mHC mix GEMM: ``fn`` rounded to TF32 by round-to-nearest-even; the trunk is BF16 and exact in TF32.
    3. RoPE FMA: ``fma(a, c, ±b·s)`` is evaluated as an exact FP64 ``a·c`` plus the FP32-rounded ``b·s``, rounded to
       FP32 and then to the storage dtype (a double rounding that can differ from a true FP32 FMA in rare ties).
    4. Attention: unnormalized probabilities ``exp(s − max)`` are rounded to BF16 before the value product; the
       denominator (keys plus sink) uses the FP32 probabilities (docs/design/numerics.md, "Rounding points").
       The attention output is de-rotated and FP8-quantized from FP32, and the grouped ``wo_a`` output is
       FP8-quantized from FP32, with no BF16 rounding in between (docs/design/numerics.md, "Attention output rounding").
    5. Top-k (indexer, candidate blocks, router): larger score first, ties to the lower index (stable sort).
    6. Engram gate at exactly ``z = 0``: the kernel's copy-sign, i.e. ``sigmoid(+1e−3)`` for ``+0`` (B5).
    7. MoE combine: FP32 sum of the BF16 shared-expert output and the BF16 routed outputs in top-k rank order,
       one BF16 rounding. The SwiGLU output times the routing weight is FP8-quantized from FP32.
    8. e4m3 conversion: round-to-nearest-even after clamping to ±448 (saturation); e2m1 conversion:
       round-to-nearest-even with saturation at ±6.
    9. Text path only: token ids must lie in ``[0, V)``; image tokens (``bias_vl`` routing, Engram skip) do not
       occur. Engram compressed ids of ids outside the tokenizer table are the sentinel −1
       (docs/design/model.md, "N-gram rows").
    10. Engram vocabulary: passed in as an ``EngramVocabulary`` (built once from ``tokenizer.json`` with
        ``engram_vocabulary_from_tokenizer``), never loaded inside the forward; the pad id is a parameter (the
        runtime reads ``DEEPINFER_ENGRAM_PAD_TOKEN``, default 2).
    11. YOCO prefill truncation is ``off`` (the exact mode) unless ``yoco_keep_tokens`` asks for the ``mask`` rule
        (docs/design/attention.md, "YOCO prefill truncation"); the forward is one full causal prefill of one request,
        so ``rect_lo = n − keep``. (``compact`` computes the same values for the queries it keeps.)
    12. DSpark: the number of draft slots defaults to ``dspark_block_size``; the context keys are
        computed from the target features inside ``reference_dspark_forward``; the confidence head reads the
        pre-norm hidden.
    13. Indexer logits are rounded to BF16 before top-k and candidate-block scoring
        (docs/design/attention.md, "Index scores"); the C2 compressor softmax uses exact ``exp`` (the reference
        kernel's fast-math is not reproduced).
    14. mHC read and post accumulate in FP32 in stream order without FMA; the FP32 mix GEMM sums in one pass.

Precision (the ``precision`` keyword of the four entry points and of the building blocks that round):
    ``"exact"`` (default) is everything above: the release's numerics
    (docs/design/numerics.md, "Number formats", "Rounding points", "KV storage formats").
    ``"fp32"`` is the same model with every rounding of an activation switched off, so that two implementations can
    be compared up to FP32 summation order (in exact mode a one-ulp difference may flip a BF16 or FP8 rounding and
    then grow). It changes exactly four kinds of point, each in one method of ``_Numerics``:
        - every BF16 rounding point (norm outputs, GEMM outputs, mHC read and post, Engram update, MoE combine,
          compressor latent, indexer weights and logits, attention probabilities, DSpark target features): the
          value stays FP32, so every tensor documented as BF16 is FP32 instead;
        - the dynamic 1×32 FP8 activation quantization in front of every FP8 GEMM: the GEMM reads the FP32 value;
        - the TF32 rounding of the mHC ``fn`` operand: the GEMM is FP32;
        - the KV storage formats (SWA and DSpark context keys FP8, compressed rows FP4/FP8, index keys FP4, and the
          index query, which uses the index-key recipe): the vectors are kept in FP32.
    It keeps: every weight dequantized from its stored format exactly as in exact mode (FP8 32×32 blocks, MXFP4,
    BF16 and FP32 values read as FP32), the Engram table rows dequantized from FP8; FP32 accumulation everywhere
    (torch's default ``"highest"`` FP32 matmul precision is assumed); ``ρ`` of RMSNorm correctly rounded to FP32
    (choice 1) and the RoPE FMA evaluation (choice 3); the cap of candidate-block scores at the largest finite BF16;
    and every discrete decision (indexer top-k, candidate blocks, expert routing) with the same rule, computed on
    the FP32 values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from deepinfer_model.config import ModelConfig, TextConfig
from deepinfer_model.reference_attention import (
    _attention_layer,
    _AttentionState,
    attention_core,
    attention_over_key_sets,
    candidate_block_mask,
    compress_kv,
    index_scores,
    select_topk,
    sparse_source_map,
    swa_visibility,
)
from deepinfer_model.reference_blocks import (
    WeightSource,
    _bf16_linear,
    _engram_layer,
    _layer_rope_table,
    _moe,
    _weight_source,
    apply_rope,
    hc_head,
    hc_mix_logits,
    hc_post,
    hc_read,
    hc_split_mixes,
    moe_route,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    router_scores,
    sinkhorn,
    yarn_inv_freq,
)
from deepinfer_model.reference_engram import (
    EngramVocabulary,
    engram_gate,
    engram_hash,
    engram_hash_multipliers,
    engram_ngram_rows,
    engram_normalize,
    engram_table_primes,
    engram_vocabulary_from_tokenizer,
)
from deepinfer_model.reference_formats import (
    F32,
    Precision,
    _Numerics,
    _numerics,
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp4_e4m3_quant_dequant,
    fp4_ue8m0_quant_dequant,
    fp8_quant_dequant,
    round_to_e2m1,
    round_to_e4m3,
    round_to_tf32,
    ue8m0_to_float,
)

__all__ = [
    "EngramVocabulary",
    "Precision",
    "ReferenceOutput",
    "WeightSource",
    "apply_rope",
    "attention_core",
    "attention_over_key_sets",
    "candidate_block_mask",
    "compress_kv",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "engram_gate",
    "engram_hash",
    "engram_hash_multipliers",
    "engram_ngram_rows",
    "engram_normalize",
    "engram_table_primes",
    "engram_vocabulary_from_tokenizer",
    "fp4_e4m3_quant_dequant",
    "fp4_ue8m0_quant_dequant",
    "fp8_quant_dequant",
    "hc_head",
    "hc_mix_logits",
    "hc_post",
    "hc_read",
    "hc_split_mixes",
    "index_scores",
    "moe_route",
    "reference_forward",
    "reference_forward_full",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "round_to_e2m1",
    "round_to_e4m3",
    "round_to_tf32",
    "router_scores",
    "select_topk",
    "sinkhorn",
    "sparse_source_map",
    "swa_visibility",
    "ue8m0_to_float",
    "yarn_inv_freq",
]

# ==================================================================================================================
# 9. Decoder blocks and the full forward (docs/design/model.md, "Forward pass")
# ==================================================================================================================

_Pending = tuple[Tensor, Tensor, Tensor, Tensor]  # (sub-layer output, trunk it received, write-mix, comb)


def _mixes(
    text: TextConfig, w: WeightSource, num: _Numerics, name: str, trunk: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(P, Q, C)`` of the mHC parameters ``{name}_fn/_base/_scale`` on ``trunk``."""
    mix = hc_mix_logits(trunk, w[f"{name}_fn"], text.rms_norm_eps, precision=num.precision)
    return hc_split_mixes(mix, w[f"{name}_base"], w[f"{name}_scale"], text.hc_mult, text.hc_eps, text.hc_sinkhorn_iters)


def _decoder_layer(
    text: TextConfig,
    w: WeightSource,
    num: _Numerics,
    prefix: str,
    trunk: Tensor,
    read_mix: Tensor,
    attention: Callable[[Tensor], Tensor],
    num_experts: int,
    top_k: int,
) -> tuple[_Pending, Tensor]:
    """Attention and MoE sub-layers of one block on the trunk it receives (docs/design/model.md, "Forward pass").

    Args:
        trunk: ``[n, m, H]`` BF16, after the previous block's FFN post and this block's Engram.
        read_mix: ``[n, m]`` FP32 read-mix of the previous sub-layer (shifted schedule; unused otherwise).
        attention: the attention sub-layer, ``[n, H]`` BF16 → ``[n, H]`` BF16.

    Returns:
        the pending FFN post (applied at the start of the next block) and the FFN read-mix ``P_f``.
    """
    eps, p = text.rms_norm_eps, num.precision
    pre_a, post_a, comb_a = _mixes(text, w, num, f"{prefix}.hc_attn", trunk)
    read_a = hc_read(trunk, read_mix if text.hc_shifted else pre_a, precision=p)
    x_attn = rms_norm(read_a, w[f"{prefix}.attn_norm.weight"], eps, precision=p)
    trunk_ffn = hc_post(attention(x_attn), trunk, post_a, comb_a, precision=p)
    pre_f, post_f, comb_f = _mixes(text, w, num, f"{prefix}.hc_ffn", trunk_ffn)
    read_f = hc_read(trunk_ffn, pre_a if text.hc_shifted else pre_f, precision=p)
    x_ffn = rms_norm(read_f, w[f"{prefix}.ffn_norm.weight"], eps, precision=p)
    y_ffn = _moe(text, w, num, f"{prefix}.ffn", x_ffn, num_experts, top_k)
    return (y_ffn, trunk_ffn, post_f, comb_f), pre_f


def _collapse(
    text: TextConfig, w: WeightSource, num: _Numerics, head_prefix: str, pending: _Pending, read_mix: Tensor
) -> Tensor:
    """Last post, then the final read-mix (shifted) or the HC head (non-shifted): ``[n, H]`` BF16."""
    trunk = hc_post(*pending, precision=num.precision)
    if text.hc_shifted:
        return hc_read(trunk, read_mix, precision=num.precision)
    return hc_head(
        trunk,
        w[f"{head_prefix}hc_head_fn"],
        w[f"{head_prefix}hc_head_scale"],
        w[f"{head_prefix}hc_head_base"],
        text.rms_norm_eps,
        text.hc_eps,
        precision=num.precision,
    )


def _expand(w: WeightSource, num: _Numerics, token_ids: Tensor, text: TextConfig) -> tuple[Tensor, Tensor]:
    """Embedding copied into the ``m`` streams (BF16 ``[N, m, H]``) and the one-hot stream-0 read-mix ``[N, m]``.

    ``token_ids`` is ``[n]`` or ``[B, n]`` (a batch of sequences); the trunk holds every token, ``N = B·n``
    (sequence-major): the per-token parts of the model run on all of them at once.
    """
    if token_ids.dtype != torch.int64 or token_ids.dim() not in (1, 2):
        raise TypeError(
            f"token ids must be a 1-D or 2-D int64 tensor, got {token_ids.dtype} with shape {tuple(token_ids.shape)}"
        )
    if token_ids.numel() == 0:
        raise ValueError("token ids must not be empty")
    token_ids = token_ids.flatten()
    bad = (token_ids < 0) | (token_ids >= text.vocab_size)
    if bool(bad.any()):
        raise ValueError(f"token id {int(token_ids[bad][0])} is outside the text vocabulary [0, {text.vocab_size})")
    embedding = num.bf16(w["embed.weight"][token_ids])  # exact either way: the table is BF16
    trunk = embedding[:, None, :].expand(-1, text.hc_mult, -1).contiguous()
    read_mix = torch.zeros(token_ids.shape[0], text.hc_mult, dtype=F32)
    read_mix[:, 0] = 1.0
    return trunk, read_mix


@dataclass(frozen=True)
class ReferenceOutput:
    """Everything ``reference_forward_full`` computes that tests and the drafter need.

    Shapes are those of one sequence; a batched forward (``[B, n]`` token ids) puts a leading ``B`` on every tensor
    (``sequence(b)`` is the output of sequence ``b``).

    Attributes (BF16 tensors are FP32 in fp32 precision; stored keys are then the unquantized FP32 values):
        logits: ``[n, V]`` FP32.
        hidden: ``[n, H]`` BF16 collapsed hidden before the final norm.
        target_features: ``[n, T·H]`` BF16 DSpark target features (docs/design/model.md, "Target features"),
            ``T`` = number of targets.
        selected_rows: compressed layer → ``[n, K]`` int64 compressed rows (numbered in the KV source's rows)
            attended by each query, ascending, −1 padded. The SWA part of every query ``t`` is ``max(0, t−W+1) … t``.
        swa_keys: layer → ``[n, D]`` FP32 SWA keys as read back from FP8 storage (RoPE at the token position).
        compressed_keys: KV-source layer → ``[n // c, D]`` FP32 compressed rows as read back from storage.
        index_keys: index-K-source layer → ``[n // c, d_i]`` FP32 index keys as read back from FP4 storage.
        candidate_rows: ``[n, R]`` bool rows inside each query's candidate blocks (candidate source layer), or
            None when the configuration has no candidate source.
    """

    logits: Tensor
    hidden: Tensor
    target_features: Tensor
    selected_rows: Mapping[int, Tensor]
    swa_keys: Mapping[int, Tensor]
    compressed_keys: Mapping[int, Tensor]
    index_keys: Mapping[int, Tensor]
    candidate_rows: Tensor | None

    def sequence(self, index: int) -> ReferenceOutput:
        """The output of sequence ``index`` of a batched forward (every tensor without its leading batch dim)."""

        def pick(by_layer: Mapping[int, Tensor]) -> dict[int, Tensor]:
            return {layer: tensor[index] for layer, tensor in by_layer.items()}

        return ReferenceOutput(
            self.logits[index],
            self.hidden[index],
            self.target_features[index],
            pick(self.selected_rows),
            pick(self.swa_keys),
            pick(self.compressed_keys),
            pick(self.index_keys),
            None if self.candidate_rows is None else self.candidate_rows[index],
        )


def reference_forward_full(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    token_ids: Tensor,
    engram_vocabulary: EngramVocabulary | None = None,
    *,
    precision: Precision = "exact",
    yoco_keep_tokens: int | None = None,
) -> ReferenceOutput:
    """One full-sequence causal forward of one request, positions ``0 … n−1`` (docs/design/model.md, "Forward pass"),
    or of a batch of equal-length requests at once.

    A batch runs every per-token part (linears, norms, mHC, MoE, Engram lookups) over all ``B·n`` tokens at once and
    every per-sequence part (attention windows, compressor, indexer top-k, candidate blocks, Engram n-grams, YOCO)
    along the batch dim, so each sequence gets what its own forward gives (up to FP32 summation order: the GEMM
    shapes differ); a trainer batches sequences this way.

    Args:
        config: the model configuration.
        weights: HF-named checkpoint tensors in stored formats (``model.`` prefix optional), or a ``WeightSource``.
        token_ids: ``[n]`` int64 ids in ``[0, V)``, or ``[B, n]`` for ``B`` sequences.
        engram_vocabulary: compressed Engram vocabulary; required when the model has Engram layers.
        precision: ``"exact"`` (the spec's numerics) or ``"fp32"`` (see "Precision" in the module docstring).
        yoco_keep_tokens: ``KEEP`` of ``mask`` YOCO prefill truncation (choice 11): YOCO consumer layers see window
            keys at positions ``≥ n − KEEP`` only; None is ``off``.

    Returns:
        logits, collapsed hidden, DSpark target features, the compressed rows each query attended and the keys a
        cache would hold (each with a leading ``B`` for ``[B, n]`` token ids).
    """
    text = config.text
    num = _numerics(precision)
    w = _weight_source(weights)
    if text.engram_layer_ids and engram_vocabulary is None:
        raise ValueError(f"Engram layers {list(text.engram_layer_ids)} need an engram_vocabulary")
    batched = token_ids.dim() == 2
    ids = token_ids if batched else token_ids[None]  # one sequence is a batch of one
    trunk, read_mix = _expand(w, num, ids, text)
    batch, n = ids.shape
    tables = {False: _layer_rope_table(text, False, n), True: _layer_rope_table(text, True, n)}
    floor = None if yoco_keep_tokens is None else n - yoco_keep_tokens
    state = _AttentionState()
    features: dict[int, Tensor] = {}
    pending: _Pending | None = None
    for layer in range(text.num_hidden_layers):
        if pending is not None:
            trunk = hc_post(*pending, precision=precision)
        if layer in text.engram_layer_ids:
            assert engram_vocabulary is not None
            trunk = _engram_layer(text, w, num, layer, trunk, ids, engram_vocabulary)
        if layer in text.dspark_target_layer_ids:
            features[layer] = num.bf16(trunk.float().mean(1))

        def attention(x: Tensor, layer: int = layer) -> Tensor:
            consumer_floor = floor if layer >= text.n_prefill_layer else None
            rope = tables[text.compress_ratios[layer] > 0]
            sequences = x.unflatten(0, (batch, n))
            return _attention_layer(text, w, num, layer, sequences, state, rope, consumer_floor).flatten(0, 1)

        pending, read_mix = _decoder_layer(
            text, w, num, f"layers.{layer}", trunk, read_mix, attention, text.n_routed_experts, text.num_experts_per_tok
        )
    assert pending is not None
    hidden = _collapse(text, w, num, "", pending, read_mix)
    logits = _bf16_linear(rms_norm(hidden, w["norm.weight"], text.rms_norm_eps, precision=precision), w["head.weight"])
    target_features = torch.cat([features[t] for t in text.dspark_target_layer_ids], dim=-1)
    output = ReferenceOutput(
        logits.unflatten(0, (batch, n)),
        hidden.unflatten(0, (batch, n)),
        target_features.unflatten(0, (batch, n)),
        state.selected_rows,
        state.swa_keys,
        state.compressed_keys,
        state.index_keys,
        state.candidates,
    )
    return output if batched else output.sequence(0)


def reference_forward(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    token_ids: Tensor,
    engram_vocabulary: EngramVocabulary | None = None,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """Logits ``[n, V]`` (``[B, n, V]`` for a batch) FP32 of one full causal forward; see ``reference_forward_full``
    for the arguments."""
    return reference_forward_full(config, weights, token_ids, engram_vocabulary, precision=precision).logits
