"""The reference model's two precisions: exact (the spec's numerics) and fp32 (no rounding).

Covers: fp32-mode forward (dtypes, unquantized cache vectors, determinism, causality, its distance from exact mode,
its stability under one-ulp weight perturbations that move exact mode by orders of magnitude more); every rounding
building block in fp32 precision against a float64 evaluation of the same formula; the DSpark draft path in fp32;
rejection of an unknown precision. Exact mode is checked against the layered model in test_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_reference_model import random_checkpoint, tiny_vocabulary

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.config import ModelConfig, load_preset


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return load_preset("tiny")


@pytest.fixture(scope="module")
def tiny_weights(tiny: ModelConfig) -> dict[str, torch.Tensor]:
    return random_checkpoint(tiny, seed=1)


@pytest.fixture(scope="module")
def tokens(tiny: ModelConfig) -> torch.Tensor:
    text = "Sphinx of black quartz, judge my vow; the five boxing wizards jump quickly. " * 8
    return torch.tensor(build_tokenizer(tiny).encode(text).ids, dtype=torch.int64)[:48]


@pytest.fixture(scope="module")
def vocabulary(tiny: ModelConfig) -> ref.EngramVocabulary:
    return tiny_vocabulary(tiny)


@pytest.fixture(scope="module")
def fp32_output(tiny, tiny_weights, tokens, vocabulary) -> ref.ReferenceOutput:
    """40 tokens: past the indexer's top-k (16) and the candidate restriction (8 blocks of 4 C1 rows)."""
    return ref.reference_forward_full(tiny, tiny_weights, tokens[:40], vocabulary, precision="fp32")


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


def test_unknown_precision_is_rejected(tiny, tiny_weights, tokens, vocabulary):
    with pytest.raises(ValueError, match="precision must be 'exact' or 'fp32', got 'bf16'"):
        ref.reference_forward(tiny, tiny_weights, tokens[:4], vocabulary, precision="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="precision"):
        ref.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, precision="FP32")  # type: ignore[arg-type]


# ---- fp32 mode forward ---------------------------------------------------------------------------------------------


def test_fp32_mode_keeps_activations_and_cache_vectors_unrounded(fp32_output):
    out = fp32_output
    assert out.logits.dtype == out.hidden.dtype == out.target_features.dtype == torch.float32
    assert torch.isfinite(out.logits).all()
    # Exact mode reads caches back from FP8/FP4 (re-quantizing is then the identity); fp32 mode keeps FP32 vectors.
    for stored, quantizer in [
        (out.swa_keys[0], ref.fp8_quant_dequant),
        (out.compressed_keys[1], ref.fp4_e4m3_quant_dequant),
        (out.index_keys[4], ref.fp4_ue8m0_quant_dequant),
    ]:
        assert stored.dtype == torch.float32
        assert not torch.equal(quantizer(stored), stored)
    assert not torch.equal(out.hidden.bfloat16().float(), out.hidden)  # no BF16 rounding of the trunk either


def test_fp32_mode_differs_from_exact_mode_by_the_rounding_noise(tiny, tiny_weights, tokens, vocabulary, fp32_output):
    """Measured: max |Δ| / max |exact| = 0.59 (Frobenius 0.25, mean row cosine 0.969) on these 40 tokens.

    That is large because the random tiny model amplifies noise: removing only the TF32 rounding of ``fn`` already
    moves the logits by 7 % (Frobenius, 16 tokens), as it flips indexer top-k and routing decisions.
    """
    exact = ref.reference_forward(tiny, tiny_weights, tokens[:40], vocabulary)
    fp32 = fp32_output.logits
    relative = _relative(fp32, exact)
    assert 1e-3 < relative < 1.0
    assert torch.nn.functional.cosine_similarity(fp32, exact, dim=-1).mean() > 0.9


