"""sparse_attention (public op) against a dense re-computation: odd sizes, masked keys, empty batches, chunking."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import dense_attention, random_pool, random_rows

import deepinfer_kernels as dk
from deepinfer_kernels.reference import attention as reference_attention
from deepinfer_kernels.testing import assert_close, random_normal

F = dk.RowFormat


def _case(num_tokens: int, heads: int, width: int, counts: tuple[int, int, int], seed: int) -> tuple:
    q = random_normal((num_tokens, heads, width), seed=seed, dtype=torch.bfloat16)
    sink = random_normal((heads,), seed=seed + 1)
    sources = []
    for i, (count, fmt) in enumerate(zip(counts, (F.FP8, F.FP8, F.FP4_E4M3), strict=True)):
        pool = random_pool(2 * count + 5, width, fmt, seed=seed + 10 * i)
        sources.append(dk.KeySource(pool, random_rows(num_tokens, count, pool.shape[0], seed=seed + 10 * i + 3), fmt))
    return q, sources, sink


@pytest.mark.parametrize("round_probs", [False, True])
@pytest.mark.parametrize(("num_tokens", "heads", "width", "counts"), [(7, 3, 64, (5, 3, 11)), (1, 4, 32, (1, 0, 2))])
def test_matches_dense(
    num_tokens: int, heads: int, width: int, counts: tuple[int, int, int], round_probs: bool
) -> None:
    q, sources, sink = _case(num_tokens, heads, width, counts, seed=1)
    out = dk.sparse_attention(q, sources, sink, width**-0.5, round_probs)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, heads, width)
    # No vendor kernel runs here, so the unwidened output is the FP32 one.
    assert torch.equal(dk.sparse_attention(q, sources, sink, width**-0.5, round_probs, widen=False), out)
    # BF16 rounding of a probability is relative 2^-9 on each term; the sum's error stays below that.
    rtol = 2.0**-8 if round_probs else 1e-5
    assert_close(out, dense_attention(q, sources, sink, width**-0.5, round_probs), rtol=rtol, atol=1e-5)


def test_query_without_keys_gets_zeros_and_sink_only_softmax() -> None:
    q, sources, sink = _case(4, 2, 32, (3, 2, 4), seed=2)
    for source in sources:
        source.rows[1] = -1
    out = dk.sparse_attention(q, sources, sink, 0.1, True)
    assert torch.equal(out[1], torch.zeros(2, 32))
    assert out[0].abs().sum() > 0


def test_empty_batch_and_no_sources() -> None:
    q, sources, sink = _case(0, 2, 32, (3, 2, 4), seed=3)
    assert dk.sparse_attention(q, sources, sink, 0.1, False).shape == (0, 2, 32)
    q = random_normal((3, 2, 32), seed=4)
    assert torch.equal(dk.sparse_attention(q, [], sink, 0.1, False), torch.zeros(3, 2, 32))


def test_an_empty_pool_with_no_keys_is_accepted() -> None:
    q, sources, sink = _case(3, 2, 32, (4, 1, 2), seed=8)
    empty = dk.KeySource(torch.zeros(0, 33, dtype=torch.uint8), torch.full((3, 2), -1), F.FP8)
    assert_close(
        dk.sparse_attention(q, [*sources, empty], sink, 0.2, True),
        dk.sparse_attention(q, sources, sink, 0.2, True),
        rtol=1e-6,
        atol=1e-6,
    )


def test_query_chunks_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    q, sources, sink = _case(9, 3, 64, (6, 2, 5), seed=5)
    whole = dk.sparse_attention(q, sources, sink, 0.125, True)
    monkeypatch.setattr(reference_attention, "WORKSPACE_BYTES", 1)
    assert_close(dk.sparse_attention(q, sources, sink, 0.125, True), whole, rtol=1e-6, atol=1e-7)


def test_paged_pools_are_accepted() -> None:
    q, sources, sink = _case(3, 2, 32, (4, 1, 2), seed=6)
    pool = sources[0].pool
    paged = pool[: pool.shape[0] // 3 * 3].reshape(-1, 3, pool.shape[1])
    rows = sources[0].rows.clamp(max=paged.shape[0] * 3 - 1)
    flat = [dk.KeySource(pool, rows, F.FP8)]
    assert_close(
        dk.sparse_attention(q, [dk.KeySource(paged, rows, F.FP8)], sink, 0.2, False),
        dk.sparse_attention(q, flat, sink, 0.2, False),
        rtol=0,
        atol=0,
    )


def test_bad_arguments_are_refused() -> None:
    q, sources, sink = _case(3, 2, 32, (2, 1, 2), seed=7)
    with pytest.raises(ValueError, match="head dim 64"):
        dk.sparse_attention(random_normal((3, 2, 64), seed=1), sources, sink, 0.1, False)
    with pytest.raises(ValueError, match=r"rows must be \[T=3, N\]"):
        bad = dk.KeySource(sources[0].pool, sources[0].rows[:2], F.FP8)
        dk.sparse_attention(q, [bad], sink, 0.1, False)
    with pytest.raises(ValueError, match=r"sink must be \[H=2\]"):
        dk.sparse_attention(q, sources, sink[:1], 0.1, False)
    with pytest.raises(TypeError, match="KeySource"):
        dk.sparse_attention(q, [(sources[0].pool, sources[0].rows, F.FP8)], sink, 0.1, False)  # type: ignore[list-item]
