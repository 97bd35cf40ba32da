"""Batch invariance: a row's outputs are bit-identical whatever the batch size, row position and neighbours.

Rows carry their own request seed (same seq_seed, distinct index_in_call) and parameters; each sub-batch (sizes
1 … 64, permuted, with unrelated neighbours mixed in) must reproduce the rows' outputs from the full batch exactly:
tokens, token log-probs, top log-probs and sum_smaller_probs, compared bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_sampling import Sampler, SamplerConfig, SamplerOutput, SamplingBatch, SamplingParams, SamplingRow

PARAMS = [
    SamplingParams(top_logprobs=3),
    SamplingParams(temperature=0.0, top_logprobs=2),
    SamplingParams(temperature=0.8, top_k=6, top_logprobs=3),
    SamplingParams(top_p=0.85, top_logprobs=1),
    SamplingParams(temperature=1.3, min_p=0.05, top_p=0.95, top_k=20),
    SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2, top_logprobs=2),
]


def _rows(rows_factory, num_rows: int, seq_seed: int) -> list[SamplingRow]:
    params = [PARAMS[i % len(PARAMS)] for i in range(num_rows)]
    rows = rows_factory(params, num_rows, seq_seed=seq_seed, output_token_ids=(3, 3, 8), prompt_token_ids=(1,))
    return [dataclasses.replace(r, position=100 + 7 * i) for i, r in enumerate(rows)]


def _assert_rows_equal(sub: SamplerOutput, full: SamplerOutput, index: torch.Tensor) -> None:
    assert torch.equal(sub.token_ids, full.token_ids[index])
    assert torch.equal(sub.logprobs, full.logprobs[index])
    assert torch.equal(sub.status, full.status[index])
    n = sub.top_logprobs.shape[1]
    assert torch.equal(sub.top_logprob_token_ids, full.top_logprob_token_ids[index, :n])
    assert torch.equal(sub.top_logprobs, full.top_logprobs[index, :n])
    assert sub.sum_smaller_probs is not None and full.sum_smaller_probs is not None
    assert torch.equal(sub.sum_smaller_probs, full.sum_smaller_probs[index])


def _check(sampler: Sampler, rows, logits, sizes, device, rows_factory):
    vocab = logits.shape[1]
    full = sampler(logits, SamplingBatch.build(rows, vocab, device))
    strangers = _rows(rows_factory, 64, seq_seed=777)
    stranger_logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(99)).to(device)
    gen = torch.Generator().manual_seed(5)
    for size in sizes:
        index = torch.randperm(len(rows), generator=gen)[:size]
        sub = sampler(logits[index.to(device)], SamplingBatch.build([rows[i] for i in index], vocab, device))
        _assert_rows_equal(sub, full, index.to(device))
        # The same rows between unrelated neighbours.
        mixed_rows = [strangers[0], *(rows[i] for i in index), *strangers[1 : 1 + size % 5]]
        mixed_logits = torch.cat([stranger_logits[:1], logits[index.to(device)], stranger_logits[1 : 1 + size % 5]])
        mixed = sampler(mixed_logits, SamplingBatch.build(mixed_rows, vocab, device))
        inner = torch.arange(1, 1 + size, device=device)
        sliced = SamplerOutput(
            token_ids=mixed.token_ids[inner],
            logprobs=mixed.logprobs[inner],
            top_logprob_token_ids=mixed.top_logprob_token_ids[inner],
            top_logprobs=mixed.top_logprobs[inner],
            status=mixed.status[inner],
            sum_smaller_probs=None if mixed.sum_smaller_probs is None else mixed.sum_smaller_probs[inner],
        )
        _assert_rows_equal(sliced, full, index.to(device))


def test_reference_is_batch_invariant(rows_factory):
    vocab = 96
    rows = _rows(rows_factory, 64, seq_seed=2024)
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)) * 2
    config = SamplerConfig(backend="reference", batch_invariant=True, compute_sum_smaller_probs=True)
    _check(Sampler(config, vocab, "cpu"), rows, logits, [1, 2, 3, 5, 8, 13, 21, 34, 55, 64], "cpu", rows_factory)


def test_fused_is_batch_invariant(rows_factory):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = 40
    rows = _rows(rows_factory, 8, seq_seed=2025)
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(2)) * 2).to(device)
    config = SamplerConfig(backend="triton", compute_sum_smaller_probs=True)
    _check(Sampler(config, vocab, device), rows, logits, [1, 3, 8], device, rows_factory)


@pytest.mark.gpu
def test_fused_is_batch_invariant_at_full_vocabulary(cuda_device, rows_factory):
    vocab = 129280
    rows = _rows(rows_factory, 64, seq_seed=7)
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(3)).to(cuda_device) * 3
    config = SamplerConfig(backend="triton", compute_sum_smaller_probs=True)
    _check(Sampler(config, vocab, cuda_device), rows, logits, [1, 2, 7, 31, 64], cuda_device, rows_factory)


@pytest.mark.gpu
def test_reference_is_batch_invariant_on_gpu(cuda_device, rows_factory):
    vocab = 4099
    rows = _rows(rows_factory, 64, seq_seed=8)
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(4)).to(cuda_device) * 3
    config = SamplerConfig(backend="reference", batch_invariant=True, compute_sum_smaller_probs=True)
    _check(Sampler(config, vocab, cuda_device), rows, logits, [1, 2, 7, 31, 64], cuda_device, rows_factory)