def test_fp32_mode_is_deterministic_and_causal(tiny, tiny_weights, tokens, vocabulary, fp32_output):
    """Causal up to FP32 summation order (measured 3e-7 of max |logit|), not bit for bit as in exact mode.

    A later token changes which tokens an expert receives, so the earlier rows go through a GEMM with another row
    count and may be summed in another order; in exact mode the FP8 products and BF16 roundings absorb that.
    """
    again = ref.reference_forward(tiny, tiny_weights, tokens[:40], vocabulary, precision="fp32")
    assert torch.equal(again, fp32_output.logits)
    changed = tokens[:40].clone()
    changed[30] = (changed[30] + 1) % tiny.text.vocab_size
    logits = ref.reference_forward(tiny, tiny_weights, changed, vocabulary, precision="fp32")
    assert _relative(logits[:30], fp32_output.logits[:30]) < 1e-6
    assert _relative(logits[30], fp32_output.logits[30]) > 1e-2
    prefix = ref.reference_forward(tiny, tiny_weights, tokens[:30], vocabulary, precision="fp32")
    assert _relative(prefix, fp32_output.logits[:30]) < 1e-6  # measured 6e-7


def test_fp32_mode_is_stable_under_one_ulp_weight_perturbations(tiny, tiny_weights, tokens, vocabulary, fp32_output):
    """Every FP32 weight (mHC ``fn``/base/scale, sinks, router bias) moved by ±1 ulp.

    This is the property the layered-vs-reference parity test relies on: fp32 mode turns ulp-sized differences into
    ulp-sized differences. Measured (40 tokens): fp32 mode 9e-7 of max |logit|, exact mode 0.23.
    """
    generator = torch.Generator().manual_seed(0)
    perturbed = dict(tiny_weights)
    for name, tensor in tiny_weights.items():
        if tensor.dtype == torch.float32:
            sign = torch.randint(0, 2, tensor.shape, generator=generator) * 2 - 1
            perturbed[name] = tensor * (1 + sign * 2.0**-23)
    fp32 = ref.reference_forward(tiny, perturbed, tokens[:40], vocabulary, precision="fp32")
    assert 0 < _relative(fp32, fp32_output.logits) < 1e-5
    exact = ref.reference_forward(tiny, tiny_weights, tokens[:40], vocabulary)
    exact_perturbed = ref.reference_forward(tiny, perturbed, tokens[:40], vocabulary)
    assert _relative(exact_perturbed, exact) > 1e-4


def test_fp32_mode_draft_forward_and_heads(tiny, tiny_weights, fp32_output):
    features = fp32_output.target_features[:30]
    draft = ref_dspark.reference_dspark_forward(tiny, tiny_weights, features, anchor_token=7, precision="fp32")
    assert draft.hidden.dtype == torch.float32 and torch.isfinite(draft.hidden).all()
    previous = torch.tensor([7, 1, 2, 3])
    logits, confidence = ref_dspark.reference_dspark_heads(tiny, tiny_weights, draft.hidden, previous, precision="fp32")
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert bool(((confidence > 0) & (confidence < 1)).all())
    rounded_norm, _ = ref_dspark.reference_dspark_heads(tiny, tiny_weights, draft.hidden, previous)
    assert 0 < _relative(logits, rounded_norm) < 1e-2  # only the final norm's BF16 rounding differs: 1.4e-3


# ---- building blocks: fp32 precision vs a float64 evaluation -------------------------------------------------------


