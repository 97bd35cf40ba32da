"""Layers and model parts against the single-file reference (bitwise where both follow the same rounding points)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import (
    KeySource,
    RowFormat,
    apply_rope,
    apply_rope_,
    bf16_gemm,
    encode_rows,
    quantize_fp8_block,
    quantize_mxfp4,
    sparse_attention,
    swiglu_clamped,
)
from deepinfer_model import reference as ref
from deepinfer_model.deepseek_v41.hyper_connection import hc_mixes, hc_post, hc_read
from deepinfer_model.deepseek_v41.moe import Router, SharedExperts
from deepinfer_model.layers.embedding import LMHead, VocabEmbedding
from deepinfer_model.layers.linear import (
    Bf16Linear,
    Fp8BlockLinear,
    Fp8GroupedLinear,
    Mxfp4ExpertStack,
)
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RotaryEmbedding
from deepinfer_model.state import StepMemo

EXACT, FP32 = ComputeMode.EXACT, ComputeMode.FP32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_layer(out_features: int, in_features: int, mode: ComputeMode, seed: int = 0) -> Fp8BlockLinear:
    layer = Fp8BlockLinear(in_features, out_features, mode)
    q, s = quantize_fp8_block(torch.randn(out_features, in_features, generator=_gen(seed)) / in_features**0.5)
    layer.weight.weight_loader(layer.weight, q)
    layer.scale.weight_loader(layer.scale, s)
    return layer


def test_fp8_linear_exact_matches_reference_and_fp32_mode_skips_quantization() -> None:
    x = torch.randn(5, 96, generator=_gen(1)).to(torch.bfloat16)
    exact = _fp8_layer(64, 96, EXACT)
    expected = (ref.fp8_quant_dequant(x) @ ref.dequantize_fp8_block(exact.weight, exact.scale).T).to(torch.bfloat16)
    assert torch.equal(exact(x), expected)
    fp32 = _fp8_layer(64, 96, FP32)
    assert fp32(x).dtype == torch.float32
    torch.testing.assert_close(fp32(x), x.float() @ fp32.dequantized_weight().T, rtol=1e-6, atol=1e-6)


def test_merged_fp8_loader_places_shards_and_rejects_bad_input() -> None:
    merged = Fp8BlockLinear(64, 128, EXACT, shard_sizes=(64, 64))
    parts = [quantize_fp8_block(torch.randn(64, 64, generator=_gen(seed))) for seed in (2, 3)]
    for shard, (q, s) in enumerate(parts):
        merged.weight.weight_loader(merged.weight, q, shard)
        merged.scale.weight_loader(merged.scale, s, shard)
    full = torch.cat([ref.dequantize_fp8_block(q, s) for q, s in parts])
    assert torch.equal(merged.dequantized_weight(), full)
    with pytest.raises(ValueError, match="shard id"):
        merged.weight.weight_loader(merged.weight, parts[0][0], 2)
    with pytest.raises(TypeError, match="dtype"):
        merged.weight.weight_loader(merged.weight, parts[0][0].float(), 0)
    plain = Fp8BlockLinear(64, 64, EXACT)
    with pytest.raises(ValueError, match="shape"):
        plain.weight.weight_loader(plain.weight, torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="shard_sizes"):
        Fp8BlockLinear(64, 96, EXACT, shard_sizes=(48, 48))


def test_mxfp4_stack_dequantizes_like_the_reference() -> None:
    stack = Mxfp4ExpertStack(num_experts=2, in_features=64, out_features=64, shard_sizes=(32, 32), mode=FP32)
    expected = []
    for expert in range(2):
        halves = [quantize_mxfp4(torch.randn(32, 64, generator=_gen(10 * expert + s))) for s in range(2)]
        for shard, (packed, scale) in enumerate(halves):
            stack.weight.weight_loader(stack.weight, packed, (expert, shard))
            stack.scale.weight_loader(stack.scale, scale, (expert, shard))
        expected.append(torch.cat([ref.dequantize_mxfp4(p, s) for p, s in halves]))
    for expert in range(2):
        assert torch.equal(stack.dequantized_weight(expert), expected[expert])
    with pytest.raises(ValueError, match="out of range"):
        stack.weight.weight_loader(stack.weight, halves[0][0], (2, 0))


def test_grouped_linear_keeps_fp32_and_matches_per_group_products() -> None:
    layer = Fp8GroupedLinear(groups=2, in_per_group=64, out_per_group=32, mode=EXACT)
    q, s = quantize_fp8_block(torch.randn(64, 64, generator=_gen(4)) / 8)
    layer.weight.weight_loader(layer.weight, q)
    layer.scale.weight_loader(layer.scale, s)
    x = torch.randn(3, 128, generator=_gen(5))
    w = ref.dequantize_fp8_block(q, s)
    expected = torch.cat(
        [ref.fp8_quant_dequant(x[:, g * 64 : (g + 1) * 64]) @ w[g * 32 : (g + 1) * 32].T for g in range(2)], 1
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    assert layer(x).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_linear_on_cuda_runs_the_grouped_gemm() -> None:
    """CUDA ``wo_a`` (kernels' grouped FP8 GEMM on the stored weight) vs the CPU path (FP32 einsum over the kept
    weight): the same exact products summed in FP32 in two orders, each within ``K·2^−24·S`` of the exact sum
    (``S = Σ|x̂_i·ŵ_i|``) plus one FP32 ulp."""
    groups, k, n = 4, 512, 64
    layer = Fp8GroupedLinear(groups=groups, in_per_group=k, out_per_group=n, mode=EXACT)
    q, s = quantize_fp8_block(torch.randn(groups * n, k, generator=_gen(30)) / 8)
    layer.weight.weight_loader(layer.weight, q)
    layer.scale.weight_loader(layer.scale, s)
    x = torch.randn(5, groups * k, generator=_gen(31)).to(torch.bfloat16)
    on_cpu = layer(x)
    on_cuda = layer.cuda()(x.cuda()).cpu()
    assert on_cuda.dtype == torch.float32 and on_cuda.shape == on_cpu.shape
    x_hat = ref.fp8_quant_dequant(x.float()).double().view(5, groups, k).abs()
    w_hat = ref.dequantize_fp8_block(q, s).double().view(groups, n, k).abs()
    bound = 2 * k * 2.0**-24 * torch.einsum("mgk,gnk->mgn", x_hat, w_hat).reshape(5, -1) + on_cpu.abs() * 2.0**-23
    assert bool(((on_cuda.double() - on_cpu.double()).abs() <= bound).all())


def _rotated_grouped_layer(groups: int, k: int, n: int, seed: int) -> Fp8GroupedLinear:
    layer = Fp8GroupedLinear(groups=groups, in_per_group=k, out_per_group=n, mode=EXACT)
    q, s = quantize_fp8_block(torch.randn(groups * n, k, generator=_gen(seed)) / 8)
    layer.weight.weight_loader(layer.weight, q)
    layer.scale.weight_loader(layer.scale, s)
    return layer


def _heads_and_rotation(
    tokens: int, heads: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    angles = torch.randn(tokens, 32, generator=_gen(seed)) * 3
    x = torch.randn(tokens, heads, width, generator=_gen(seed + 1)).to(torch.bfloat16).float()
    return x, torch.cos(angles), -torch.sin(angles)


def test_grouped_linear_rotated_is_the_rotation_then_forward() -> None:
    """``wo_a`` after the attention output's de-rotation (the last 64 columns of each head, in FP32) equals the
    rotation by ``apply_rope`` followed by ``forward``, bit for bit, and differs from ``forward`` alone."""
    layer = _rotated_grouped_layer(2, 256, 32, seed=60)
    x, cos, sin = _heads_and_rotation(3, 4, 128, seed=61)
    rotated = x.clone()
    rotated[..., 64:] = apply_rope(x[..., 64:], cos, sin)
    expected = layer(rotated.view(3, -1))
    assert torch.equal(layer.forward_rotated(x.clone(), cos, sin), expected)
    assert not torch.equal(expected, layer(x.view(3, -1)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_linear_rotated_on_cuda_reads_bf16_and_fp32_alike() -> None:
    """On CUDA the rotation runs inside the kernels' op: the attention output as FlashMLA leaves it (BF16) and
    widened (FP32) give the bits of ``apply_rope_`` on the FP32 output followed by ``forward`` (the path before the
    op), at 8 and at 300 rows (another tile)."""
    layer = _rotated_grouped_layer(4, 512, 64, seed=62).cuda()
    for tokens in (8, 300):
        x, cos, sin = (t.cuda() for t in _heads_and_rotation(tokens, 8, 256, seed=63 + tokens))
        before = x.clone()
        apply_rope_(before[..., 192:], cos, sin)
        expected = layer(before.view(tokens, -1))
        assert torch.equal(layer.forward_rotated(x.to(torch.bfloat16), cos, sin), expected), tokens
        assert torch.equal(layer.forward_rotated(x, cos, sin), expected), tokens


def test_norm_fp8_copy_only_on_an_accelerator() -> None:
    norm = RMSNorm(64, 1e-6, EXACT)
    norm.weight.data.copy_(torch.randn(64, generator=_gen(40)).to(torch.bfloat16))
    x = torch.randn(3, 64, generator=_gen(41)).to(torch.bfloat16)
    y, copy = norm.with_fp8_copy(x)
    assert copy is None and torch.equal(y, norm(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_norm_fp8_copy_feeds_the_fp8_gemm_bitwise_on_cuda() -> None:
    """attn_norm → wq_a with the fused norm's FP8 copy equals norm → GEMM with its own quantizer, bit for bit."""
    hidden, out = 512, 96
    norm = RMSNorm(hidden, 1e-6, EXACT)
    norm.weight.data.copy_(torch.randn(hidden, generator=_gen(42)).to(torch.bfloat16))
    linear = Fp8BlockLinear(hidden, out, EXACT)
    q, s = quantize_fp8_block(torch.randn(out, hidden, generator=_gen(43)) / 8)
    linear.weight.weight_loader(linear.weight, q)
    linear.scale.weight_loader(linear.scale, s)
    norm, linear = norm.cuda(), linear.cuda()
    x = torch.randn(7, hidden, generator=_gen(44)).to(torch.bfloat16).cuda()
    y, copy = norm.with_fp8_copy(x)
    assert copy is not None and torch.equal(y, norm(x))
    assert torch.equal(linear(y, fp8_copy=copy), linear(y))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_expert_fused_swiglu_fp8_bitwise_on_cuda() -> None:
    """The shared expert on CUDA (SwiGLU + FP8 copy in one kernel, w2 on the copy) equals SwiGLU then w2 quantizing
    the FP32 product itself, bit for bit."""
    hidden, intermediate = 256, 128
    experts = SharedExperts(hidden, intermediate, 10.0, EXACT)
    for linear, rows, cols, shards in (
        (experts.w13, intermediate, hidden, (0, 1)),
        (experts.w2, hidden, intermediate, (None,)),
    ):
        for shard in shards:
            q, s = quantize_fp8_block(torch.randn(rows, cols, generator=_gen(50 + (shard or 0))) / 8)
            linear.weight.weight_loader(linear.weight, q, shard)
            linear.scale.weight_loader(linear.scale, s, shard)
    experts = experts.cuda()
    x = torch.randn(6, hidden, generator=_gen(52)).to(torch.bfloat16).cuda()
    assert experts.w2.runs_on_fp8_copy()
    expected = experts.w2(swiglu_clamped(experts.w13(x), 10.0))
    assert torch.equal(experts(x), expected)


