"""Shared fixtures for deepinfer-sampling tests: an independent float64 oracle of the processed distribution and
builders for batches of rows with distinct seeds.

Without a CUDA device the Triton kernels run in Triton's interpreter on CPU tensors; TRITON_INTERPRET must be set
before Triton decorates the kernels, so it is set here, at collection time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer_sampling import SamplingBatch, SamplingParams, SamplingRow, request_seed


def oracle_distribution(
    logits: Sequence[float],
    params: SamplingParams,
    output_token_ids: Sequence[int] = (),
    prompt_token_ids: Sequence[int] = (),
) -> np.ndarray:
    """The intended processed distribution of one row, in float64, written from the definitions (not the code).

    Penalties on logits, then temperature, then the top-k / top-p / min-p prefixes of the (logit desc, id asc)
    order measured on the temperature-scaled distribution, then renormalisation. Greedy → one-hot argmax.
    """
    z = np.asarray(logits, dtype=np.float64).copy()
    vocab = z.shape[0]
    counts = np.bincount(np.asarray(output_token_ids, dtype=np.int64), minlength=vocab).astype(np.float64)
    seen = counts > 0
    seen[list(prompt_token_ids)] = True
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    z = z - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    finite = np.isfinite(z)
    if params.is_greedy:
        out = np.zeros(vocab)
        out[int(np.argmax(z))] = 1.0
        return out
    s = (z - z[finite].max()) / params.temperature
    p = np.where(finite, np.exp(s), 0.0)
    p /= p.sum()
    order = sorted(range(vocab), key=lambda i: (-z[i] if finite[i] else math.inf, i))
    keep = np.zeros(vocab, dtype=bool)
    above = 0.0
    for rank, i in enumerate(order):
        in_k = params.top_k == -1 or rank < params.top_k
        in_p = params.top_p >= 1.0 or above <= params.top_p
        in_min = p[i] >= params.min_p * p.max()
        keep[i] = finite[i] and in_k and in_p and in_min
        above += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.fixture
def oracle() -> Callable[..., np.ndarray]:
    return oracle_distribution


def make_rows(
    params: SamplingParams | Sequence[SamplingParams],
    num_rows: int,
    *,
    seq_seed: int = 1234,
    position: int = 7,
    output_token_ids: Sequence[int] = (),
    prompt_token_ids: Sequence[int] = (),
) -> list[SamplingRow]:
    """`num_rows` rows with distinct request seeds derived from `seq_seed` (index_in_call = row index)."""
    per_row = [params] * num_rows if isinstance(params, SamplingParams) else list(params)
    return [
        SamplingRow(
            params=p,
            seed=request_seed(seq_seed, index_in_call=i, engine_seed=0, request_counter=0),
            position=position,
            num_generated_tokens=len(output_token_ids),
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
        )
        for i, p in enumerate(per_row)
    ]


def make_batch(rows: Sequence[SamplingRow], vocab_size: int, device: str = "cpu") -> SamplingBatch:
    return SamplingBatch.build(rows, vocab_size, device)


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture
def rows_factory() -> Callable[..., list[SamplingRow]]:
    return make_rows


@pytest.fixture
def batch_factory() -> Callable[..., SamplingBatch]:
    return make_batch
