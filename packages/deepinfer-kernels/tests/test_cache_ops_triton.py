"""Triton cache ops (nvidia backend) against the reference: row encode/decode and the fused store bit-exact,
sparse attention and indexer selection within stated tolerances. Runs in Triton's interpreter on CPU tensors, or
on a CUDA device."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import assert_equivalent_selection, dense_logits, random_pool, random_selection_case

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_bitwise_equal, random_normal

F = dk.RowFormat


def _values(shape: tuple[int, int], seed: int, device: str) -> torch.Tensor:
    x = random_normal(shape, seed=seed) * torch.logspace(-5, 5, shape[0])[:, None]
    x[0] = 0.0
    x[-1, :3] = -0.0
    return x.to(device)


@pytest.mark.parametrize("fmt", list(F))
@pytest.mark.parametrize("width", [32, 96, 128])
def test_encode_decode_bit_exact(triton_device: str, fmt: dk.RowFormat, width: int) -> None:
    x = _values((19, width), seed=width, device=triton_device)
    out = torch.empty((19, dk.bytes_per_row(fmt, width)), dtype=torch.uint8, device=triton_device)
    implementation("encode_rows", Backend.NVIDIA)(x, fmt, out)
    expected = dk.encode_rows(x.cpu(), fmt)
    assert_bitwise_equal(out.cpu(), expected)
    decoded = torch.empty((19, width), device=triton_device)
    implementation("decode_rows", Backend.NVIDIA)(out, fmt, decoded)
    assert_bitwise_equal(decoded.cpu(), dk.decode_rows(expected, fmt))


@pytest.mark.parametrize("fmt", list(F))
def test_store_rows_bit_exact(triton_device: str, fmt: dk.RowFormat) -> None:
    width = 64
    pool = random_pool(23, width, fmt, seed=4)
    rows = torch.tensor([5, -1, 0, 22, 7, -1, 11, 3, 9, 1])
    values = _values((10, width), seed=5, device="cpu").to(torch.bfloat16)
    expected = pool.clone()
    implementation("store_rows", Backend.REFERENCE)(expected, rows, values, fmt)
    actual = pool.to(triton_device)
    implementation("store_rows", Backend.NVIDIA)(actual, rows.to(triton_device), values.to(triton_device), fmt)
    assert_bitwise_equal(actual.cpu(), expected)


def _attention_case(num_tokens: int, heads: int, width: int, counts: tuple[int, ...], fmts: tuple, seed: int) -> tuple:
    q = random_normal((num_tokens, heads, width), seed=seed, dtype=torch.bfloat16)
    sink = random_normal((heads,), seed=seed + 1)
    sources = []
    for i, (count, fmt) in enumerate(zip(counts, fmts, strict=True)):
        pool = random_pool(2 * count + 5, width, fmt, seed=seed + 10 * i)
        gen = torch.Generator().manual_seed(seed + i)
        rows = torch.randint(0, pool.shape[0], (num_tokens, count), generator=gen)
        rows = torch.where(torch.rand((num_tokens, count), generator=gen) < 0.25, -1, rows)
        sources.append(dk.KeySource(pool, rows, fmt))
    return q, sources, sink


def _run_attention(backend: Backend, device: str, q, sources, sink, scale: float, round_probs: bool) -> torch.Tensor:
    moved = [dk.KeySource(s.pool.to(device), s.rows.to(device), s.fmt) for s in sources]
    out = torch.full(q.shape, float("nan"), device=device)
    implementation("sparse_attention", backend)(q.to(device), moved, sink.to(device), scale, round_probs, out)
    return out.cpu()


ATTENTION_CASES = [
    # (tokens, heads, width, key counts, formats)
    (5, 3, 64, (7, 3, 20), (F.FP8, F.FP8, F.FP4_E4M3)),
    (2, 17, 32, (40,), (F.FP4_E4M3,)),
    (3, 4, 96, (5, 9), (F.FP8, F.RAW_FP32)),
    (0, 2, 32, (3,), (F.FP8,)),
    (4, 2, 32, (), ()),
]


@pytest.mark.parametrize("target_programs", [1, 64])
@pytest.mark.parametrize("round_probs", [True, False])
@pytest.mark.parametrize(("tokens", "heads", "width", "counts", "fmts"), ATTENTION_CASES)
def test_sparse_attention_matches_reference(
    triton_device: str,
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    heads: int,
    width: int,
    counts: tuple,
    fmts: tuple,
    round_probs: bool,
    target_programs: int,
) -> None:
    # Imported here, after triton_device checked that Triton is installed.
    from deepinfer_kernels.cuda import attention as cuda_attention

    # target_programs 64 splits every query's key list over several programs (flash-decoding merge).
    monkeypatch.setattr(cuda_attention, "SPLIT_TARGET_PROGRAMS", target_programs)
    q, sources, sink = _attention_case(tokens, heads, width, counts, fmts, seed=tokens + heads)
    if tokens:
        for source in sources:
            source.rows[-1] = -1  # one query with no key at all
    actual = _run_attention(Backend.NVIDIA, triton_device, q, sources, sink, width**-0.5, round_probs)
    expected = _run_attention(Backend.REFERENCE, "cpu", q, sources, sink, width**-0.5, round_probs)
    # Online softmax: each probability is rounded to BF16 relative to a running maximum (≤ 2^-9 relative each);
    # FP32 sums in another order otherwise.
    rtol = 2.0**-8 if round_probs else 1e-5
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    assert not actual.isnan().any()
    assert ((actual - expected).abs() <= rtol * scale + 1e-6).all(), (actual - expected).abs().max()
    if tokens:
        assert torch.equal(actual[-1], torch.zeros(heads, width))


def _select(backend: Backend, device: str, case: dict, topk: int, **kwargs: object) -> tuple:
    num_tokens = case["q"].shape[0]
    rows = torch.full((num_tokens, topk), -7, dtype=torch.int64, device=device)
    nb = int(kwargs.get("num_candidate_blocks", 0))
    blocks = torch.full((num_tokens, nb), -7, dtype=torch.int64, device=device) if nb else None
    cand = kwargs.get("candidates")
    implementation("indexer_select", backend)(
        case["q"].to(device), case["weights"].to(device), case["key_pool"].to(device), F.FP4_UE8M0,
        case["block_table"].to(device), case["rows_per_block"], case["token_request"].to(device),
        case["num_rows"].to(device), case["max_rows"], topk, True,
        None if cand is None else cand.to(device), int(kwargs.get("candidate_block_size", 0)), nb, rows, blocks,
    )  # fmt: skip
    return rows.cpu(), None if blocks is None else blocks.cpu()


def _select_both(triton_device: str, case: dict, topk: int, **kwargs: object) -> tuple:
    return [
        _select(backend, device, case, topk, **kwargs)
        for backend, device in ((Backend.NVIDIA, triton_device), (Backend.REFERENCE, "cpu"))
    ]


@pytest.mark.parametrize(
    ("requests", "tokens", "max_rows", "per_block", "topk"), [(3, 9, 150, 16, 13), (1, 1, 7, 4, 9)]
)
def test_indexer_select_matches_reference(
    triton_device: str, requests: int, tokens: int, max_rows: int, per_block: int, topk: int
) -> None:
    case = random_selection_case(requests, tokens, max_rows, per_block, 64, 5, seed=tokens)
    case["num_rows"][0] = max_rows
    (rows, _), (expected, _) = _select_both(triton_device, case, topk)
    logits = dense_logits(case, True)
    # Index logits are BF16: a different FP32 summation order can move one by one BF16 step.
    tol = 2.0**-7 * float(logits.abs().max())
    assert_equivalent_selection(rows, expected, torch.where(logits.isfinite(), logits, 0), tol)


def test_indexer_candidates_and_blocks_match_reference(triton_device: str) -> None:
    case = random_selection_case(2, 6, 200, 8, 32, 3, seed=21)
    case["num_rows"][1] = 0
    (rows, blocks), (expected, expected_blocks) = _select_both(
        triton_device, case, 10, candidate_block_size=8, num_candidate_blocks=5
    )
    logits = dense_logits(case, True)
    tol = 2.0**-7 * float(logits.abs().max())
    assert_equivalent_selection(rows, expected, logits, tol)
    block_scores = torch.nn.functional.pad(logits, (0, 0 if 200 % 8 == 0 else 8 - 200 % 8)).view(6, -1, 8).amax(-1)
    newest = (case["num_rows"] - 1).clamp(min=0) // 8
    block_scores.scatter_(1, newest[:, None], float(logits.abs().max()) * 4)
    assert blocks is not None and expected_blocks is not None
    assert_equivalent_selection(blocks, expected_blocks, block_scores, tol)
    restricted = torch.where(expected_blocks >= 0, expected_blocks, -1)
    (rows, _), (expected, _) = _select_both(triton_device, case, 7, candidates=restricted, candidate_block_size=8)
    assert_equivalent_selection(rows, expected, logits, tol)


def test_indexer_selects_every_row_without_a_top_k(triton_device: str) -> None:
    """One row chunk of no more rows (blocks) than are selected (short contexts): the Triton path takes the chunk as
    the selection without a top-k; the ids still match the reference, ascending and −1 padded, with restriction and
    with candidate blocks (100 rows in one 128-row chunk, 16 blocks of 8 per chunk)."""
    case = random_selection_case(2, 5, 100, 16, 32, 3, seed=31)
    case["num_rows"][0] = 100
    case["num_rows"][1] = 0
    (rows, blocks), (expected, expected_blocks) = _select_both(
        triton_device, case, 128, candidate_block_size=8, num_candidate_blocks=20
    )
    assert torch.equal(rows, expected) and blocks is not None and expected_blocks is not None
    assert torch.equal(blocks, expected_blocks)
    assert rows[0].tolist() == list(range(100)) + [-1] * 28
    restricted = torch.where(expected_blocks[:, :6] >= 0, expected_blocks[:, :6], -1)
    (rows, _), (expected, _) = _select_both(triton_device, case, 64, candidates=restricted, candidate_block_size=8)
    assert torch.equal(rows, expected)


def test_indexer_candidate_lists_wider_than_the_rows_reach(triton_device: str) -> None:
    """Candidate lists as wide as a long context's (12 entries, ascending, −1 padded) on a short one (max_rows 22,
    block size 4: six reachable blocks; the Triton path scans only those): every visible candidate row is selected
    (top-k 30), as by the reference."""
    case = random_selection_case(2, 6, 22, 4, 32, 2, seed=9)
    case["num_rows"][0] = 22
    gen = torch.Generator().manual_seed(2)
    candidates = torch.stack([torch.randperm(12, generator=gen)[:9].sort().values for _ in range(6)])
    candidates[0] = torch.arange(9)  # the last reachable block (rows 20, 21) is entry 5
    candidates = torch.cat([candidates, torch.full((6, 3), -1)], dim=1)
    (rows, _), (expected, _) = _select_both(triton_device, case, 30, candidates=candidates, candidate_block_size=4)
    assert torch.equal(rows, expected)
    assert rows[0].tolist() == list(range(22)) + [-1] * 8


def test_indexer_skips_tiles_past_the_visible_rows(triton_device: str) -> None:
    """Row tiles past a query's visible rows, or past its last candidate block, only write invalid keys (the kernel
    exits early there): five 64-row tiles over 400 rows, queries with few visible rows, candidate lists of 40 entries
    with 40 − 7·t of them valid (ascending, −1 padded), some blocks beyond a query's rows; the same selection as the
    reference, unrestricted (with candidate blocks) and restricted."""
    case = random_selection_case(2, 6, 400, 16, 32, 3, seed=41)
    case["num_rows"] = torch.tensor([400, 3, 70, 0, 129, 250])
    (rows, blocks), (expected, expected_blocks) = _select_both(
        triton_device, case, 20, candidate_block_size=8, num_candidate_blocks=12
    )
    logits = dense_logits(case, True)
    tol = 2.0**-7 * float(logits.abs().max())
    assert_equivalent_selection(rows, expected, logits, tol)
    assert rows[1].tolist() == [0, 1, 2] + [-1] * 17 and rows[3].tolist() == [-1] * 20
    assert blocks is not None and expected_blocks is not None
    gen = torch.Generator().manual_seed(42)
    candidates = torch.full((6, 40), -1)
    for t in range(6):
        count = 40 - 7 * t
        candidates[t, :count] = torch.randperm(50, generator=gen)[:count].sort().values
    (rows, _), (expected, _) = _select_both(triton_device, case, 20, candidates=candidates, candidate_block_size=8)
    assert_equivalent_selection(rows, expected, logits, tol)


@pytest.mark.parametrize("blocks", [0, 6])
def test_indexer_queries_of_one_request_share_key_tiles(
    triton_device: str, monkeypatch: pytest.MonkeyPatch, blocks: int
) -> None:
    """One request's 102 queries (a prefill; one block-table row) are scored 4 to a program against shared key tiles:
    the same selection as the reference and as one query a program, with and without candidate blocks, a partial
    last group of queries and queries that see no row."""
    from deepinfer_kernels.cuda import indexer as triton_indexer

    case = random_selection_case(1, 102, 150, 16, 64, 5, seed=51)
    case["num_rows"][:8] = torch.tensor([0, 1, 0, 150, 64, 65, 0, 3])
    kwargs = {"candidate_block_size": 8, "num_candidate_blocks": blocks} if blocks else {}
    shared, expected = _select_both(triton_device, case, 12, **kwargs)
    monkeypatch.setattr(triton_indexer, "SHARED_MIN_TOKENS", 10**9)
    alone, _ = _select_both(triton_device, case, 12, **kwargs)
    logits = dense_logits(case, True)
    tol = 2.0**-7 * float(logits.abs().max())
    for rows, reference in ((shared[0], expected[0]), (shared[0], alone[0])):
        assert_equivalent_selection(rows, reference, torch.where(logits.isfinite(), logits, 0), tol)
    if blocks:
        assert shared[1] is not None and expected[1] is not None
        block_scores = torch.nn.functional.pad(logits, (0, 2)).view(102, -1, 8).amax(-1)
        newest = (case["num_rows"] - 1).clamp(min=0) // 8
        block_scores.scatter_(1, newest[:, None], float(logits.abs().max()) * 4)
        assert_equivalent_selection(shared[1], expected[1], block_scores, tol)
    assert shared[0][0].tolist() == [-1] * 12 and shared[0][1].tolist() == [0] + [-1] * 11


def test_indexer_scores_several_row_tiles_a_program(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's programs score several row tiles each (their queries loaded once): with 2 and 4 tiles a program
    over five 64-row tiles (a partial last group), shared key tiles with candidate blocks and one-query programs over
    candidate lists, every selection equals the one-tile programs' (which equal the reference's)."""
    from deepinfer_kernels.cuda import indexer as triton_indexer

    case = random_selection_case(1, 70, 300, 16, 64, 5, seed=61)
    case["num_rows"][:6] = torch.tensor([0, 1, 300, 64, 65, 129])
    gen = torch.Generator().manual_seed(62)
    candidates = torch.full((70, 40), -1)
    for t in range(70):
        count = int(torch.randint(0, 41, (1,), generator=gen))
        candidates[t, :count] = torch.randperm(40, generator=gen)[:count].sort().values
    calls = [
        {"candidate_block_size": 8, "num_candidate_blocks": 6},
        {"candidates": candidates, "candidate_block_size": 8},
    ]
    monkeypatch.setattr(triton_indexer, "MAX_ROW_TILES", 1)
    one_tile = [_select_both(triton_device, case, 12, **kwargs) for kwargs in calls]
    logits = dense_logits(case, True)
    tol = 2.0**-7 * float(logits.abs().max())
    assert_equivalent_selection(one_tile[0][0][0], one_tile[0][1][0], torch.where(logits.isfinite(), logits, 0), tol)
    monkeypatch.setattr(triton_indexer, "ROW_TILE_PROGRAMS", 1)
    for row_tiles in (2, 4):
        monkeypatch.setattr(triton_indexer, "MAX_ROW_TILES", row_tiles)
        for kwargs, ((rows, blocks), _) in zip(calls, one_tile, strict=True):
            tiled_rows, tiled_blocks = _select(Backend.NVIDIA, triton_device, case, 12, **kwargs)
            assert torch.equal(tiled_rows, rows), (row_tiles, kwargs.keys())
            assert (tiled_blocks is None and blocks is None) or torch.equal(tiled_blocks, blocks)


def test_indexer_ties_go_to_the_lower_row(triton_device: str) -> None:
    case = random_selection_case(1, 3, 300, 32, 32, 2, seed=5)
    case["key_pool"][:] = case["key_pool"][0]
    case["num_rows"] = torch.tensor([300, 77, 2])
    (rows, _), (expected, _) = _select_both(triton_device, case, 6)
    assert torch.equal(rows, expected)
    assert rows[0].tolist() == list(range(6)) and rows[2].tolist() == [0, 1, -1, -1, -1, -1]


def test_sparse_attention_accepts_an_empty_pool(triton_device: str) -> None:
    q, sources, sink = _attention_case(3, 2, 32, (4,), (F.FP8,), seed=3)
    empty = dk.KeySource(torch.zeros(0, 18, dtype=torch.uint8), torch.full((3, 5), -1), F.FP4_E4M3)
    actual = _run_attention(Backend.NVIDIA, triton_device, q, [*sources, empty], sink, 0.3, True)
    expected = _run_attention(Backend.REFERENCE, "cpu", q, sources, sink, 0.3, True)
    assert ((actual - expected).abs() <= 2.0**-8 * float(expected.abs().max())).all()