def test_bf16_linear_norm_embedding_head() -> None:
    x = torch.randn(4, 64, generator=_gen(6)).to(torch.bfloat16)
    lin = Bf16Linear(64, 16, EXACT)
    lin.weight.data.copy_(torch.randn(16, 64, generator=_gen(7)).to(torch.bfloat16))
    assert torch.equal(lin(x), (x.float() @ lin.weight.float().T).to(torch.bfloat16))
    norm = RMSNorm(64, 1e-6, EXACT)
    norm.weight.data.copy_((1 + 0.1 * torch.randn(64, generator=_gen(8))).to(torch.bfloat16))
    assert torch.equal(norm(x), ref.rms_norm(x, norm.weight, 1e-6))
    embed = VocabEmbedding(10, 64, EXACT)
    embed.weight.data.copy_(torch.randn(10, 64, generator=_gen(9)).to(torch.bfloat16))
    rows = embed(torch.tensor([3, -1, 10]))
    assert torch.equal(rows[0], embed.weight[3]) and not rows[1:].view(torch.int16).any()  # +0.0 bits
    head = LMHead(10, 64)
    head.weight.data.copy_(embed.weight)
    assert head(x).dtype == torch.float32 and head(x).shape == (4, 10)


@pytest.mark.parametrize("yarn", [None, (4.0, 1024, 32.0, 1.0)])
def test_rope_matches_reference_and_inverts(yarn: tuple[float, int, float, float] | None) -> None:
    rope = RotaryEmbedding(64, 160000.0, yarn)
    freqs = ref.rope_inv_freq(64, 160000.0) if yarn is None else ref.yarn_inv_freq(64, 160000.0, *yarn)
    cos, sin = ref.rope_cos_sin(freqs, 300)
    positions = torch.tensor([0, 5, 77, 299])
    x = torch.randn(4, 3, 128, generator=_gen(10)).to(torch.bfloat16)
    expected = torch.cat([x[..., :64], ref.apply_rope(x[..., 64:], cos[positions, None], sin[positions, None])], -1)
    assert torch.equal(rope.rotate(x, rope.table(positions)), expected)
    owned = x.clone()
    assert rope.rotate_(owned, rope.table(positions)) is owned and torch.equal(owned, expected)
    xf = x.float()
    back = rope.rotate(rope.rotate(xf, rope.table(positions)), rope.table(positions, inverse=True))
    torch.testing.assert_close(back, xf, rtol=1e-5, atol=1e-5)


