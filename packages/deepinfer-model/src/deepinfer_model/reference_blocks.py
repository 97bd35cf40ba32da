"""Building blocks of the reference model (``deepinfer_model.reference``, the golden oracle): stored weights and
linear layers, RMSNorm, RoPE/YaRN, manifold-constrained hyper-connections, the Engram layer and the mixture of
experts, in the order ``reference`` lists them. Public names are re-exported by ``reference``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from deepinfer_model.config import TextConfig
from deepinfer_model.reference_engram import (
    EngramVocabulary,
    _engram_sizes,
    engram_gate,
    engram_hash,
    engram_hash_multipliers,
    engram_ngram_rows,
    engram_table_primes,
)
from deepinfer_model.reference_formats import (
    F32,
    Precision,
    _dequantize_fp8_rows,
    _inverse_rms,
    _Numerics,
    _numerics,
    dequantize_fp8_block,
    dequantize_mxfp4,
)

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
    # One unbind and one split instead of a slice per product: in a backward each slice would add a zero-filled copy
    # of the whole trunk; the values read are the same.
    x, weights = trunk.float().unbind(1), pre.split(1, dim=1)
    acc = weights[0] * x[0]
    for j in range(1, len(x)):
        acc = acc + weights[j] * x[j]
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
    x = trunk.float().unbind(1)  # unbound once, as in hc_read
    y = output.float()
    writes, mixes = post.split(1, dim=1), comb.split(1, dim=2)  # mixes[o][:, i] is C_io, [n, 1]
    streams = []
    for o in range(len(x)):
        acc = writes[o] * y
        for i in range(len(x)):
            acc = acc + mixes[o][:, i] * x[i]
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
    """Apply layer ``layer``'s Engram to the trunk ``[B·n, m, H]`` of the sequences ``token_ids`` ``[B, n]``
    (docs/design/model.md, "Engram"): n-grams within each sequence, table rows per token."""
    max_ngram, heads, _ = _engram_sizes(text)
    index = text.engram_layer_ids.index(layer)
    primes = engram_table_primes(text)[index]
    multipliers = engram_hash_multipliers(layer, max_ngram, vocabulary.num_compressed)
    table_size = vocabulary.old_to_new.shape[0]
    in_table = (token_ids >= 0) & (token_ids < table_size)
    compressed = torch.where(in_table, vocabulary.old_to_new[token_ids.clamp(0, table_size - 1)], -1)
    ngrams = engram_ngram_rows(compressed, max_ngram, vocabulary.pad_id).flatten(0, -2)
    idx = engram_hash(ngrams, multipliers, primes, heads)
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
