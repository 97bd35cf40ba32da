"""Monte Carlo acceptance: sampled frequencies match the intended distribution (chi-square, fixed seeds).

Each test samples one logits row N times in a single batch of N rows with distinct request seeds, and compares the
token counts with an independent float64 oracle (`conftest.oracle_distribution`). Tokens the oracle gives probability
0 must never appear. With fixed seeds the outcome is deterministic; the p-value floor (1e-3) guards against an
unlucky seed choice, not against flakiness.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from deepinfer_sampling import Sampler, SamplerConfig, SamplingParams

VOCAB = 24
NUM_SAMPLES = 20_000


def _logits(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=gen) * 1.5


def _check(rows_factory, batch_factory, oracle, params, *, output=(), prompt=(), logits=None, seq_seed=99):
    row = _logits() if logits is None else logits
    rows = rows_factory(params, NUM_SAMPLES, seq_seed=seq_seed, output_token_ids=output, prompt_token_ids=prompt)
    batch = batch_factory(rows, VOCAB)
    sampler = Sampler(SamplerConfig(backend="reference"), VOCAB, "cpu")
    tokens = sampler(row.expand(NUM_SAMPLES, VOCAB), batch).token_ids
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    expected = oracle(row.tolist(), params, output, prompt)
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled tokens outside the support: {np.nonzero(counts * ~support)}"
    if support.sum() > 1:
        result = scipy.stats.chisquare(counts[support], expected[support] * NUM_SAMPLES)
        assert result.pvalue > 1e-3, (result, counts, expected * NUM_SAMPLES)
    return expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(rows_factory, batch_factory, oracle, temperature):
    _check(rows_factory, batch_factory, oracle, SamplingParams(temperature=temperature))


@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_top_k(rows_factory, batch_factory, oracle, top_k):
    expected = _check(rows_factory, batch_factory, oracle, SamplingParams(top_k=top_k, temperature=1.3))
    assert (expected > 0).sum() == top_k


@pytest.mark.parametrize("top_p", [0.6, 0.8, 0.95])
def test_top_p(rows_factory, batch_factory, oracle, top_p):
    expected = _check(rows_factory, batch_factory, oracle, SamplingParams(top_p=top_p))
    assert 1 < (expected > 0).sum() < VOCAB


@pytest.mark.parametrize("min_p", [0.05, 0.3])
def test_min_p(rows_factory, batch_factory, oracle, min_p):
    expected = _check(rows_factory, batch_factory, oracle, SamplingParams(min_p=min_p, temperature=0.8))
    assert 1 < (expected > 0).sum() < VOCAB


def test_joint_truncation(rows_factory, batch_factory, oracle):
    params = SamplingParams(top_k=6, top_p=0.9, min_p=0.02, temperature=0.9)
    _check(rows_factory, batch_factory, oracle, params)


OUTPUT = (2, 2, 5, 7, 7, 7, 11)
PROMPT = (0, 3, 5, 13)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.6),
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=1.3, top_k=12),
    ],
    ids=["repetition", "repetition<1", "presence", "frequency", "combined"],
)
def test_penalties(rows_factory, batch_factory, oracle, params):
    unpenalised = oracle(_logits().tolist(), SamplingParams(), (), ())
    expected = _check(rows_factory, batch_factory, oracle, params, output=OUTPUT, prompt=PROMPT)
    assert np.abs(expected - unpenalised).max() > 0.01  # the penalty really changes the target


def test_greedy_is_the_lowest_argmax(rows_factory, batch_factory, oracle):
    logits = _logits()
    logits[[4, 9]] = logits.max() + 1.0  # a tie: the lower id wins
    expected = _check(rows_factory, batch_factory, oracle, SamplingParams(temperature=0.0), logits=logits)
    assert expected[4] == 1.0
