"""Plain-PyTorch reference model of DeepSeek-V4.1-Flash (text path): the single golden oracle.

This module owns the numerically faithful, slow, cache-free definition of the whole text forward of
DeepSeek-V4.1-Flash (docs/design/model.md, attention.md, numerics.md): number formats and dynamic activation
quantization (in ``reference_formats``), RMSNorm, RoPE/YaRN, manifold-constrained hyper-connections (mHC), Engram
(its hashing in ``reference_engram``), MoE, every attention layer kind with compressor, indexer, candidate blocks,
cross-layer sharing and YOCO, the final norm and LM head. It reads top to bottom in that order and re-exports the
public names of both siblings; the DSpark draft block, built from its pieces, is ``reference_dspark``.
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

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from deepinfer_model.config import ModelConfig, TextConfig
from deepinfer_model.reference_engram import (
    EngramVocabulary,
    _engram_sizes,
    engram_gate,
    engram_hash,
    engram_hash_multipliers,
    engram_ngram_rows,
    engram_normalize,
    engram_table_primes,
    engram_vocabulary_from_tokenizer,
)
from deepinfer_model.reference_formats import (
    BF16,
    F32,
    Precision,
    _dequantize_fp8_rows,
    _inverse_rms,
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
# 2. Stored weights and linear layers (docs/design/numerics.md, "Weight formats", "GEMM accumulation")
# ==================================================================================================================


@runtime_checkable
class WeightSource(Protocol):
    """Where the forward reads its weights, by HF name without the ``model.`` prefix, every value as FP32 math sees it.

    The entry points take either a mapping of stored tensors (wrapped in the stored-format source ``_Weights``) or any
    object with these four methods, e.g. FP32 master parameters of a trainer (``requires_grad`` tensors keep their
    graph: every method must return differentiable views of them).
    """

    def __getitem__(self, name: str) -> Tensor:
        """A BF16 or FP32 tensor (norm weights, embeddings, mHC parameters, ...), any float dtype."""
        ...

    def fp8(self, prefix: str) -> Tensor:
        """``[out, in]`` FP32 value of the FP8 block-scaled weight ``{prefix}.weight``."""
        ...

    def mxfp4(self, prefix: str) -> Tensor:
        """``[out, in]`` FP32 value of the MXFP4 expert weight ``{prefix}.weight``."""
        ...

    def fp8_rows(self, prefix: str, rows: Tensor) -> Tensor:
        """``[*rows.shape, d]`` FP32 values of the rows ``rows`` of the FP8 row-scaled table ``{prefix}.weight``."""
        ...


class _Weights:
    """HF-named stored tensors; names are looked up without the optional ``model.`` prefix."""

    def __init__(self, weights: Mapping[str, Tensor]) -> None:
        names: dict[str, str] = {}
        for name in weights:
            key = name.removeprefix("model.")
            if key in names:
                raise ValueError(f"tensor {key!r} is given both with and without the 'model.' prefix")
            names[key] = name
        self._weights = weights
        self._names = names

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(f"checkpoint tensor {name!r} (or 'model.{name}') is missing from the weights")
        return self._weights[self._names[name]]

    def fp8(self, prefix: str) -> Tensor:
        """Dequantized FP32 ``[out, in]`` of the FP8 weight ``{prefix}.weight`` with ``{prefix}.scale``."""
        return dequantize_fp8_block(self[f"{prefix}.weight"], self[f"{prefix}.scale"])

    def mxfp4(self, prefix: str) -> Tensor:
        """Dequantized FP32 ``[out, in]`` of the MXFP4 weight ``{prefix}.weight`` with ``{prefix}.scale``."""
        return dequantize_mxfp4(self[f"{prefix}.weight"], self[f"{prefix}.scale"])

    def fp8_rows(self, prefix: str, rows: Tensor) -> Tensor:
        """Dequantized FP32 rows ``rows`` of the FP8 table ``{prefix}.weight`` with 1×32 scales ``{prefix}.scale``."""
        return _dequantize_fp8_rows(self[f"{prefix}.weight"][rows], self[f"{prefix}.scale"][rows])


def _weight_source(weights: Mapping[str, Tensor] | WeightSource) -> WeightSource:
    return weights if isinstance(weights, WeightSource) else _Weights(weights)


def _fp8_linear(num: _Numerics, x: Tensor, weight: Tensor) -> Tensor:
    """``bf16(Q8(x) · Ŵᵀ)``: per-32 dynamic FP8 activation × dequantized weight, FP32 accumulation
    (docs/design/numerics.md, "GEMM accumulation")."""
    return num.bf16(num.act_quant(x) @ weight.T)


def _bf16_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x · Wᵀ`` for BF16 operands with FP32 accumulation and FP32 output."""
    return x.float() @ weight.float().T