def test_step_tables_share_one_table_for_both_directions() -> None:
    """``step_table`` builds one ``rope_table`` per positions key and frequencies, for the forward and the inverse
    rotation (the inverse's sines are the forward's negated, bit for bit), and gives ``table``'s values."""
    rope, same = RotaryEmbedding(64, 10000.0, None), RotaryEmbedding(64, 10000.0, None)
    positions = torch.tensor([3, 0, 41])
    memo, calls = StepMemo(), []

    def counted() -> torch.Tensor:
        calls.append(1)
        return positions

    cos, sin = rope.step_table(memo, "p", counted)
    inv_cos, inv_sin = same.step_table(memo, "p", counted, inverse=True)
    assert len(calls) == 1
    assert cos.data_ptr() == inv_cos.data_ptr() and torch.equal(inv_sin.view(torch.int32), (-sin).view(torch.int32))
    table = rope.table(positions)
    assert torch.equal(cos, table[0]) and torch.equal(sin, table[1])


def test_swiglu_clamps_and_weights() -> None:
    t = torch.tensor([[30.0, -30.0, 30.0, 2.0]])
    out = swiglu_clamped(t, 10.0, torch.tensor([0.5]))
    gate = torch.tensor([10.0, -30.0])
    up = torch.tensor([10.0, 2.0])
    torch.testing.assert_close(out, (gate * torch.sigmoid(gate) * up * 0.5)[None], rtol=1e-6, atol=1e-6)
    assert torch.equal(swiglu_clamped(t, None)[0, 0], torch.tensor(30.0) * torch.sigmoid(torch.tensor(30.0)) * 30.0)


