"""Triton sparse attention's non-split path (prefill, docs/design/kernels.md, "sparse_attention") at its tiles: a
64-head block (the one of ``TILES``) against the dense re-computation, with several head blocks, value sweeps narrower
than the width and launches of a few queries each (a small logits workspace), on masked keys, sink-only queries and
an empty source. Runs in Triton's interpreter on CPU tensors, or on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import dense_attention, random_pool, random_rows

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import random_normal

F = dk.RowFormat
_FORMATS = (F.FP8, F.FP8, F.FP4_E4M3)
_TILES = [
    # TILES: every head of a 64-head query in one program, the whole width in one sweep, 32-key logits tiles.
    ({"block_h": 64, "block_n": 16, "logits_block_n": 32, "block_v": 512, "num_warps": 8, "num_stages": 1}, None),
    # Two value sweeps of 32 columns (a whole FP8 scale group each), two queries per launch.
    ({"block_h": 64, "block_n": 16, "logits_block_n": 16, "block_v": 32, "num_warps": 8, "num_stages": 1}, 2),
    # Five head blocks of 16, one query per launch; logits tiles narrower than the sums' tiles.
    ({"block_h": 16, "block_n": 32, "logits_block_n": 16, "block_v": 32, "num_warps": 4, "num_stages": 1}, 1),
]


@pytest.mark.parametrize("round_probs", [True, False])
@pytest.mark.parametrize(("tiles", "queries_per_launch"), _TILES)
def test_prefill_tiles_match_dense(
    triton_device: str,
    monkeypatch: pytest.MonkeyPatch,
    tiles: dict[str, int],
    queries_per_launch: int | None,
    round_probs: bool,
) -> None:
    from deepinfer_kernels.cuda import attention

    # The tile applies whether the device takes BF16 or FP32 dots (Triton's interpreter takes FP32 dots).
    monkeypatch.setattr(attention, "TILES", tiles)
    monkeypatch.setattr(attention, "FP32_TILES", tiles)
    monkeypatch.setattr(attention, "SPLIT_TARGET_PROGRAMS", 1)  # no split, however many multiprocessors
    num_tokens, heads, width, counts = 5, 70, 64, (37, 0, 50)
    if queries_per_launch is not None:
        rows_per_query = -(-heads // tiles["block_h"]) * tiles["block_h"]
        monkeypatch.setattr(attention, "PREFILL_WORKSPACE_BYTES", queries_per_launch * rows_per_query * sum(counts) * 4)
    q = random_normal((num_tokens, heads, width), seed=41, dtype=torch.bfloat16)
    sink = random_normal((heads,), seed=42)
    sources = []
    for i, count in enumerate(counts):
        pool = random_pool(2 * count + 5, width, _FORMATS[i], seed=43 + 10 * i)
        rows = random_rows(num_tokens, count, pool.shape[0], seed=44 + 10 * i)
        sources.append(dk.KeySource(pool.to(triton_device), rows.to(triton_device), _FORMATS[i]))
    for source in sources:
        source.rows[1] = -1  # query 1: the sink only
    sources[2].rows[3, 20:] = -1  # query 3: the later tiles of the selected rows hold no valid key
    head_blocks = -(-heads // tiles["block_h"])
    _, splits = attention._split_plan(
        num_tokens * head_blocks, list(counts), tiles["block_n"], torch.device(triton_device)
    )
    assert not splits  # the non-split path runs
    out = torch.full(q.shape, float("nan"), device=triton_device)
    implementation("sparse_attention", Backend.NVIDIA)(
        q.to(triton_device), sources, sink.to(triton_device), width**-0.5, round_probs, out
    )
    moved = [dk.KeySource(s.pool.cpu(), s.rows.cpu(), s.fmt) for s in sources]
    expected = dense_attention(q, moved, sink, width**-0.5, round_probs)
    # Summation order only; with BF16 probabilities a last-bit FP32 difference may pick the other BF16 neighbour.
    rtol = 2.0**-8 if round_probs else 1e-5
    assert ((out.cpu() - expected).abs() <= rtol * float(expected.abs().max()) + 1e-6).all()
    assert torch.equal(out[1].cpu(), torch.zeros(heads, width))