# ==================================================================================================================
# 3. RMSNorm (docs/design/model.md, "RMSNorm")
# ==================================================================================================================


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, precision: Precision = "exact") -> Tensor:
    """RMSNorm over the last dimension, output BF16 (docs/design/model.md, "RMSNorm").

    ``ρ = 1/sqrt(Σx²/d + ε)`` with an FP32 sum of squares and ``ρ`` correctly rounded to FP32; ``y = x·ρ·w`` in
    FP32, rounded once to BF16.

    Args:
        x: ``[..., d]`` BF16 (or FP32).
        weight: ``[d]`` BF16.
        eps: ``rms_norm_eps``.
        precision: ``"fp32"`` skips the BF16 rounding of ``y``.

    Returns:
        ``[..., d]`` BF16 (FP32 in fp32 precision).
    """
    xf = x.float()
    rho = _inverse_rms((xf * xf).sum(-1, keepdim=True), xf.shape[-1], eps)
    return _numerics(precision).bf16(xf * rho * weight.float())


# ==================================================================================================================
# 4. RoPE and YaRN (docs/design/model.md, "RoPE and YaRN")
# ==================================================================================================================


def rope_inv_freq(rope_dim: int, base: float) -> Tensor:
    """Base inverse frequencies ``f_i = 1 / base^(2i/r)`` in FP32, ``[r/2]``."""
    exponent = torch.arange(0, rope_dim, 2, dtype=F32) / rope_dim
    return 1.0 / torch.pow(torch.tensor(base, dtype=F32), exponent)


