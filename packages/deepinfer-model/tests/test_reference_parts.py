"""Unit checks of the reference model's building blocks against the spec's worked numbers and properties.

Covers number formats (UE8M0, e4m3, e2m1, TF32, dynamic FP8/FP4 quantization, FP8 block and MXFP4 dequantization),
RMSNorm, RoPE/YaRN tables and rotation, mHC (Sinkhorn, read, post, head), the Engram vocabulary, primes, hash
multipliers (a hand-worked example and the v41-flash values) and gate, MoE routing, top-k, candidate blocks, the
compressor and the attention core.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from deepinfer_model import reference as ref
from deepinfer_model import reference_engram
from deepinfer_model.config import load_preset


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- number formats -------------------------------------------------------------------------------------------------


def test_ue8m0_decodes_every_byte_exactly():
    values = ref.ue8m0_to_float(torch.arange(255, dtype=torch.uint8))
    assert [float(v) for v in values] == [2.0 ** (b - 127) for b in range(255)]
    assert torch.isnan(ref.ue8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()
    as_e8m0 = torch.tensor([0, 127, 130], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert ref.ue8m0_to_float(as_e8m0).tolist() == [2.0**-127, 1.0, 8.0]
    with pytest.raises(TypeError, match="UE8M0"):
        ref.ue8m0_to_float(torch.ones(2))


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3, -2.6, 0.1, 4.9])
    assert ref.round_to_e2m1(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -3.0, 0.0, 4.0]
    assert torch.signbit(ref.round_to_e2m1(torch.tensor([-0.1]))).all()


def test_e4m3_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1000.0, 0.0])
    assert ref.round_to_e4m3(x).tolist() == [1.0, 1.25, 448.0, -448.0, 0.0]


def test_tf32_rounding():
    one_ulp = 2.0**-10
    x = torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, 1 + one_ulp * 0.49, -(1 + one_ulp * 0.51), 3.0])
    assert ref.round_to_tf32(x).tolist() == [1.0, 1 + 2 * one_ulp, 1.0, -(1 + one_ulp), 3.0]


def test_fp8_activation_quantization_uses_power_of_two_scales():
    x = torch.randn(6, 64, generator=_gen(0)) * torch.logspace(-3, 3, 6)[:, None]
    y = ref.fp8_quant_dequant(x.bfloat16())
    groups = y.view(6, 2, 32)
    amax = x.bfloat16().float().view(6, 2, 32).abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 448))
    codes = groups / torch.exp2(exponent)
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)  # every value is e4m3 × 2^e
    assert codes.abs().max() <= 448
    assert torch.allclose(y, x.bfloat16().float(), rtol=2**-3, atol=0)
    assert torch.equal(ref.fp8_quant_dequant(y), y)  # idempotent
    tiny = ref.fp8_quant_dequant(torch.full((1, 32), 1e-9))
    assert tiny.unique().tolist() == [2.0**-30]  # amax floor 1e-4: scale 2^-22, 1e-9·2^22 rounds to 2^-8
    with pytest.raises(ValueError, match="multiple of the quantization group"):
        ref.fp8_quant_dequant(torch.ones(1, 40))


def test_fp4_formats_round_trip_and_lie_on_their_grids():
    x = torch.randn(4, 128, generator=_gen(1))
    ue8m0 = ref.fp4_ue8m0_quant_dequant(x)
    scale = torch.exp2(torch.ceil(torch.log2(x.view(4, 4, 32).abs().amax(-1, keepdim=True) / 6)))
    assert torch.equal(ref.round_to_e2m1(ue8m0.view(4, 4, 32) / scale), ue8m0.view(4, 4, 32) / scale)
    assert torch.equal(ref.fp4_ue8m0_quant_dequant(ue8m0), ue8m0)
    e4m3 = ref.fp4_e4m3_quant_dequant(x)
    group_scale = ref.round_to_e4m3(x.view(4, 8, 16).abs().amax(-1, keepdim=True) / 6)
    assert torch.equal(ref.round_to_e2m1(e4m3.view(4, 8, 16) / group_scale), e4m3.view(4, 8, 16) / group_scale)
    assert (e4m3 - x).abs().max() < 0.5 * x.abs().max()


def test_dequantize_fp8_block_applies_each_32x32_scale():
    codes = torch.ones(40, 50).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = ref.dequantize_fp8_block(codes, scale)
    assert w[:32, :32].unique().tolist() == [1.0] and w[:32, 32:].unique().tolist() == [2.0]
    assert w[32:, :32].unique().tolist() == [0.5] and w[32:, 32:].unique().tolist() == [8.0]
    with pytest.raises(ValueError, match="expected"):
        ref.dequantize_fp8_block(codes, scale[:1])


def test_dequantize_mxfp4_low_nibble_is_the_even_column():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x21  # element 0 = code 1 (0.5), element 1 = code 2 (1.0)
    packed[0, 1] = 0xF9  # element 2 = code 9 (−0.5), element 3 = code 15 (−6)
    scale = torch.tensor([[128]], dtype=torch.uint8)
    w = ref.dequantize_mxfp4(packed.view(torch.int8), scale)
    assert w[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0] and w[0, 4:].abs().sum() == 0


# ---- RMSNorm, RoPE, YaRN ---------------------------------------------------------------------------------------------


def test_rms_norm_matches_a_float64_formula_to_bf16_rounding():
    x = torch.randn(5, 256, generator=_gen(2)).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=_gen(3))).bfloat16()
    y = ref.rms_norm(x, w, 1e-6)
    expected = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.double(), expected, rtol=2**-8, atol=0)


def test_yarn_table_of_the_tiny_config():
    """YaRN bounds worked by hand: r 64, base 160000, L0 1024, β 32/1 → lo 4, hi 14."""
    base = ref.rope_inv_freq(64, 160000.0)
    yarn = ref.yarn_inv_freq(64, 160000.0, 4.0, 1024, 32, 1)
    assert torch.equal(yarn[:5], base[:5])  # i ≤ lo keeps the base frequency
    assert torch.allclose(yarn[14:], base[14:] / 4, rtol=1e-6)  # i ≥ hi is divided by the factor
    between = (yarn[5:14] / base[5:14]).tolist()
    assert all(0.25 < r < 1 for r in between) and between == sorted(between, reverse=True)
    assert base[0] == 1.0 and torch.all(base[1:] < base[:-1])


def test_apply_rope_rotates_interleaved_pairs_of_the_last_r_elements():
    x = torch.randn(3, 2, 128, generator=_gen(4))
    cos, sin = ref.rope_cos_sin(ref.rope_inv_freq(64, 10000.0), 3)
    y = ref.apply_rope(x, cos[:, None], sin[:, None])
    assert torch.equal(y[..., :64], x[..., :64])
    pairs = torch.view_as_complex(x[..., 64:].reshape(3, 2, 32, 2).double().contiguous())
    rotated = torch.view_as_real(
        pairs * torch.polar(torch.ones_like(cos.double()), torch.atan2(sin, cos).double())[:, None]
    )
    assert torch.allclose(y[..., 64:].double(), rotated.reshape(3, 2, 64), atol=1e-5)
    back = ref.apply_rope(y, cos[:, None], sin[:, None], inverse=True)
    assert torch.allclose(back, x, atol=1e-5)
    assert ref.apply_rope(x.bfloat16(), cos[:, None], sin[:, None]).dtype == torch.bfloat16


# ---- mHC ------------------------------------------------------------------------------------------------------------


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(7, 4, 4, generator=_gen(5))
    m = ref.sinkhorn(logits, 20, 1e-6)
    assert torch.allclose(m.sum(-1), torch.ones(7, 4), atol=1e-3)
    assert torch.allclose(m.sum(-2), torch.ones(7, 4), atol=1e-5)
    one = ref.sinkhorn(logits, 1, 1e-6)
    soft = torch.softmax(logits, -1) + 1e-6
    assert torch.allclose(one, soft / (soft.sum(-2, keepdim=True) + 1e-6))


def test_hc_read_post_and_split_with_hand_made_mixes():
    trunk = torch.randn(3, 4, 8, generator=_gen(6)).bfloat16()
    one_hot = torch.zeros(3, 4)
    one_hot[:, 2] = 1
    assert torch.equal(ref.hc_read(trunk, one_hot), trunk[:, 2])
    y = torch.randn(3, 8, generator=_gen(7)).bfloat16()
    identity = torch.eye(4).expand(3, 4, 4)
    new = ref.hc_post(y, trunk, torch.ones(3, 4), identity)
    assert torch.equal(new, (trunk.float() + y.float()[:, None]).bfloat16())
    base = torch.cat([torch.tensor([3.0, -3, -3, -3]), torch.zeros(4), torch.eye(4).flatten() * 6 - 3])
    pre, post, comb = ref.hc_split_mixes(torch.zeros(3, 24), base, torch.full((3,), 0.01), 4, 1e-6, 20)
    assert torch.allclose(pre[0], torch.sigmoid(torch.tensor([3.0, -3, -3, -3])) + 1e-6)
    assert torch.allclose(post, torch.ones(3, 4))  # sigmoid(0) · 2
    assert comb[0].diagonal().min() > 0.9


def test_hc_mix_logits_normalizes_the_flattened_trunk():
    trunk = torch.randn(2, 4, 16, generator=_gen(8)).bfloat16()
    fn = torch.randn(24, 64, generator=_gen(9))
    mix = ref.hc_mix_logits(trunk, fn, 1e-6)
    z = trunk.double().flatten(1)
    expected = (z / torch.sqrt((z**2).mean(-1, keepdim=True) + 1e-6)) @ fn.double().T
    assert torch.allclose(mix.double(), expected, rtol=2e-3, atol=2e-3)  # TF32 weights
    assert torch.allclose(ref.hc_mix_logits(trunk * 4, fn, 1e-6), mix, rtol=1e-5)  # scale invariant


def test_hc_head_reads_with_its_own_mix():
    trunk = torch.randn(2, 4, 16, generator=_gen(10)).bfloat16()
    base = torch.tensor([20.0, -20, -20, -20])
    h = ref.hc_head(trunk, torch.zeros(4, 64), torch.ones(1), base, 1e-6, 0.0)
    assert torch.allclose(h.float(), trunk[:, 0].float(), rtol=1e-2)


# ---- Engram ---------------------------------------------------------------------------------------------------------


def test_engram_primes_multipliers_and_hash_of_the_worked_example():
    """Hand-worked hash example (tiny configuration, V_c = 1000)."""
    text = load_preset("tiny").text
    assert ref.engram_table_primes(text) == [[1009, 1013, 1019, 1021], [1031, 1033, 1039, 1049]]
    a0 = ref.engram_hash_multipliers(0, 3, 1000)
    assert a0 == [5874934615388535, 2488343231644625, 377914054924497]
    assert ref.engram_hash_multipliers(2, 3, 1000) == [7581278190532785, 3676095719277115, 2244174728982399]
    assert ref.engram_hash_multipliers(0, 3, 129280) == [45443491765071, 19247704452697, 2923221340691]
    idx = ref.engram_hash(torch.tensor([[5, 7, 2]]), a0, [1009, 1013, 1019, 1021], 2)
    assert idx.tolist() == [[645, 1023, 2832, 3808]]


def test_engram_primes_and_multipliers_of_the_release_config():
    """Released config: the row counts equal engram_num_embeddings; V_c = 99092 multipliers."""
    text = load_preset("v41-flash").text
    primes = ref.engram_table_primes(text)
    assert [sum(p) for p in primes] == [384006168, 384016682]
    assert primes[0][:4] == [16000057, 16000079, 16000081, 16000097] and primes[1][-1] == 16000889
    assert ref.engram_hash_multipliers(1, 4, 99092) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert ref.engram_hash_multipliers(14, 4, 99092) == [
        67716810739261,
        51510806800915,
        30921347202721,
        82619226485591,
    ]


@pytest.mark.parametrize("seed,bound", [(0, 10**15), (10007 * 3, 2**40 + 7), (123456789012, 2**62 + 3)])
def test_pcg64_bounded_draws_match_numpy(seed, bound):
    expected = np.random.default_rng(seed).integers(0, bound, size=6, dtype=np.int64).tolist()
    rng = reference_engram._Pcg64(seed)
    assert [rng.bounded_uint64(bound - 1) for _ in range(6)] == expected


def test_engram_ngram_rows_pad_the_start_and_after_a_sentinel():
    rows = ref.engram_ngram_rows(torch.tensor([10, 11, -1, 13, 14]), 3, pad_id=0)
    assert rows.tolist() == [[10, 0, 0], [11, 10, 0], [0, 0, 0], [13, 0, 0], [14, 13, 0]]


def test_engram_normalize_and_vocabulary():
    assert ref.engram_normalize("  Hello\n") == "hello"
    assert ref.engram_normalize("\t\n ") == " "
    assert ref.engram_normalize("Café") == "cafe"
    assert ref.engram_normalize("Ｈｉ") == "hi"  # NFKC folds full-width letters
    vocab = ref.EngramVocabulary.from_keys(["a", "b", "pad", "a", "c", "b"], pad_token_id=2)
    assert vocab.old_to_new.tolist() == [0, 1, 2, 0, 3, 1] and vocab.num_compressed == 4 and vocab.pad_id == 2


def test_engram_vocabulary_from_a_tokenizer():
    words = ["<bos>", "Hello", "<｜▁pad▁｜>", "hello", " hello ", "\n", " ", "WORLD"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<bos>"))
    vocab = ref.engram_vocabulary_from_tokenizer(tokenizer)
    assert vocab.old_to_new.tolist() == [0, 1, 2, 1, 1, 3, 3, 4]
    bad = Tokenizer(models.WordLevel({w: i for i, w in enumerate(reversed(words))}, unk_token="<bos>"))
    with pytest.raises(ValueError, match="pad"):
        ref.engram_vocabulary_from_tokenizer(bad)


def test_engram_gate_formula_and_zero_sign():
    trunk = torch.randn(3, 4, 16, generator=_gen(11)).bfloat16()
    kv = torch.randn(3, 5, 16, generator=_gen(12)).bfloat16()
    qw = (1 + 0.1 * torch.randn(4, 16, generator=_gen(13))).bfloat16()
    kw = (1 + 0.1 * torch.randn(4, 16, generator=_gen(14))).bfloat16()
    out = ref.engram_gate(trunk, kv, qw, kw, 1e-6)
    x, k, v = trunk.double(), kv[:, :4].double(), kv[:, 4].double()
    nx = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * qw.double()
    nk = k / torch.sqrt((k**2).mean(-1, keepdim=True) + 1e-6) * kw.double()
    z = (nx * nk).sum(-1) / 4
    gate = torch.sigmoid(torch.sign(z) * torch.sqrt(z.abs().clamp_min(1e-6)))
    assert torch.allclose(out.double(), x + gate[..., None] * v[:, None], rtol=2**-7, atol=1e-2)
    zero_keys = kv.clone()
    zero_keys[:, :4] = 0
    out = ref.engram_gate(trunk, zero_keys, qw, kw, 1e-6)  # z = +0 → sigmoid(+1e−3) (kernel copy-sign)
    assert torch.equal(out, (trunk.float() + torch.sigmoid(torch.tensor(1e-3)) * kv[:, 4:].float()).bfloat16())


# ---- MoE ------------------------------------------------------------------------------------------------------------


def test_router_scores_and_routing_on_hand_made_logits():
    logits = torch.tensor([[0.0, 1.0, 25.0, -30.0]])
    scores = ref.router_scores(logits)
    assert torch.allclose(scores, torch.sqrt(torch.nn.functional.softplus(logits)))
    assert scores[0, 2] == 5.0  # softplus(x) = x above 20
    experts, weights = ref.moe_route(scores, torch.zeros(4), 2, 1.5)
    assert experts.tolist() == [[2, 1]]
    assert torch.allclose(weights, scores[:, [2, 1]] / scores[:, [2, 1]].sum() * 1.5)
    biased, biased_weights = ref.moe_route(scores, torch.tensor([0.0, 0.0, -10.0, 10.0]), 2, 1.5)
    assert biased.tolist() == [[3, 1]]  # the bias changes the choice ...
    assert torch.allclose(biased_weights.sum(), torch.tensor(1.5))  # ... but weights use the unbiased scores
    assert biased_weights[0, 0] < biased_weights[0, 1]
    ties, _ = ref.moe_route(torch.ones(1, 4), torch.zeros(4), 2, 1.0)
    assert ties.tolist() == [[0, 1]]


# ---- indexer, candidates, compressor, attention -------------------------------------------------------------------


def test_select_topk_pads_sorts_and_prefers_lower_rows_on_ties():
    scores = torch.tensor([[1.0, 5.0, 5.0, 2.0, 9.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    eligible = torch.tensor([[True, True, True, True, False], [True, True, False, False, False]])
    assert ref.select_topk(scores, eligible, 3).tolist() == [[1, 2, 3], [0, 1, -1]]
    assert ref.select_topk(torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), 2).tolist() == [[-1, -1]] * 2


def test_candidate_blocks_keep_the_last_valid_block_and_the_best_others():
    scores = torch.tensor([[9.0, 0.0, 1.0, 1.0, 8.0, 0.0, -5.0, -5.0, -9.0, 7.0]])
    valid = torch.arange(10)[None] < 9  # klen 9: rows 0–8, last valid block is block 4 (row 8)
    mask = ref.candidate_block_mask(scores, valid, 2, 2)
    assert torch.nonzero(mask[0]).flatten().tolist() == [0, 1, 8]  # best block 0 plus the forced last block
    everything = ref.candidate_block_mask(scores, valid, 2, 8)
    assert torch.equal(everything, valid)


def test_index_scores_weight_relu_dot_products():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    keys = torch.tensor([[2.0, -3.0], [-1.0, 4.0]])
    scores = ref.index_scores(q, torch.tensor([[0.5, 2.0]]).bfloat16(), keys)
    assert scores.tolist() == [[1.0, 8.0]]  # row 0: 0.5·2 + 2·max(0, −3); row 1: 0.5·0 + 2·4


def test_compress_kv_ratio_two_softmax_weights_and_ratio_one():
    hidden = torch.randn(5, 32, generator=_gen(15)).bfloat16()
    wkv = (torch.randn(32, 32, generator=_gen(16)) / 6).bfloat16()
    norm = torch.ones(32).bfloat16()
    equal_gate = torch.zeros(32, 32).bfloat16()
    rows = ref.compress_kv(hidden, wkv, equal_gate, norm, 2, 1e-6)
    latent = (hidden.float() @ wkv.float().T).view(-1)[: 4 * 32].view(2, 2, 32).mean(1)
    assert rows.shape == (2, 32)
    assert torch.allclose(rows.float(), ref.rms_norm(latent.bfloat16(), norm, 1e-6).float(), atol=2e-2)
    one = ref.compress_kv(hidden, wkv, None, norm, 1, 1e-6)
    assert torch.equal(one, ref.rms_norm((hidden.float() @ wkv.float().T).bfloat16(), norm, 1e-6))
    with pytest.raises(ValueError, match="gate"):
        ref.compress_kv(hidden, wkv, None, norm, 2, 1e-6)


def test_attention_core_sink_and_masking():
    q = torch.ones(2, 1, 4).bfloat16()
    keys = torch.tensor([[[1.0, 0, 0, 0], [0, 2.0, 0, 0]]]).expand(2, 2, 4)
    mask = torch.tensor([[True, False], [False, False]])
    sink = torch.tensor([0.5])
    out = ref.attention_core(q, keys, mask, sink, 0.5)
    p = math.exp(0.5)
    assert torch.allclose(out[0, 0], torch.tensor([p / (p + math.exp(0.5)), 0, 0, 0]), atol=1e-3)
    assert torch.equal(out[1], torch.zeros(1, 4))  # no visible key: only the sink, zero output


def test_swa_visibility_window():
    visible = ref.swa_visibility(6, 3)
    assert [torch.nonzero(row).flatten().tolist() for row in visible] == [
        [0],
        [0, 1],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
        [3, 4, 5],
    ]


def test_source_maps_agree_with_the_config():
    for name in ("tiny", "v41-flash"):
        text = load_preset(name).text
        L = text.num_hidden_layers
        assert ref.sparse_source_map(text.kv_source_layer_ids, L) == list(text.layer_kv_map[:L])
        assert ref.sparse_source_map(text.index_source_layer_ids, L) == list(text.layer_index_module_map[:L])
        assert ref.sparse_source_map(text.index_k_source_layer_ids, L) == list(text.layer_index_k_map[:L])