def _normal(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _rms64(x: torch.Tensor, eps: float) -> torch.Tensor:
    return 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _case_rms_norm(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = _normal((16, 256), 1), _normal((256,), 2).bfloat16()
    expected = x.double() * _rms64(x.double(), 1e-6) * w.double()
    return ref.rms_norm(x, w, 1e-6, precision=precision), expected


def _case_hc_mix_logits(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    trunk, fn = _normal((8, 4, 64), 3), _normal((24, 256), 4, 0.1)
    z = trunk.double().flatten(1)
    return ref.hc_mix_logits(trunk, fn, 1e-6, precision=precision), (z @ fn.double().T) * _rms64(z, 1e-6)


def _case_hc_read(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    trunk, pre = _normal((8, 4, 64), 5), torch.rand(8, 4, generator=torch.Generator().manual_seed(6))
    return ref.hc_read(trunk, pre, precision=precision), torch.einsum("nm,nmh->nh", pre.double(), trunk.double())


def _case_hc_post(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    y, trunk = _normal((8, 64), 7), _normal((8, 4, 64), 8)
    post, comb = (
        torch.rand(8, 4, generator=torch.Generator().manual_seed(9)),
        ref.sinkhorn(_normal((8, 4, 4), 10), 20, 1e-6),
    )
    expected = post.double()[..., None] * y.double()[:, None] + torch.einsum(
        "nio,nih->noh", comb.double(), trunk.double()
    )
    return ref.hc_post(y, trunk, post, comb, precision=precision), expected


def _case_engram_gate(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    trunk, kv = _normal((8, 4, 64), 11), _normal((8, 5, 64), 12)
    q_weight, k_weight = _normal((4, 64), 13).bfloat16(), _normal((4, 64), 14).bfloat16()
    x, keys, value = trunk.double(), kv[:, :4].double(), kv[:, 4].double()
    z = (
        (x * q_weight.double() * k_weight.double() * keys).sum(-1)
        * _rms64(x, 1e-6)[..., 0]
        * _rms64(keys, 1e-6)[..., 0]
    )
    z = z / math.sqrt(64)
    gate = torch.sigmoid(torch.sign(z) * torch.sqrt(z.abs().clamp_min(1e-6)))
    return ref.engram_gate(trunk, kv, q_weight, k_weight, 1e-6, precision=precision), x + gate[..., None] * value[
        :, None
    ]


def _case_compress_kv(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, wkv, wgate = (
        _normal((16, 64), 15),
        _normal((32, 64), 16, 0.1).bfloat16(),
        _normal((32, 64), 17, 0.1).bfloat16(),
    )
    norm = _normal((32,), 18).bfloat16()
    blocks = hidden.double().unflatten(0, (8, 2))
    weights = torch.softmax(blocks @ wgate.double().T, dim=1)
    latent = (weights * (blocks @ wkv.double().T)).sum(1)
    expected = latent * _rms64(latent, 1e-6) * norm.double()
    return ref.compress_kv(hidden, wkv, wgate, norm, 2, 1e-6, precision=precision), expected


def _case_index_scores(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    query, keys, head_weights = _normal((8, 4, 32), 19), _normal((12, 32), 20), _normal((8, 4), 21).bfloat16()
    dots = torch.einsum("thd,bd->thb", query.double(), keys.double()).clamp_min(0)
    return ref.index_scores(query, head_weights, keys, precision=precision), (
        dots * head_weights.double()[..., None]
    ).sum(1)


def _case_attention_core(precision: ref.Precision) -> tuple[torch.Tensor, torch.Tensor]:
    query, keys, sink = _normal((6, 4, 32), 22), _normal((6, 10, 32), 23), _normal((4,), 24)
    mask = ref.swa_visibility(10, 6)[4:]
    scale = 32**-0.5
    logits = torch.einsum("qhd,qkd->qhk", query.double(), keys.double()) * scale
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    weights = torch.softmax(torch.cat([logits, sink.double()[None, :, None].expand(6, 4, 1)], dim=-1), dim=-1)[..., :-1]
    expected = torch.einsum("qhk,qkd->qhd", weights, keys.double())
    return ref.attention_core(query, keys, mask, sink, scale, precision=precision), expected


@pytest.mark.parametrize(
    "case",
    [
        _case_rms_norm,
        _case_hc_mix_logits,
        _case_hc_read,
        _case_hc_post,
        _case_engram_gate,
        _case_compress_kv,
        _case_index_scores,
        _case_attention_core,
    ],
)
def test_building_block_in_fp32_precision_matches_float64(case):
    """fp32 precision is within FP32 rounding of the float64 value, exact precision visibly not.

    Measured relative to max |float64|: fp32 3e-7 at most (mix logits, compressor), exact 2.7e-4 (TF32) to 4e-3.
    """
    actual, expected = case("fp32")
    assert actual.dtype == torch.float32
    assert _relative(actual, expected) < 1e-5
    rounded, _ = case("exact")
    assert _relative(rounded, expected) > 1e-4