def yarn_inv_freq(
    rope_dim: int, base: float, factor: float, original_max_position: int, beta_fast: float, beta_slow: float
) -> Tensor:
    """YaRN inverse frequencies (blend of ``f`` and ``f/φ`` by a linear ramp), FP32 ``[r/2]``."""

    def correction(num_rotations: float) -> float:
        return rope_dim * math.log(original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    lo: float = max(math.floor(correction(beta_fast)), 0)
    hi: float = min(math.ceil(correction(beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    b = torch.pow(torch.tensor(base, dtype=F32), torch.arange(0, rope_dim, 2, dtype=F32) / rope_dim)
    ramp = ((torch.arange(rope_dim // 2, dtype=F32) - lo) / (hi - lo)).clamp(0, 1)
    mask = 1 - ramp
    return (1 / (factor * b)) * (1 - mask) + (1 / b) * mask


def rope_cos_sin(inv_freq: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
    """Cos/sin tables for positions ``0 … P−1``: angle ``fp32(t·f_i)``, via the complex polar form
    (docs/design/model.md, "RoPE and YaRN").

    Returns:
        ``cos``, ``sin``: both ``[P, r/2]`` FP32.
    """
    angles = torch.outer(torch.arange(num_positions, dtype=F32), inv_freq)
    rotation = torch.polar(torch.ones_like(angles), angles)
    return rotation.real.contiguous(), rotation.imag.contiguous()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last ``r`` elements of ``x`` in interleaved pairs ``(2i, 2i+1)``
    (docs/design/model.md, "RoPE and YaRN").

    ``x'[2i] = fma(x[2i], c, −x[2i+1]·s)``, ``x'[2i+1] = fma(x[2i], s, x[2i+1]·c)``; ``inverse`` uses ``−s``.

    Args:
        x: ``[..., d]`` BF16 or FP32, ``d ≥ r``.
        cos: ``[..., r/2]`` FP32, broadcastable against ``x[..., :r/2]`` (the rows of each vector's position).
        sin: like ``cos``.
        inverse: conjugate rotation (the attention-output de-rotation).

    Returns:
        ``[..., d]`` in the dtype of ``x``.
    """
    half = cos.shape[-1]
    pairs = x[..., -2 * half :].double().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos.double(), (-sin if inverse else sin).double()
    first = (a * c - (b * s).float().double()).float()
    second = (a * s + (b * c).float().double()).float()
    rotated = torch.stack([first, second], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : -2 * half], rotated], dim=-1)


@dataclass(frozen=True)
class _RopeTable:
    """A layer kind's cos/sin rows for positions ``0 … P−1``: both ``[P, r/2]`` FP32."""

    cos: Tensor
    sin: Tensor


def _layer_rope_table(text: TextConfig, compressed: bool, num_positions: int) -> _RopeTable:
    """The cos/sin table of a layer kind (docs/design/model.md, "RoPE and YaRN"): compressed layers use compress theta
    and YaRN."""
    r = text.qk_rope_head_dim
    scaling = text.rope_scaling
    if not compressed:
        inv_freq = rope_inv_freq(r, text.rope_theta)
    elif scaling is None:
        inv_freq = rope_inv_freq(r, text.compress_rope_theta)
    else:
        inv_freq = yarn_inv_freq(
            r,
            text.compress_rope_theta,
            scaling.factor,
            scaling.original_max_position_embeddings,
            scaling.beta_fast,
            scaling.beta_slow,
        )
    return _RopeTable(*rope_cos_sin(inv_freq, num_positions))


# ==================================================================================================================
# 5. Manifold-constrained hyper-connections (docs/design/model.md, "Hyper-connections (mHC)")
# ==================================================================================================================


def hc_mix_logits(trunk: Tensor, fn: Tensor, eps: float, *, precision: Precision = "exact") -> Tensor:
    """Token-dependent mix logits ``μ = γ · fn·z`` (docs/design/model.md, "Mix logits").

    Args:
        trunk: ``[n, m, H]`` BF16 (FP32 in fp32 precision).
        fn: ``[rows, m·H]`` FP32 (norm weight folded in); multiplied in TF32 (in FP32 in fp32 precision).
        eps: ``rms_norm_eps``.
        precision: ``"fp32"`` skips the TF32 rounding of ``fn``.

    Returns:
        ``[n, rows]`` FP32.
    """
    z = trunk.float().flatten(1)
    gamma = _inverse_rms((z * z).sum(-1, keepdim=True), z.shape[-1], eps)
    return (z @ _numerics(precision).tf32(fn).T) * gamma


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Sinkhorn normalization of comb logits (docs/design/model.md, "Sinkhorn normalization"): row softmax + ε, then
    column/row passes.

    Args:
        logits: ``[..., m, m]`` FP32, entry ``[i, j]`` = source stream ``i`` → destination ``j``.
        iters: ``hc_sinkhorn_iters`` (≥ 1; the softmax and first column pass count as one).
        eps: ``hc_eps``.

    Returns:
        ``[..., m, m]`` FP32, approximately doubly stochastic.
    """
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_split_mixes(
    mix: Tensor, base: Tensor, scale: Tensor, hc_mult: int, hc_eps: float, sinkhorn_iters: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Read-mix ``P``, write-mix ``Q`` and comb ``C`` from mix logits
    (docs/design/model.md, "Read, write and comb mixes").

    Args:
        mix: ``[n, (2+m)·m]`` FP32 from ``hc_mix_logits``.
        base: ``[(2+m)·m]`` FP32.
        scale: ``[3]`` FP32.
        hc_mult: ``m``.
        hc_eps: ``ε_hc``.
        sinkhorn_iters: ``T_sk``.

    Returns:
        ``P [n, m]``, ``Q [n, m]``, ``C [n, m, m]`` FP32.
    """
    m = hc_mult
    pre = torch.sigmoid(mix[:, :m] * scale[0] + base[:m]) + hc_eps
    post = torch.sigmoid(mix[:, m : 2 * m] * scale[1] + base[m : 2 * m]) * 2.0
    comb = (mix[:, 2 * m :] * scale[2] + base[2 * m :]).unflatten(-1, (m, m))
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def hc_read(trunk: Tensor, pre: Tensor, *, precision: Precision = "exact") -> Tensor:
    """``bf16(Σ_j P_j·X_j)`` accumulated in FP32 in stream order (docs/design/model.md, "Read and post").

    Args:
        trunk: ``[n, m, H]`` BF16 (FP32 in fp32 precision).
        pre: ``[n, m]`` FP32 read-mix.
        precision: ``"fp32"`` skips the BF16 rounding.

    Returns:
        ``[n, H]`` BF16 (FP32 in fp32 precision).
    """
    x = trunk.float()
    acc = pre[:, 0:1] * x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + pre[:, j : j + 1] * x[:, j]
    return _numerics(precision).bf16(acc)


def hc_post(output: Tensor, trunk: Tensor, post: Tensor, comb: Tensor, *, precision: Precision = "exact") -> Tensor:
    """``X'_o = bf16(Q_o·y + Σ_i C_io·X_i)`` in FP32, products added in stream order
    (docs/design/model.md, "Read and post").

    Args:
        output: ``[n, H]`` BF16 sub-layer output ``y`` (FP32 in fp32 precision, as are the trunks).
        trunk: ``[n, m, H]`` BF16 trunk the sub-layer received.
        post: ``[n, m]`` FP32 write-mix ``Q``.
        comb: ``[n, m, m]`` FP32 comb ``C``.
        precision: ``"fp32"`` skips the BF16 rounding.

    Returns:
        ``[n, m, H]`` BF16 new trunk (FP32 in fp32 precision).
    """
    x = trunk.float()
    y = output.float()
    streams = []
    for o in range(x.shape[1]):
        acc = post[:, o : o + 1] * y
        for i in range(x.shape[1]):
            acc = acc + comb[:, i, o : o + 1] * x[:, i]
        streams.append(acc)
    return _numerics(precision).bf16(torch.stack(streams, dim=1))


def hc_head(
    trunk: Tensor,
    fn: Tensor,
    scale: Tensor,
    base: Tensor,
    eps: float,
    hc_eps: float,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """Non-shifted HC head: collapse the trunk with its own read-mix (docs/design/model.md, "Shifted schedule").

    Args:
        trunk: ``[n, m, H]`` BF16 (FP32 in fp32 precision).
        fn: ``[m, m·H]`` FP32 (norm weight folded in).
        scale: ``[1]`` FP32.
        base: ``[m]`` FP32.
        eps: ``rms_norm_eps``.
        hc_eps: ``ε_hc``.
        precision: ``"fp32"`` skips the TF32 and BF16 roundings.

    Returns:
        ``[n, H]`` BF16 (FP32 in fp32 precision).
    """
    pre = torch.sigmoid(hc_mix_logits(trunk, fn, eps, precision=precision) * scale[0] + base) + hc_eps
    return hc_read(trunk, pre, precision=precision)


# ==================================================================================================================
# 6. Engram (docs/design/model.md, "Engram")
# ==================================================================================================================


def _engram_layer(
    text: TextConfig,
    w: WeightSource,
    num: _Numerics,
    layer: int,
    trunk: Tensor,
    token_ids: Tensor,
    vocabulary: EngramVocabulary,
) -> Tensor:
    """Apply layer ``layer``'s Engram to the trunk (docs/design/model.md, "Engram")."""
    max_ngram, heads, _ = _engram_sizes(text)
    index = text.engram_layer_ids.index(layer)
    primes = engram_table_primes(text)[index]
    multipliers = engram_hash_multipliers(layer, max_ngram, vocabulary.num_compressed)
    table_size = vocabulary.old_to_new.shape[0]
    in_table = (token_ids >= 0) & (token_ids < table_size)
    compressed = torch.where(in_table, vocabulary.old_to_new[token_ids.clamp(0, table_size - 1)], -1)
    idx = engram_hash(engram_ngram_rows(compressed, max_ngram, vocabulary.pad_id), multipliers, primes, heads)
    prefix = f"layers.{layer}.engram"
    num_rows = w[f"{prefix}.embed.weight"].shape[0]
    if num_rows < sum(primes):
        raise ValueError(f"{prefix}.embed.weight has {num_rows} rows, the hash needs {sum(primes)}")
    gathered = w.fp8_rows(f"{prefix}.embed", idx).flatten(1)  # [n, (N_g-1)·h_e·d_e]
    # The gathered rows are FP8 in storage already, so this FP8 GEMM has no activation quantization.
    kv = num.bf16(gathered @ w.fp8(f"{prefix}.wkv").T).unflatten(-1, (text.hc_mult + 1, text.hidden_size))
    q_weight, k_weight = w[f"{prefix}.q_weight"], w[f"{prefix}.k_weight"]
    return engram_gate(trunk, kv, q_weight, k_weight, text.rms_norm_eps, precision=num.precision)


# ==================================================================================================================
# 7. Mixture of experts (docs/design/model.md, "Mixture of experts")
# ==================================================================================================================


def router_scores(logits: Tensor) -> Tensor:
    """``sqrt(softplus(l))``, ``softplus(x) = x`` for ``x > 20`` (docs/design/model.md, "Router"); FP32 in and out."""
    softplus = torch.where(logits > 20, logits, torch.log1p(torch.exp(logits)))
    return torch.sqrt(softplus)


def moe_route(scores: Tensor, bias: Tensor, top_k: int, scaling: float) -> tuple[Tensor, Tensor]:
    """``noaux_tc`` selection on ``scores + bias``; weights from the unbiased scores (docs/design/model.md, "Router").

    Args:
        scores: ``[n, E]`` FP32 router scores.
        bias: ``[E]`` FP32 correction bias.
        top_k: experts per token.
        scaling: ``routed_scaling_factor``.

    Returns:
        expert ids ``[n, k]`` int64 (descending selection score, ties to the lower id) and weights ``[n, k]`` FP32.
    """
    experts = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :top_k]
    selected = scores.gather(1, experts)
    return experts, selected / (selected.sum(-1, keepdim=True) + 1e-20) * scaling


def _swiglu(gate_up: Tensor, limit: float | None) -> Tensor:
    """``silu(min(g, λ))·clamp(u, −λ, λ)`` in FP32 from the BF16 ``[.., 2I]`` GEMM output
    (docs/design/model.md, "Routed experts")."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half].float(), gate_up[..., half:].float()
    if limit is not None:
        gate = gate.clamp_max(limit)
        up = up.clamp(-limit, limit)
    return gate / (1 + torch.exp(-gate)) * up


def _moe(
    text: TextConfig, w: WeightSource, num: _Numerics, prefix: str, x: Tensor, num_experts: int, top_k: int
) -> Tensor:
    """MoE of one block on the BF16 ``ffn_norm`` output ``x [n, H]``; returns BF16 ``[n, H]``
    (docs/design/model.md, "Mixture of experts")."""
    n, hidden = x.shape
    gate_weight = w[f"{prefix}.gate.weight"]
    if gate_weight.shape[0] != num_experts:
        raise ValueError(f"{prefix}.gate.weight has {gate_weight.shape[0]} rows, expected {num_experts} experts")
    experts, weights = moe_route(
        router_scores(_bf16_linear(x, gate_weight)), w[f"{prefix}.gate.bias"], top_k, text.routed_scaling_factor
    )
    total = torch.zeros(n, hidden, dtype=F32)
    if text.n_shared_experts > 0:
        s = f"{prefix}.shared_experts"
        gate_up = torch.cat([_fp8_linear(num, x, w.fp8(f"{s}.w1")), _fp8_linear(num, x, w.fp8(f"{s}.w3"))], dim=-1)
        total = total + _fp8_linear(num, _swiglu(gate_up, text.swiglu_limit), w.fp8(f"{s}.w2")).float()
    routed = torch.zeros(n, top_k, hidden, dtype=F32)
    for expert in torch.unique(experts).tolist():
        tokens, rank = torch.nonzero(experts == expert, as_tuple=True)
        e = f"{prefix}.experts.{expert}"
        w13 = torch.cat([w.mxfp4(f"{e}.w1"), w.mxfp4(f"{e}.w3")], dim=0)
        gate_up = _fp8_linear(num, x[tokens], w13)
        activation = _swiglu(gate_up, text.swiglu_limit) * weights[tokens, rank][:, None]
        routed[tokens, rank] = _fp8_linear(num, activation, w.mxfp4(f"{e}.w2")).float()
    for slot in range(top_k):
        total = total + routed[:, slot]
    return num.bf16(total)


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
        hidden: ``[n, H]`` BF16 compressor input (FP32 in fp32 precision).
        wkv: ``[D, H]`` BF16 ``compressor.wkv``.
        wgate: ``[D, H]`` BF16 ``compressor.wgate`` for ratio ≥ 2, None for ratio 1.
        norm: ``[D]`` BF16 ``compressor.norm``.
        ratio: compress ratio ``c``.
        eps: ``rms_norm_eps``.
        precision: ``"fp32"`` skips the BF16 roundings of the latent and of the norm output.

    Returns:
        ``[n // c, D]`` BF16 (FP32 in fp32 precision).
    """
    if (ratio == 1) != (wgate is None):
        raise ValueError(f"compress ratio {ratio} needs {'no' if ratio == 1 else 'a'} compressor gate weight")
    num = _numerics(precision)
    rows = hidden.shape[0] // ratio
    if wgate is None:
        latent = num.bf16(_bf16_linear(hidden[:rows], wkv))
    else:
        blocks = hidden[: rows * ratio]
        score = _bf16_linear(blocks, wgate).unflatten(0, (rows, ratio))
        value = _bf16_linear(blocks, wkv).unflatten(0, (rows, ratio))
        latent = num.bf16((torch.softmax(score, dim=1) * value).sum(1))
    return rms_norm(latent, norm, eps, precision=precision)


def _rope_rows(rows: Tensor, cos: Tensor, sin: Tensor, ratio: int) -> Tensor:
    """RoPE of compressed row ``b`` at position ``b·c`` (the block's first raw position)."""
    positions = torch.arange(rows.shape[0]) * ratio
    return apply_rope(rows, cos[positions], sin[positions])


def index_scores(query: Tensor, head_weights: Tensor, keys: Tensor, *, precision: Precision = "exact") -> Tensor:
    """Indexer logits ``I(t, b) = Σ_h w[t,h]·max(0, q̂[t,h]·û_b)`` in FP32, stored BF16
    (docs/design/attention.md, "Index scores").

    Args:
        query: ``[n, n_i, d_i]`` FP32 dequantized FP4 index queries.
        head_weights: ``[n, n_i]`` BF16 ``weights_proj`` output.
        keys: ``[R, d_i]`` FP32 dequantized FP4 index keys.
        precision: ``"fp32"`` skips the BF16 rounding of the logits.

    Returns:
        ``[n, R]`` BF16 (FP32 in fp32 precision).
    """
    dots = torch.einsum("thd,bd->thb", query, keys).clamp_min(0)
    return _numerics(precision).bf16((dots * head_weights.float()[..., None]).sum(1))


def select_topk(scores: Tensor, eligible: Tensor, k: int) -> Tensor:
    """Top-``k`` eligible rows per query, larger score first and ties to the lower row
    (docs/design/attention.md, "Top-k selection").

    Args:
        scores: ``[n, R]`` BF16 or FP32.
        eligible: ``[n, R]`` bool.
        k: rows to keep.

    Returns:
        ``[n, k]`` int64 row ids in ascending order, padded with −1 when fewer than ``k`` rows are eligible.
    """
    n, num_rows = scores.shape
    keyed = scores.float().masked_fill(~eligible, -math.inf)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.where(eligible.gather(1, order), order, num_rows)
    chosen = torch.sort(chosen, dim=-1).values
    out = torch.full((n, k), -1, dtype=torch.int64)
    out[:, : chosen.shape[1]] = torch.where(chosen < num_rows, chosen, -1)
    return out


def candidate_block_mask(scores: Tensor, valid: Tensor, block_size: int, num_blocks: int) -> Tensor:
    """Rows inside the candidate blocks of each query (docs/design/attention.md, "Candidate blocks").

    Blocks of ``block_size`` rows score the max of their valid logits (capped at the largest finite BF16); the block
    holding row ``klen − 1`` scores +∞; the ``num_blocks`` best valid blocks are kept (ties to the lower block).

    Args:
        scores: ``[n, R]`` BF16 indexer logits of the candidate source.
        valid: ``[n, R]`` bool, a prefix ``b < klen(t)`` per query.
        block_size: ``candidate_block_size``.
        num_blocks: ``candidate_topk_blocks``.

    Returns:
        ``[n, R]`` bool: valid rows inside a chosen block.
    """
    n, num_rows = scores.shape
    num_all = -(-num_rows // block_size)
    pad = num_all * block_size - num_rows
    keyed = scores.float().masked_fill(~valid, -math.inf)
    keyed = torch.cat([keyed, torch.full((n, pad), -math.inf)], 1).view(n, num_all, block_size)
    has_valid = torch.cat([valid, torch.zeros(n, pad, dtype=torch.bool)], 1).view(n, num_all, block_size).any(-1)
    block_score = keyed.amax(-1).clamp_max(torch.finfo(BF16).max)
    klen = valid.sum(-1)
    last = torch.arange(num_all)[None, :] == ((klen - 1) // block_size)[:, None]
    block_score = torch.where(last & (klen[:, None] > 0), math.inf, block_score).masked_fill(~has_valid, -math.inf)
    order = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[:, :num_blocks]
    chosen = torch.zeros(n, num_all, dtype=torch.bool).scatter(1, order, has_valid.gather(1, order))
    return chosen.repeat_interleave(block_size, 1)[:, :num_rows] & valid


def attention_core(
    query: Tensor, keys: Tensor, mask: Tensor, sink: Tensor, softmax_scale: float, *, precision: Precision = "exact"
) -> Tensor:
    """One softmax per head over each query's keys plus the per-head sink; K = V
    (docs/design/attention.md, "Per-query attention").

    Args:
        query: ``[nq, n_h, D]`` BF16 (RoPE applied; FP32 in fp32 precision).
        keys: ``[nq, nk, D]`` FP32 dequantized keys (also the values).
        mask: ``[nq, nk]`` bool, True = visible.
        sink: ``[n_h]`` FP32 sink logits (zero value vector).
        softmax_scale: ``D^−0.5``.
        precision: ``"fp32"`` skips the BF16 rounding of the probabilities in the value product.

    Returns:
        ``[nq, n_h, D]`` FP32 (zeros for a query without visible keys).
    """
    logits = torch.einsum("qhd,qkd->qhk", query.float(), keys) * softmax_scale
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    peak = torch.maximum(logits.amax(-1), sink[None, :])
    probs = torch.exp(logits - peak[..., None])
    denominator = probs.sum(-1) + torch.exp(sink[None, :] - peak)
    numerator = torch.einsum("qhk,qkd->qhd", _numerics(precision).bf16(probs).float(), keys)
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
        x: ``[n, H]`` BF16 attention input; ``cos``/``sin`` ``[n, r/2]`` rows of the tokens' positions.

    Returns:
        q ``[n, n_h, D]`` BF16 roped; the FP8-read ``q_norm`` output ``[n, q_r]`` FP32 (indexer input);
        the SWA key ``[n, D]`` FP32 as read back from its FP8 storage.
    """
    eps, p = text.rms_norm_eps, num.precision
    x_q = num.act_quant(x)
    q_latent = rms_norm(num.bf16(x_q @ w.fp8(f"{prefix}.wq_a").T), w[f"{prefix}.q_norm.weight"], eps, precision=p)
    q_latent_q = num.act_quant(q_latent)
    q = num.bf16(q_latent_q @ w.fp8(f"{prefix}.wq_b").T).unflatten(-1, (text.num_attention_heads, text.head_dim))
    q = apply_rope(q, cos[:, None], sin[:, None])
    kv = rms_norm(num.bf16(x_q @ w.fp8(f"{prefix}.wkv").T), w[f"{prefix}.kv_norm.weight"], eps, precision=p)
    return q, q_latent_q, num.store(apply_rope(kv, cos, sin), fp8_quant_dequant)


FUSED_OUTPUT_HEADS = (64, 128)  # head counts whose attention output is FP8-quantized straight from FP32


def _attention_output(
    text: TextConfig, w: WeightSource, num: _Numerics, prefix: str, out: Tensor, cos: Tensor, sin: Tensor
) -> Tensor:
    """De-rotate, grouped ``wo_a`` and ``wo_b``: ``[n, n_h, D]`` FP32 → ``[n, H]`` BF16
    (docs/design/attention.md, "Per-query attention").

    Only the fused 64/128-head kernel hands the output on in FP32; any other head count leaves the attention as BF16,
    and de-rotation and the FP8 quantization read that (docs/design/numerics.md, "Attention output rounding").
    """
    n = out.shape[0]
    groups = text.o_groups
    if text.num_attention_heads not in FUSED_OUTPUT_HEADS:
        out = num.bf16(out)
    out = apply_rope(out, cos[:, None], sin[:, None], inverse=True).reshape(n, groups, -1)
    wo_a = w.fp8(f"{prefix}.wo_a")
    rank = wo_a.shape[0] // groups
    grouped = [num.act_quant(out[:, g]) @ wo_a[g * rank : (g + 1) * rank].T for g in range(groups)]
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
    """Compressed rows attended by each query of a compressed layer: ``[n, K]`` int64, −1 padded.

    Runs, in the write order of a step (docs/design/cache.md, "Write order within a step"), whatever this layer owns:
    compressor (KV source), index keys (index-K source), indexer top-k (index source, restricted to candidate blocks
    after the candidate source).
    """
    prefix = f"layers.{layer}.attn"
    eps, p = text.rms_norm_eps, num.precision
    n = x.shape[0]
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
        valid = torch.arange(scores.shape[1])[None, :] < klen[:, None]
        eligible = valid
        candidate_source = text.candidate_source_layer_id
        if candidate_source == layer:
            assert text.candidate_block_size is not None and text.candidate_topk_blocks is not None
            state.candidates = candidate_block_mask(
                scores, valid, text.candidate_block_size, text.candidate_topk_blocks
            )
        elif candidate_source is not None and layer > candidate_source:
            if state.candidates is None or state.candidates.shape != valid.shape:
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
        x: ``[n, H]`` BF16 ``attn_norm`` output of tokens at positions ``0 … n−1``.
        rope: the layer kind's table with at least ``n`` positions.
        window_floor: ``rect_lo`` of ``mask`` YOCO prefill truncation (window keys below it are invisible), or None.

    Returns:
        the attention output ``[n, H]`` BF16.
    """
    prefix = f"layers.{layer}.attn"
    n = x.shape[0]
    if layer == text.n_prefill_layer:
        state.shared_hidden = x  # YOCO shared hidden: the boundary layer's attention input
    cos, sin = rope.cos[:n], rope.sin[:n]
    q, q_latent, swa_keys = _project_query_and_key(text, w, num, prefix, x, cos, sin)
    state.swa_keys[layer] = swa_keys
    keys = swa_keys.expand(n, n, -1)
    mask = swa_visibility(n, text.sliding_window)
    if window_floor is not None:
        mask = mask & (torch.arange(n) >= window_floor)[None, :]
    if text.compress_ratios[layer] > 0:
        rows = _selected_rows(text, w, num, layer, x, q_latent, state, rope)
        state.selected_rows[layer] = rows
        kv_source = sparse_source_map(text.kv_source_layer_ids, text.num_hidden_layers)[layer]
        compressed = _source(state.compressed_keys, kv_source, layer, "compressed rows")
        padded = torch.cat([compressed, torch.zeros(1, compressed.shape[1])])
        keys = torch.cat([keys, padded[torch.where(rows >= 0, rows, compressed.shape[0])]], dim=1)
        mask = torch.cat([mask, rows >= 0], dim=1)
    scale = 1.0 / math.sqrt(text.head_dim)
    out = attention_core(q, keys, mask, w[f"{prefix}.attn_sink"], scale, precision=num.precision)
    return _attention_output(text, w, num, prefix, out, cos, sin)


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
    """Embedding copied into the ``m`` streams (BF16 ``[n, m, H]``) and the one-hot stream-0 read-mix ``[n, m]``."""
    if token_ids.dtype != torch.int64 or token_ids.dim() != 1:
        raise TypeError(
            f"token ids must be a 1-D int64 tensor, got {token_ids.dtype} with shape {tuple(token_ids.shape)}"
        )
    if token_ids.numel() == 0:
        raise ValueError("token ids must not be empty")
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


def reference_forward_full(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    token_ids: Tensor,
    engram_vocabulary: EngramVocabulary | None = None,
    *,
    precision: Precision = "exact",
    yoco_keep_tokens: int | None = None,
) -> ReferenceOutput:
    """One full-sequence causal forward of one request, positions ``0 … n−1`` (docs/design/model.md, "Forward pass").

    Args:
        config: the model configuration.
        weights: HF-named checkpoint tensors in stored formats (``model.`` prefix optional), or a ``WeightSource``.
        token_ids: ``[n]`` int64 ids in ``[0, V)``.
        engram_vocabulary: compressed Engram vocabulary; required when the model has Engram layers.
        precision: ``"exact"`` (the spec's numerics) or ``"fp32"`` (see "Precision" in the module docstring).
        yoco_keep_tokens: ``KEEP`` of ``mask`` YOCO prefill truncation (choice 11): YOCO consumer layers see window
            keys at positions ``≥ n − KEEP`` only; None is ``off``.

    Returns:
        logits, collapsed hidden, DSpark target features, the compressed rows each query attended and the keys a
        cache would hold.
    """
    text = config.text
    num = _numerics(precision)
    w = _weight_source(weights)
    if text.engram_layer_ids and engram_vocabulary is None:
        raise ValueError(f"Engram layers {list(text.engram_layer_ids)} need an engram_vocabulary")
    trunk, read_mix = _expand(w, num, token_ids, text)
    n = token_ids.shape[0]
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
            trunk = _engram_layer(text, w, num, layer, trunk, token_ids, engram_vocabulary)
        if layer in text.dspark_target_layer_ids:
            features[layer] = num.bf16(trunk.float().mean(1))

        def attention(x: Tensor, layer: int = layer) -> Tensor:
            consumer_floor = floor if layer >= text.n_prefill_layer else None
            return _attention_layer(
                text, w, num, layer, x, state, tables[text.compress_ratios[layer] > 0], consumer_floor
            )

        pending, read_mix = _decoder_layer(
            text, w, num, f"layers.{layer}", trunk, read_mix, attention, text.n_routed_experts, text.num_experts_per_tok
        )
    assert pending is not None
    hidden = _collapse(text, w, num, "", pending, read_mix)
    logits = _bf16_linear(rms_norm(hidden, w["norm.weight"], text.rms_norm_eps, precision=precision), w["head.weight"])
    target_features = torch.cat([features[t] for t in text.dspark_target_layer_ids], dim=-1)
    return ReferenceOutput(
        logits,
        hidden,
        target_features,
        state.selected_rows,
        state.swa_keys,
        state.compressed_keys,
        state.index_keys,
        state.candidates,
    )


def reference_forward(
    config: ModelConfig,
    weights: Mapping[str, Tensor] | WeightSource,
    token_ids: Tensor,
    engram_vocabulary: EngramVocabulary | None = None,
    *,
    precision: Precision = "exact",
) -> Tensor:
    """Logits ``[n, V]`` FP32 of one full causal forward; see ``reference_forward_full`` for the arguments."""
    return reference_forward_full(config, weights, token_ids, engram_vocabulary, precision=precision).logits