def test_hyper_connection_matches_reference_bitwise() -> None:
    m, hidden = 4, 64
    trunk = torch.randn(6, m, hidden, generator=_gen(11)).to(torch.bfloat16)
    fn = 0.01 * torch.randn((2 + m) * m, m * hidden, generator=_gen(12))
    base = torch.randn((2 + m) * m, generator=_gen(13))
    scale = torch.tensor([0.5, 0.7, 0.9])
    read, write, comb = hc_mixes(trunk, fn, scale, base, 1e-6, 1e-6, 20, EXACT)
    mix = ref.hc_mix_logits(trunk, fn, 1e-6)
    ref_read, ref_write, ref_comb = ref.hc_split_mixes(mix, base, scale, m, 1e-6, 20)
    assert torch.equal(read, ref_read) and torch.equal(write, ref_write) and torch.equal(comb, ref_comb)
    y = torch.randn(6, hidden, generator=_gen(14)).to(torch.bfloat16)
    assert torch.equal(hc_read(trunk, read, EXACT), ref.hc_read(trunk, ref_read))
    assert torch.equal(hc_post(y, trunk, write, comb, EXACT), ref.hc_post(y, trunk, ref_write, ref_comb))


def test_router_matches_reference() -> None:
    router = Router(num_experts=8, hidden=64, top_k=3, scaling=1.5)
    router.weight.data.copy_(torch.randn(8, 64, generator=_gen(15)).to(torch.bfloat16))
    router.bias.data.copy_(0.1 * torch.randn(8, generator=_gen(16)))
    x = torch.randn(7, 64, generator=_gen(17)).to(torch.bfloat16)
    ids, weights = router(x)
    ref_ids, ref_weights = ref.moe_route(ref.router_scores(x.float() @ router.weight.float().T), router.bias, 3, 1.5)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("mode", [EXACT, FP32])
