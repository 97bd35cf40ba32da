"""Triton sparse attention with the key list split over programs (docs/design/kernels.md, "sparse_attention"):
against the dense re-computation for several split counts, with empty sources, all-invalid splits and sink-only
queries; in batch-invariant mode a query's output is bitwise the same alone and inside a batch whose other queries
have other key counts (the rows padded with −1 to the longest list), split or added in one program. Runs in Triton's
interpreter on CPU tensors, or on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import dense_attention, random_pool, random_rows

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.testing import assert_bitwise_equal, random_normal

F = dk.RowFormat
_FORMATS = (F.FP8, F.FP8, F.FP4_E4M3)


def _case(
    num_tokens: int, heads: int, width: int, counts: tuple[int, ...], seed: int, formats: tuple = _FORMATS
) -> tuple:
    q = random_normal((num_tokens, heads, width), seed=seed, dtype=torch.bfloat16)
    sink = random_normal((heads,), seed=seed + 1)
    sources = []
    for i, count in enumerate(counts):
        pool = random_pool(2 * count + 5, width, formats[i], seed=seed + 10 * i)
        sources.append(
            dk.KeySource(pool, random_rows(num_tokens, count, pool.shape[0], seed=seed + 10 * i + 3), formats[i])
        )
    return q, sources, sink


def _triton(device: str, q: torch.Tensor, sources: list, sink: torch.Tensor, round_probs: bool) -> torch.Tensor:
    moved = [dk.KeySource(s.pool.to(device), s.rows.to(device), s.fmt) for s in sources]
    out = torch.full(q.shape, float("nan"), device=device)
    implementation("sparse_attention", Backend.NVIDIA)(q.to(device), moved, sink.to(device), 0.125, round_probs, out)
    return out.cpu()


@pytest.mark.parametrize("round_probs", [True, False])
@pytest.mark.parametrize(
    ("block_n", "target_programs", "block_v", "one_query_per_launch", "counts"),
    [
        (16, 12, 512, False, (37, 0, 70)),
        (16, 1000, 32, True, (37, 0, 70)),
        (32, 40, 512, False, (37, 0, 70)),
        # 37 splits: the combine loads its splits 16 at a time, here two full loads and a partial one.
        (16, 1000, 512, False, (300, 9, 260)),
    ],
)
def test_split_key_lists_match_dense(
    triton_device: str,
    monkeypatch: pytest.MonkeyPatch,
    block_n: int,
    target_programs: int,
    block_v: int,
    one_query_per_launch: bool,
    counts: tuple[int, int, int],
    round_probs: bool,
) -> None:
    from deepinfer_kernels.cuda import attention

    for tiles in (attention.TILES, attention.FP32_TILES):
        monkeypatch.setitem(tiles, "block_n", block_n)
        monkeypatch.setitem(tiles, "block_v", block_v)  # 32: two value sweeps of one FP8 scale group each
    monkeypatch.setattr(attention, "SPLIT_TARGET_PROGRAMS", target_programs)
    if one_query_per_launch:
        monkeypatch.setattr(attention, "SPLIT_WORKSPACE_BYTES", 1)
    q, sources, sink = _case(4, 3, 64, counts, seed=block_n + target_programs)
    sources[2].rows[0, 30:] = -1  # query 0: the later splits of the selected rows hold no valid key
    for source in sources:
        source.rows[1] = -1  # query 1: the sink only
    sources[0].rows[2] = -1  # query 2: no window key
    chunk_keys, splits = attention._split_plan(4, list(counts), block_n, torch.device(triton_device))
    assert sum(splits) > 1 and chunk_keys % block_n == 0  # the split path runs
    actual = _triton(triton_device, q, sources, sink, round_probs)
    expected = dense_attention(q, sources, sink, 0.125, round_probs)
    # Summation order only; with BF16 probabilities a last-bit FP32 difference may pick the other BF16 neighbour.
    rtol = 2.0**-8 if round_probs else 1e-5
    assert ((actual - expected).abs() <= rtol * float(expected.abs().max()) + 1e-6).all()
    assert torch.equal(actual[1], torch.zeros(3, 64))


def test_split_plan_splits_only_programs_that_leave_half_the_target_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_kernels.cuda import attention

    monkeypatch.setattr(attention, "SPLIT_TARGET_PROGRAMS", 264)
    widths, cpu = [128, 1, 512], torch.device("cpu")  # 41 tiles of 16 keys
    assert attention._split_plan(200, widths, 16, cpu) == (656, [])  # 200 programs fill the device: no split
    chunk_keys, counts = attention._split_plan(132, widths, 16, cpu)
    assert chunk_keys == 21 * 16 and counts == [1, 1, 2]  # two chunks of the key list (the last source's two)
    chunk_keys, counts = attention._split_plan(64, widths, 16, cpu)
    assert chunk_keys == 9 * 16 and counts == [1, 1, 4]  # five chunks of nine tiles
    assert attention._split_plan(1, widths, 16, cpu) == (16, [8, 1, 32])  # one tile a split
    # Pass 1 of a split: 32-key tiles over chunks of at least 32 keys, the 16-key tile over shorter ones.
    assert [attention._chunk_logits_tile(attention.TILES, keys) for keys in (16, 31, 32, 144)] == [16, 16, 32, 32]


# FP32 rows in the third source: the tiles must not change with whether a query has such keys (query 3 alone has none).
# Target programs: 1, every launch runs chunks_kernel; 8, a query alone splits and the batch of six runs chunks_kernel;
# 1000, every launch splits.
@pytest.mark.parametrize("formats", [_FORMATS, (F.FP8, F.FP8, F.RAW_FP32)])
@pytest.mark.parametrize("target_programs", [1, 8, 1000])
def test_invariant_mode_gives_a_query_the_same_bits_alone_and_in_a_batch(
    triton_device: str, monkeypatch: pytest.MonkeyPatch, target_programs: int | None, formats: tuple
) -> None:
    from deepinfer_kernels.cuda import attention

    # Small chunks of two tiles, so that short lists already split and chunks hold more than one tile.
    for tiles in (attention.TILES, attention.FP32_TILES):
        monkeypatch.setitem(tiles, "block_n", 16)
    monkeypatch.setattr(attention, "SPLIT_TARGET_PROGRAMS", target_programs)
    monkeypatch.setattr(attention, "INVARIANT_CHUNK_KEYS", 32)
    num_tokens, widths = 6, (50, 9, 120)
    q, sources, sink = _case(num_tokens, 2, 64, widths, seed=31, formats=formats)
    lengths = torch.tensor([[50, 3, 70], [20, 9, 120], [1, 0, 33], [50, 9, 0], [7, 1, 119], [0, 0, 0]])
    for i, source in enumerate(sources):
        source.rows[torch.arange(widths[i])[None, :] >= lengths[:, i : i + 1]] = -1
    expected = dense_attention(q, sources, sink, 0.125, True)
    with batch_invariant_ops():
        splits = {
            count: attention._split_plan(count, list(widths), 16, torch.device(triton_device))[1] for count in (1, 6)
        }
        assert [bool(splits[1]), bool(splits[6])] == {1: [False, False], 8: [True, False], 1000: [True, True]}[
            target_programs
        ]
        together = _triton(triton_device, q, sources, sink, True)
        for t in range(num_tokens):
            own = [dk.KeySource(s.pool, s.rows[t : t + 1, : int(lengths[t, i])], s.fmt) for i, s in enumerate(sources)]
            alone = _triton(triton_device, q[t : t + 1], own, sink, True)
            assert_bitwise_equal(alone[0], together[t])
    assert ((together - expected).abs() <= 2.0**-8 * float(expected.abs().max()) + 1e-6).all()
