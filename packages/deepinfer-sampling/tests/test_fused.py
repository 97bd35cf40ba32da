"""Fused Triton sampler vs the PyTorch reference on the same pre-processed logits and the same random draws.

Runs on CUDA when present, else on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1), with
small vocabularies and small blocks so rows span several blocks. Tokens must be identical; log-probs agree within
2e-6 absolute (float32 rounding of exp/log differs between backends), and −inf positions must match exactly.
Logits are rounded to a coarse grid so ties sit at top-k / top-p cut-offs and exercise the lowest-id rule.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_sampling import RandomStream, Sampler, SamplerConfig, SamplingParams, random_bits
from deepinfer_sampling.fused.triton_sampler import fused_sample
from deepinfer_sampling.masking import preprocess_logits
from deepinfer_sampling.reference import sample as reference_sample

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=1.7, top_p=0.9, top_k=40),
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0.3, min_p=0.2, top_p=0.95, top_k=3),
    SamplingParams(top_k=1),
    SamplingParams(golden_token_ids=[4], top_k=2),
    SamplingParams(temperature=0.0, golden_token_ids=[9]),
]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(rows_factory, batch_factory, vocab: int, num_rows: int, seed: int, tie_grid: float):
    device = _device()
    params = [PARAMS[i % len(PARAMS)] for i in range(num_rows)]
    batch = batch_factory(rows_factory(params, num_rows, seq_seed=seed), vocab, str(device))
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0
    if tie_grid > 0:
        logits = torch.round(logits / tie_grid) * tie_grid
    logits[0, : vocab // 3] = float("-inf")  # a partly masked row
    z, _ = preprocess_logits(logits.to(device), batch, None, None, 0)
    bits = random_bits(batch.seeds, batch.positions, RandomStream.SAMPLE, 1)[:, 0]
    return z, batch, bits


@pytest.mark.parametrize(
    ("vocab", "max_block", "tie_grid"),
    [(37, 64, 0.0), (64, 16, 0.5), (150, 64, 1.0)],
    ids=["single-block", "ties-4-blocks", "coarse-ties-3-blocks"],
)
def test_fused_matches_reference(rows_factory, batch_factory, vocab, max_block, tie_grid):
    z, batch, bits = _inputs(rows_factory, batch_factory, vocab, len(PARAMS), seed=vocab + max_block, tie_grid=tie_grid)
    want_tokens, want_logprobs = reference_sample(z, batch, bits, exact_sums=True)
    forced = batch.forced_token_ids
    want_tokens = torch.where(forced >= 0, forced, want_tokens)
    tokens, token_logprobs, logprobs = fused_sample(z, batch, True, max_block=max_block)
    assert torch.equal(tokens, want_tokens)
    assert logprobs is not None
    assert torch.equal(torch.isinf(logprobs), torch.isinf(want_logprobs))
    finite = torch.isfinite(want_logprobs)
    torch.testing.assert_close(logprobs[finite], want_logprobs[finite], rtol=0, atol=2e-6)
    want_token_logprobs = want_logprobs.gather(1, want_tokens[:, None])[:, 0]
    torch.testing.assert_close(token_logprobs, want_token_logprobs, rtol=0, atol=2e-6)


def test_fused_without_logprobs_gives_the_same_tokens(rows_factory, batch_factory):
    z, batch, _ = _inputs(rows_factory, batch_factory, 40, 5, seed=5, tie_grid=0.25)
    with_lp = fused_sample(z, batch, True, max_block=16)
    without = fused_sample(z, batch, False, max_block=16)
    assert without[2] is None
    assert torch.equal(with_lp[0], without[0]) and torch.equal(with_lp[1], without[1])


def test_sampler_backends_agree_end_to_end(rows_factory, batch_factory):
    vocab = 45
    device = _device()
    params = [dataclasses.replace(p, top_logprobs=4) for p in PARAMS]
    batch = batch_factory(rows_factory(params, len(params), output_token_ids=(1, 2)), vocab, str(device))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(8)).to(device)
    logits[3] = float("-inf")
    config = {"banned_token_ids": (0, 7), "force_top_k": 30, "compute_sum_smaller_probs": True}
    ref = Sampler(SamplerConfig(backend="reference", batch_invariant=True, **config), vocab, device)(logits, batch)
    fused = Sampler(SamplerConfig(backend="triton", **config), vocab, device)(logits, batch)
    assert torch.equal(fused.token_ids, ref.token_ids) and torch.equal(fused.status, ref.status)
    assert torch.equal(fused.top_logprob_token_ids, ref.top_logprob_token_ids)
    torch.testing.assert_close(fused.logprobs, ref.logprobs, rtol=0, atol=2e-6)
    torch.testing.assert_close(fused.top_logprobs, ref.top_logprobs, rtol=0, atol=2e-6)
    assert fused.sum_smaller_probs is not None and ref.sum_smaller_probs is not None
    torch.testing.assert_close(fused.sum_smaller_probs, ref.sum_smaller_probs, rtol=0, atol=1e-5)


def test_fused_rejects_tensors_it_cannot_use(rows_factory, batch_factory):
    z, batch, _ = _inputs(rows_factory, batch_factory, 16, 2, seed=1, tie_grid=0.0)
    with pytest.raises(ValueError, match="float32"):
        fused_sample(z.double(), batch, False)