def test_sparse_attention_matches_reference_core(mode: ComputeMode) -> None:
    """The kernels' op the layers call, over keys from two sources of one raw FP32 pool, against the oracle."""
    q = torch.randn(5, 4, 32, generator=_gen(18)).to(torch.bfloat16)
    keys = torch.randn(5, 9, 32, generator=_gen(19))
    valid = torch.rand(5, 9, generator=_gen(20)) > 0.3
    valid[2] = False
    sink = torch.randn(4, generator=_gen(21))
    pool = encode_rows(keys.reshape(45, 32), RowFormat.RAW_FP32)
    rows = torch.where(valid, torch.arange(45).view(5, 9), -1)
    sources = [KeySource(pool, rows[:, :4], RowFormat.RAW_FP32), KeySource(pool, rows[:, 4:], RowFormat.RAW_FP32)]
    out = sparse_attention(q, sources, sink, 32**-0.5, mode is EXACT)
    assert not out[2].any()
    expected = ref.attention_core(q, keys, valid, sink, 32**-0.5)
    if mode is EXACT:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_engram_vocab_hash_and_rows_match_reference() -> None:
    from deepinfer_model.checkpoint.tokenizer import build_tokenizer
    from deepinfer_model.config import load_preset
    from deepinfer_model.deepseek_v41.engram import hash_multipliers, ngram_rows
    from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer, normalize_engram_key
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_model.state import StepMetadata

    config = load_preset("tiny")
    tokenizer = build_tokenizer(config)
    vocab = engram_vocab_from_tokenizer(tokenizer)
    expected = ref.engram_vocabulary_from_tokenizer(tokenizer)
    assert torch.equal(vocab.old_to_new, expected.old_to_new)
    assert (vocab.num_compressed, vocab.pad_id) == (expected.num_compressed, expected.pad_id)
    assert normalize_engram_key("  Héllo\t\n") == "hello" and normalize_engram_key(" \n ") == " "
    assert hash_multipliers(2, 1000, 3).tolist() == ref.engram_hash_multipliers(2, 3, 1000)
    # Hash example worked by hand.
    assert hash_multipliers(0, 1000, 3).tolist() == [5874934615388535, 2488343231644625, 377914054924497]
    ids = torch.tensor([5, 7, 2000, 9, 4, 1])
    compressed = torch.where(ids < vocab.old_to_new.shape[0], vocab.old_to_new[ids.clamp(max=1023)], -1)
    full = ref.engram_ngram_rows(compressed, 3, vocab.pad_id)
    # The same rows for a chunk starting at position 3 whose prefix holds positions 1 and 2.
    batch = ForwardBatch.for_requests(
        [ids[3:].tolist()], [3], torch.zeros(1, 1, dtype=torch.int32), [0], torch.tensor([[7, 2000]])
    )
    rows, active = ngram_rows(StepMetadata.from_batch(batch), batch.input_ids, batch.engram_prefix_ids, vocab)
    assert torch.equal(rows, full[3:]) and active.all()


def test_engram_lookup_gathers_the_rows_of_the_reference_hash() -> None:
    """The table rows the Engram gathers (the kernels' ``engram_lookup`` on its sizes and offsets) against the
    reference's column loop: the hand-worked example, then random rows of large ids whose products wrap around int64.
    Each table row holds its own index, so the gathered bytes name the rows."""
    from deepinfer_kernels import engram_lookup

    primes = [1009, 1013, 1019, 1021, 1031, 1033]
    sizes = torch.tensor(primes)
    offsets = torch.tensor([sum(primes[:i]) for i in range(len(primes))])
    weight = torch.arange(sum(primes), dtype=torch.int32).view(torch.uint8).view(-1, 4).view(torch.float8_e4m3fn)
    scale = torch.zeros(sum(primes), 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)

    def table_rows(rows: torch.Tensor, multipliers: list[int], columns: int) -> torch.Tensor:
        codes, _ = engram_lookup(rows, torch.tensor(multipliers), sizes[:columns], offsets[:columns], weight, scale)
        return codes.view(torch.uint8).view(torch.int32).long()

    multipliers = ref.engram_hash_multipliers(0, 4, 1000)
    rows = torch.randint(0, 2**40, (50, 4), generator=torch.Generator().manual_seed(3))
    rows[0] = torch.tensor([5, 7, 2, 3])
    assert torch.equal(table_rows(rows, multipliers, 6), ref.engram_hash(rows, multipliers, primes, 2))
    a0 = ref.engram_hash_multipliers(0, 3, 1000)
    assert table_rows(torch.tensor([[5, 7, 2]]), a0, 4).tolist() == [[645, 1023, 2832, 3808]]


