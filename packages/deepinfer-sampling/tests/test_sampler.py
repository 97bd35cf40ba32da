"""Sampler behaviour on the reference backend: greedy, logprobs, masks, golden tokens, invalid rows, errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from deepinfer_sampling import (
    LOGPROB_FLOOR,
    Sampler,
    SamplerConfig,
    SampleStatus,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    inverse_cdf_sample,
    parse_token_blacklist,
)
from deepinfer_sampling.penalties import apply_penalties

V = 40


def _logits(num_rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _sampler(**config) -> Sampler:
    return Sampler(SamplerConfig(backend="reference", **config), V, "cpu")


def test_greedy_takes_the_lowest_argmax_with_one_hot_logprobs(rows_factory, batch_factory):
    logits = _logits(3)
    logits[0, [5, 30]] = 50.0
    logits[1, [31, 2]] = 50.0
    batch = batch_factory(rows_factory(SamplingParams(temperature=0.0, top_logprobs=3), 3), V)
    out = _sampler()(logits, batch)
    assert out.token_ids.tolist() == [5, 2, int(logits[2].argmax())]
    assert out.logprobs.tolist() == [0.0, 0.0, 0.0]
    assert out.top_logprob_token_ids[:, 0].tolist() == out.token_ids.tolist()
    assert (out.top_logprobs[:, 1:] == LOGPROB_FLOOR).all()
    assert out.status.tolist() == [SampleStatus.OK] * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.6, top_k=7),
        SamplingParams(temperature=1.4, top_p=0.8),
        SamplingParams(min_p=0.1, top_p=0.95, top_k=20),
    ],
    ids=["plain", "top_k", "top_p", "joint"],
)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_logprobs_are_the_processed_distribution(rows_factory, batch_factory, oracle, params, batch_invariant):
    logits = _logits(6, seed=1)
    batch = batch_factory(rows_factory(dataclasses.replace(params, top_logprobs=V), 6), V)
    out = _sampler(batch_invariant=batch_invariant)(logits, batch)
    for i in range(6):
        expected = oracle(logits[i].tolist(), params)
        want = np.where(expected > 0, np.log(np.maximum(expected, 1e-300)), LOGPROB_FLOOR)
        got = np.full(V, np.nan)
        got[out.top_logprob_token_ids[i].numpy()] = out.top_logprobs[i].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        assert expected[out.token_ids[i]] > 0
        assert out.logprobs[i].item() == pytest.approx(math.log(expected[out.token_ids[i]]), abs=2e-5)


def test_top_logprobs_are_sorted_with_ties_by_lowest_id_and_sized_by_the_largest_request(rows_factory, batch_factory):
    logits = torch.zeros(2, V)
    logits[:, [9, 3, 20]] = 1.0
    params = [SamplingParams(top_logprobs=2), SamplingParams(top_logprobs=5)]
    out = _sampler()(logits, batch_factory(rows_factory(params, 2), V))
    assert out.top_logprob_token_ids.shape == (2, 5)
    assert out.top_logprob_token_ids[0].tolist() == [3, 9, 20, 0, 1]
    values = out.top_logprobs[0]
    assert values[0] == values[1] == values[2] and values[2] > values[3]


def test_golden_tokens_are_emitted_with_their_processed_logprob(rows_factory, batch_factory):
    logits = _logits(2, seed=2)
    low = int(logits[0].argmin())
    params = SamplingParams(golden_token_ids=[low, 1], top_k=3)
    rows = [
        SamplingRow(params, seed=1, position=4, num_generated_tokens=0),
        SamplingRow(params, seed=1, position=6, num_generated_tokens=2),  # past the golden list: sampled
    ]
    out = _sampler()(logits, SamplingBatch.build(rows, V, "cpu"))
    assert out.token_ids[0] == low and out.logprobs[0] == LOGPROB_FLOOR  # truncated by top_k
    assert out.token_ids[1] in torch.topk(logits[1], 3).indices.tolist()


def test_first_tokens_cannot_be_eos(rows_factory, batch_factory):
    logits = _logits(3, seed=3)
    logits[:, 6] = 100.0
    params = SamplingParams(temperature=0.0, first_n_token_no_eos=2, eos_id=6)
    rows = [SamplingRow(params, seed=0, position=10 + g, num_generated_tokens=g) for g in range(3)]
    out = _sampler()(logits, SamplingBatch.build(rows, V, "cpu"))
    without_eos = logits[:2].clone()
    without_eos[:, 6] = float("-inf")
    assert out.token_ids[:2].tolist() == without_eos.argmax(-1).tolist()
    assert out.token_ids[2] == 6


def test_blacklist_bitmask_and_forced_top_k(rows_factory, batch_factory):
    logits = _logits(64, seed=4)
    banned = parse_token_blacklist("0..9,15,30..31")
    allowed = torch.tensor([i % 3 == 0 for i in range(V)])
    words = torch.zeros(64, 2, dtype=torch.int64)
    for column in allowed.nonzero()[:, 0].tolist():
        words[:, column // 32] |= 1 << (column % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    batch = batch_factory(rows_factory(SamplingParams(temperature=5.0, top_logprobs=V), 64), V)
    out = Sampler(SamplerConfig(backend="reference", banned_token_ids=banned, force_top_k=4), V, "cpu")(
        logits, batch, bitmask
    )
    expected_support = allowed.clone()
    expected_support[list(banned)] = False
    for i in range(64):
        candidates = torch.where(expected_support, logits[i], float("-inf"))
        top4 = set(torch.topk(candidates, 4).indices.tolist())
        assert out.token_ids[i].item() in top4
        kept = set(out.top_logprob_token_ids[i][out.top_logprobs[i] > LOGPROB_FLOOR].tolist())
        assert kept == top4


def test_invalid_rows_are_reported_without_disturbing_others(rows_factory, batch_factory):
    logits = _logits(4, seed=5)
    logits[1] = float("-inf")
    logits[2, 3] = float("nan")
    params = [SamplingParams(), SamplingParams(top_logprobs=2), SamplingParams(), SamplingParams(golden_token_ids=[8])]
    logits[3] = float("-inf")
    out = _sampler()(logits, batch_factory(rows_factory(params, 4), V))
    assert out.status.tolist() == [0, 1, 1, 1]
    assert out.token_ids[1:].tolist() == [-1, -1, 8]
    assert (out.logprobs[1:] == LOGPROB_FLOOR).all() and (out.top_logprobs[1] == LOGPROB_FLOOR).all()
    alone = _sampler()(logits[:1], batch_factory(rows_factory(params[:1], 1), V))
    assert alone.token_ids[0] == out.token_ids[0]


def test_half_precision_logits_and_inputs_left_untouched(rows_factory, batch_factory):
    logits = _logits(5, seed=6).to(torch.bfloat16)
    before = logits.clone()
    batch = batch_factory(rows_factory(SamplingParams(repetition_penalty=1.5), 5, output_token_ids=(1, 2)), V)
    out = _sampler()(logits, batch)
    assert torch.equal(logits, before) and out.token_ids.dtype == torch.int64


def test_sum_smaller_probs_follows_its_definition(rows_factory, batch_factory):
    logits = _logits(8, seed=7)
    batch = batch_factory(rows_factory(SamplingParams(top_p=0.9), 8), V)
    sampler = _sampler(compute_sum_smaller_probs=True, batch_invariant=True)
    out = sampler(logits, batch)
    logprobs, _ = sampler.processed_logprobs(logits, batch)
    for i in range(8):
        t = int(out.token_ids[i])
        lp = logprobs[i]
        mask = (lp < lp[t]) | ((lp == lp[t]) & (torch.arange(V) <= t))
        assert out.sum_smaller_probs[i].item() == pytest.approx(float(lp[mask].exp().sum()), abs=1e-6)


def test_empty_batch(batch_factory):
    out = _sampler()(torch.empty(0, V), batch_factory([], V))
    assert out.token_ids.shape == (0,) and out.top_logprobs.shape == (0, 0)


def test_inverse_cdf_sample():
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0], [1e-12, 0.0, 0.0, 0.0]])
    bits = torch.tensor([0, 12345, 2**62])
    assert inverse_cdf_sample(weights, bits).tolist()[1:] == [-1, -1]
    many = weights[:1].expand(30_000, 4)
    draws = torch.randint(0, 2**62, (30_000,), generator=torch.Generator().manual_seed(0)) * 2
    frequencies = np.bincount(inverse_cdf_sample(many, draws).numpy(), minlength=4) / 30_000
    np.testing.assert_allclose(frequencies, [0, 1 / 3, 0, 2 / 3], atol=0.015)
    assert inverse_cdf_sample(weights[:1], torch.tensor([0])).item() == 1
    assert inverse_cdf_sample(weights[:1], torch.tensor([2**63 - 1])).item() == 3


def test_penalty_formula(rows_factory, batch_factory):
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = rows_factory(params, 1, output_token_ids=(1, 1, 2), prompt_token_ids=(3,))
    rows.insert(0, SamplingRow(SamplingParams(), seed=0, position=0))
    batch = batch_factory(rows, 5)
    logits = torch.tensor([[1.0] * 5, [1.0, 2.0, -2.0, 4.0, 3.0]])
    apply_penalties(logits, batch)
    expected = [1.0, 2.0 / 2 - 0.5 - 0.5, -2.0 * 2 - 0.5 - 0.25, 4.0 / 2, 3.0]
    assert logits[0].tolist() == [1.0] * 5
    assert logits[1].tolist() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "ids"), [("", ()), ("3", (3,)), ("0..2, 5,7..8", (0, 1, 2, 5, 7, 8)), (" 1..1 ", (1,))]
)
def test_blacklist_format(text, ids):
    assert parse_token_blacklist(text) == ids


@pytest.mark.parametrize("text", ["a", "3..1", "1,1", "5,2", "1...3", "-1", "1..2..3"])
def test_bad_blacklist_raises(text):
    with pytest.raises(ValueError, match="blacklist"):
        parse_token_blacklist(text)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"backend": "cuda"}, "backend"),
        ({"force_top_k": -1}, "force_top_k"),
        ({"banned_token_ids": (-3,)}, "banned_token_ids"),
    ],
)
def test_bad_config_raises(config, named):
    with pytest.raises(ValueError, match=named):
        SamplerConfig(**config)


def test_bad_inputs_raise(rows_factory, batch_factory):
    with pytest.raises(ValueError, match="banned_token_ids"):
        Sampler(SamplerConfig(banned_token_ids=(V,)), V, "cpu")
    batch = batch_factory(rows_factory(SamplingParams(), 2), V)
    sampler = _sampler()
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(3, V), batch)
    with pytest.raises(TypeError, match="logits"):
        sampler(torch.zeros(2, V, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="bitmask"):
        sampler(torch.zeros(2, V), batch, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="vocab"):
        sampler(torch.zeros(2, V), batch_factory(rows_factory(SamplingParams(), 2), V + 1))


@pytest.mark.parametrize(
    ("row", "named"),
    [
        (SamplingRow(SamplingParams(), seed=0, position=-1), "position"),
        (SamplingRow(SamplingParams(), seed=2**64, position=0), "seed"),
        (SamplingRow(SamplingParams(frequency_penalty=1.0), seed=0, position=0, output_token_ids=(V,)), "output"),
        (SamplingRow(SamplingParams(repetition_penalty=2.0), seed=0, position=0, prompt_token_ids=(-1,)), "prompt"),
        (SamplingRow(SamplingParams(golden_token_ids=[V]), seed=0, position=0), "golden"),
        (SamplingRow(SamplingParams(first_n_token_no_eos=1, eos_id=V), seed=0, position=0), "eos_id"),
    ],
)
def test_bad_rows_raise(row, named):
    with pytest.raises(ValueError, match=named):
        SamplingBatch.build([row], V, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_host_sync_on_gpu(cuda_device, rows_factory, backend):
    params = [SamplingParams(top_p=0.9, top_logprobs=3), SamplingParams(temperature=0.0), SamplingParams(top_k=5)]
    batch = SamplingBatch.build(rows_factory(params, 3, output_token_ids=(1,)), V, cuda_device)
    sampler = Sampler(SamplerConfig(backend=backend, compute_sum_smaller_probs=True), V, cuda_device)
    logits = _logits(3).to(cuda_device)
    sampler(logits, batch)  # warm-up: kernel compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
