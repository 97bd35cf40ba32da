"""Cache ops compiled for a real CUDA device at V4.1-Flash widths (skipped without one): Triton against the reference
on fresh random inputs, odd sizes and empty batches, and a decode-step selection captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import assert_equivalent_selection, random_pool, random_rows
from _gpu_marks import COMPILED_TRITON_ON_GPU

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_bitwise_equal, random_normal, seeded_generator

pytestmark = COMPILED_TRITON_ON_GPU

F = dk.RowFormat


@pytest.mark.parametrize(("fmt", "width"), [(F.FP8, 512), (F.FP4_E4M3, 512), (F.FP4_UE8M0, 128), (F.RAW_FP32, 1024)])
def test_store_rows_gpu_bit_exact(fmt: dk.RowFormat, width: int) -> None:
    pool = random_pool(3001, width, fmt, seed=1, device="cuda")
    # Drawn on the host from a seeded generator: the device generator may carry the offset of an earlier test's
    # graph capture.
    rows = torch.randperm(3001, generator=seeded_generator(3))[:1237].cuda()
    rows[::7] = -1
    values = random_normal((1237, width), seed=2, dtype=torch.bfloat16, std=3.0, device="cuda")
    expected = pool.clone()
    implementation("store_rows", Backend.REFERENCE)(expected, rows, values, fmt)
    dk.store_rows(pool, rows, values, fmt)
    assert_bitwise_equal(pool, expected)
    assert_bitwise_equal(dk.decode_rows(pool, fmt).cpu(), dk.decode_rows(expected.cpu(), fmt))


@pytest.mark.parametrize(("fmt", "width"), [(F.FP8, 512), (F.FP4_E4M3, 512), (F.FP4_UE8M0, 128), (F.RAW_FP32, 96)])
def test_decode_rows_gpu_every_byte(fmt: dk.RowFormat, width: int) -> None:
    # Random bytes reach every code and scale byte, the NaN codes and the extreme scales included (rows the encoder
    # never writes): the compiled decoding (hardware e4m3 conversion, PTX e2m1) must give the reference's values.
    nbytes = dk.bytes_per_row(fmt, width)
    rows = torch.randint(0, 256, (777, nbytes), dtype=torch.uint8, generator=seeded_generator(5))
    got = dk.decode_rows(rows.cuda(), fmt).cpu()
    expected = dk.decode_rows(rows, fmt)
    assert torch.equal(got.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert_bitwise_equal(got[numbers], expected[numbers])


def _flash_sources(num_tokens: int, seed: int) -> list[dk.KeySource]:
    ring = random_pool(4096, 512, F.FP8, seed=seed, device="cuda")
    fresh = random_pool(max(num_tokens, 1), 512, F.FP8, seed=seed + 1, device="cuda")
    compressed = random_pool(20000, 512, F.FP4_E4M3, seed=seed + 2, device="cuda")
    return [
        dk.KeySource(ring, random_rows(num_tokens, 127, 4096, seed=seed + 3).cuda(), F.FP8),
        dk.KeySource(fresh, random_rows(num_tokens, 3, num_tokens, seed=seed + 4, missing=0.5).cuda(), F.FP8),
        dk.KeySource(compressed, random_rows(num_tokens, 512, 20000, seed=seed + 5, missing=0.1).cuda(), F.FP4_E4M3),
    ]


@pytest.mark.parametrize("num_tokens", [1, 37, 0])
@pytest.mark.parametrize("round_probs", [True, False])
def test_sparse_attention_gpu(num_tokens: int, round_probs: bool) -> None:
    q = random_normal((num_tokens, 64, 512), seed=7, dtype=torch.bfloat16, device="cuda")
    sink = random_normal((64,), seed=8, device="cuda")
    sources = _flash_sources(num_tokens, seed=9)
    if num_tokens > 1:
        for source in sources:
            source.rows[1] = -1
    out = dk.sparse_attention(q, sources, sink, 512**-0.5, round_probs)
    expected = torch.empty_like(out)
    implementation("sparse_attention", Backend.REFERENCE)(q, sources, sink, 512**-0.5, round_probs, expected)
    assert out.shape == (num_tokens, 64, 512)
    if num_tokens:
        # Exact mode: a probability whose FP32 value differs from the reference's in the last bits may round to the
        # other BF16 neighbour (relative 2^-8 on that term).
        rtol = 2.0**-8 if round_probs else 1e-5
        err = (out - expected).abs().max() / expected.abs().max()
        assert float(err) <= rtol, float(err)
        if num_tokens > 1:
            assert torch.equal(out[1], torch.zeros_like(out[1]))


def _index_case(num_tokens: int, max_rows: int, seed: int) -> dict:
    per_block = 64
    blocks = -(-max_rows // per_block)
    num_requests = 3
    pool = random_pool(num_requests * blocks * per_block, 128, F.FP4_UE8M0, seed=seed, device="cuda")
    fp4 = F.FP4_UE8M0
    q = dk.decode_rows(dk.encode_rows(random_normal((num_tokens, 32, 128), seed=seed + 1, device="cuda"), fp4), fp4)
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": q,
        "weights": random_normal((num_tokens, 32), seed=seed + 2, device="cuda"),
        "key_pool": pool,
        "block_table": torch.randperm(num_requests * blocks, generator=gen).view(num_requests, blocks).cuda(),
        "rows_per_block": per_block,
        "token_request": torch.randint(0, num_requests, (num_tokens,), generator=gen).cuda(),
        "num_rows": torch.randint(0, max_rows + 1, (num_tokens,), generator=gen).cuda(),
        "max_rows": max_rows,
    }


def _dense_logits(case: dict) -> torch.Tensor:
    rows = torch.arange(case["max_rows"], device="cuda")
    per_block = case["rows_per_block"]
    flat = case["block_table"][case["token_request"]][:, rows // per_block] * per_block + rows % per_block
    keys = dk.decode_rows(case["key_pool"][flat], F.FP4_UE8M0)
    scores = torch.relu(torch.einsum("thd,tbd->thb", case["q"], keys))
    return torch.einsum("th,thb->tb", case["weights"], scores).to(torch.bfloat16).float()


def _select(case: dict, backend: Backend, topk: int, **kwargs: object) -> tuple:
    num_tokens = case["q"].shape[0]
    nb = int(kwargs.get("num_candidate_blocks", 0))
    rows = torch.full((num_tokens, topk), -7, dtype=torch.int64, device="cuda")
    blocks = torch.full((num_tokens, nb), -7, dtype=torch.int64, device="cuda") if nb else None
    implementation("indexer_select", backend)(
        case["q"], case["weights"], case["key_pool"], F.FP4_UE8M0, case["block_table"], case["rows_per_block"],
        case["token_request"], case["num_rows"], case["max_rows"], topk, True, kwargs.get("candidates"),
        int(kwargs.get("candidate_block_size", 0)), nb, rows, blocks,
    )  # fmt: skip
    return rows, blocks


@pytest.mark.parametrize(("num_tokens", "max_rows"), [(19, 5001), (3, 70000), (0, 100)])
def test_indexer_select_gpu(num_tokens: int, max_rows: int) -> None:
    case = _index_case(num_tokens, max_rows, seed=max_rows)
    if num_tokens:
        case["num_rows"][0] = max_rows
    rows, blocks = _select(case, Backend.NVIDIA, 512, candidate_block_size=8, num_candidate_blocks=64)
    expected, expected_blocks = _select(case, Backend.REFERENCE, 512, candidate_block_size=8, num_candidate_blocks=64)
    if not num_tokens:
        return
    logits = _dense_logits(case).cpu()
    tol = 2.0**-7 * float(logits.abs().max())
    assert_equivalent_selection(rows.cpu(), expected.cpu(), logits, tol)
    assert blocks is not None and expected_blocks is not None
    # Where the chosen blocks agree exactly, the restricted selection must agree too.
    restricted = expected_blocks
    mine, _ = _select(case, Backend.NVIDIA, 512, candidates=restricted, candidate_block_size=8)
    theirs, _ = _select(case, Backend.REFERENCE, 512, candidates=restricted, candidate_block_size=8)
    assert_equivalent_selection(mine.cpu(), theirs.cpu(), logits, tol)
    block_logits = torch.nn.functional.pad(logits, (0, -max_rows % 8), value=float("-inf"))
    block_scores = block_logits.view(num_tokens, -1, 8).amax(-1)
    newest = (case["num_rows"].cpu() - 1).clamp(min=0) // 8
    block_scores.scatter_(1, newest[:, None], 4 * float(logits.abs().max()))
    assert_equivalent_selection(blocks.cpu(), expected_blocks.cpu(), block_scores, tol)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_indexer_restricted_scan_of_a_span_off_sixteen(num_tokens: int) -> None:
    # A decode step's candidate scan over 17 blocks of 8 rows (136 slots) of a 2,048-entry list: a span that is not a
    # multiple of 16 once led Triton to load the 68-byte pool rows as if 8-byte aligned (a misaligned address).
    case = _index_case(num_tokens, 129, seed=129)
    case["num_rows"].fill_(129)
    gen = torch.Generator().manual_seed(5)
    listed = [torch.randperm(17, generator=gen)[:12].sort().values for _ in range(num_tokens)]
    candidates = torch.full((num_tokens, 2048), -1, dtype=torch.int64)
    for t, blocks in enumerate(listed):
        candidates[t, : blocks.numel()] = blocks
    candidates = candidates.cuda()
    mine, _ = _select(case, Backend.NVIDIA, 64, candidates=candidates, candidate_block_size=8)
    theirs, _ = _select(case, Backend.REFERENCE, 64, candidates=candidates, candidate_block_size=8)
    logits = _dense_logits(case).cpu()
    assert_equivalent_selection(mine.cpu(), theirs.cpu(), logits, 2.0**-7 * float(logits.abs().max()))


def test_indexer_decode_step_captures_in_a_cuda_graph() -> None:
    case = _index_case(8, 9000, seed=3)

    def step() -> torch.Tensor:
        return dk.indexer_select(
            case["q"], case["weights"], case["key_pool"], F.FP4_UE8M0, case["block_table"], case["rows_per_block"],
            case["token_request"], case["num_rows"], case["max_rows"], 512, True,
        )[0]  # fmt: skip

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    case["num_rows"].copy_(torch.randint(0, 9001, (8,), device="cuda"))
    graph.replay()
    assert torch.equal(captured, step())
    assert not torch.equal(captured, eager)