def test_engram_multipliers_follow_the_module_to_another_device() -> None:
    """A module moved after a call (the CPU model then ``.cuda()``) hashes with multipliers on its new device."""
    from _layered_model_support import tiny_model

    engram = next(block.engram for block in tiny_model(ComputeMode.EXACT).layers if block.engram is not None)
    on_cpu = engram.multipliers(1000)
    assert on_cpu.device.type == "cpu" and engram.multipliers(1000) is on_cpu
    moved = engram.to("meta").multipliers(1000)
    assert moved.device.type == "meta" and moved.shape == on_cpu.shape


@pytest.mark.parametrize("seed", [0, 1, 20014, 140098, 2**40 + 5])
def test_pcg64_bounded_integers_match_numpy(seed: int) -> None:
    import numpy as np

    from deepinfer_model.deepseek_v41._pcg64 import bounded_int64s

    for bound in (2**32 + 1, 35672076256399, 4611686018427387903):
        expected = np.random.default_rng(seed).integers(0, bound, size=7, dtype=np.int64).tolist()
        assert bounded_int64s(seed, bound, 7) == expected
    with pytest.raises(ValueError, match="bound"):
        bounded_int64s(seed, 2**31, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lm_head_on_cuda_is_bf16_gemm_with_fp32_accumulation() -> None:
    """CUDA LM head (BF16 GEMM, FP32 accumulation and logits) vs the FP64 product of the same BF16 operands:
    within the FP32 summation bound ``K·2^−24·Σ|h_i·w_i|`` plus one FP32 ulp of the rounded result."""
    vocab, hidden = 1000, 5120
    head = LMHead(vocab, hidden).cuda()
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=_gen(20)).to(torch.bfloat16))
    h = torch.randn(3, hidden, generator=_gen(21)).to(torch.bfloat16).cuda()
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (3, vocab)
    exact = h.double() @ head.weight.double().t()
    bound = hidden * 2.0**-24 * (h.double().abs() @ head.weight.double().abs().t()) + exact.abs() * 2.0**-23
    assert bool(((logits.double() - exact).abs() <= bound).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_weight_products_on_cuda_read_the_stored_weight() -> None:
    """The kernels' ``bf16_gemm`` on CUDA (BF16 GEMM, FP32 accumulation; 3-D input) is within the FP32 summation bound
    of the FP64 product, like the LM head; ``Bf16Linear`` returns it, and the router picks the CPU's experts."""
    hidden, out = 512, 64
    x = torch.randn(2, 5, hidden, generator=_gen(22)).to(torch.bfloat16)
    weight = torch.randn(out, hidden, generator=_gen(23)).to(torch.bfloat16)
    got = bf16_gemm(x.cuda(), weight.cuda()).cpu()
    assert got.dtype == torch.float32 and got.shape == (2, 5, out)
    exact = x.double() @ weight.double().t()
    bound = hidden * 2.0**-24 * (x.double().abs() @ weight.double().abs().t()) + exact.abs() * 2.0**-23
    assert bool(((got.double() - exact).abs() <= bound).all())
    linear = Bf16Linear(hidden, out, EXACT, fp32_output=True)
    linear.weight.data.copy_(weight)
    assert torch.equal(linear.cuda()(x.cuda()).cpu(), got)
    router = Router(out, hidden, top_k=4, scaling=1.5)
    router.weight.data.copy_(weight)
    router.bias.data.zero_()
    router.bias_vl.data.zero_()
    expected_ids, expected_weights = router(x[0])
    ids, weights = router.cuda()(x[0].cuda())
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_weights, rtol=1e-5, atol=1e-6)
