"""indexer_select (public op) against the whole score matrix: top-k with ties, candidate restriction, candidate
blocks, streaming chunks, empty batches."""

from __future__ import annotations

import pytest
import torch
from _cache_inputs import dense_candidate_blocks, dense_logits, dense_selection, random_selection_case

import deepinfer_kernels as dk
from deepinfer_kernels.reference import indexer as reference_indexer

F = dk.RowFormat


def _select(case: dict, topk: int, round_bf16: bool = True, **kwargs: object) -> tuple:
    return dk.indexer_select(
        case["q"],
        case["weights"],
        case["key_pool"],
        F.FP4_UE8M0,
        case["block_table"],
        case["rows_per_block"],
        case["token_request"],
        case["num_rows"],
        case["max_rows"],
        topk,
        round_bf16,
        **kwargs,
    )


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several row chunks and query chunks even on small cases."""
    monkeypatch.setattr(reference_indexer, "_ROW_CHUNK", 16)
    monkeypatch.setattr(reference_indexer, "_WORKSPACE_BYTES", 1)


@pytest.mark.parametrize("round_bf16", [True, False])
@pytest.mark.parametrize(("requests", "tokens", "max_rows", "per_block", "topk"), [(3, 11, 45, 4, 7), (1, 2, 5, 8, 9)])
def test_topk_matches_dense(
    small_chunks: None, requests: int, tokens: int, max_rows: int, per_block: int, topk: int, round_bf16: bool
) -> None:
    case = random_selection_case(requests, tokens, max_rows, per_block, 32, 3, seed=tokens)
    rows, blocks = _select(case, topk, round_bf16)
    logits = dense_logits(case, round_bf16)
    valid = torch.arange(max_rows)[None, :] < case["num_rows"][:, None]
    assert blocks is None
    assert torch.equal(rows, dense_selection(logits, valid, topk))


def test_ties_go_to_the_lower_row(small_chunks: None) -> None:
    case = random_selection_case(1, 5, 40, 8, 32, 2, seed=3)
    # Every row holds the same key: all logits of a query tie, so the first rows win.
    case["key_pool"][:] = case["key_pool"][0]
    case["num_rows"] = torch.tensor([40, 17, 3, 0, 33])
    rows, _ = _select(case, 6)
    expected = [list(range(min(6, n))) + [-1] * (6 - min(6, n)) for n in (40, 17, 3, 0, 33)]
    assert rows.tolist() == expected


@pytest.mark.parametrize("topk", [5, 30])
def test_candidate_restriction_matches_dense(small_chunks: None, topk: int) -> None:
    case = random_selection_case(2, 9, 61, 4, 32, 2, seed=5)
    block_size, num_blocks = 4, 16
    gen = torch.Generator().manual_seed(1)
    candidates = torch.stack([torch.randperm(num_blocks, generator=gen)[:5].sort().values for _ in range(9)])
    candidates[:, 3:] = torch.where(torch.rand(9, 2, generator=gen) < 0.5, -1, candidates[:, 3:])
    candidates = torch.sort(torch.where(candidates < 0, 99, candidates), dim=1).values
    candidates = torch.where(candidates == 99, -1, candidates)
    rows, _ = _select(case, topk, candidates=candidates, candidate_block_size=block_size)
    logits = dense_logits(case, True)
    row_ids = torch.arange(61)
    in_block = ((row_ids[None, :, None] // block_size) == candidates[:, None, :]).any(-1)
    valid = in_block & (row_ids[None, :] < case["num_rows"][:, None])
    assert torch.equal(rows, dense_selection(logits, valid, topk))


@pytest.mark.parametrize(("block_size", "num_blocks"), [(4, 3), (8, 20)])
def test_candidate_blocks_match_dense(small_chunks: None, block_size: int, num_blocks: int) -> None:
    case = random_selection_case(3, 10, 77, 8, 32, 4, seed=7)
    case["num_rows"][0] = 0
    case["num_rows"][1] = 77
    rows, blocks = _select(case, 12, candidate_block_size=block_size, num_candidate_blocks=num_blocks)
    logits = dense_logits(case, True)
    valid = torch.arange(77)[None, :] < case["num_rows"][:, None]
    assert torch.equal(rows, dense_selection(logits, valid, 12))
    assert blocks is not None
    assert torch.equal(blocks, dense_candidate_blocks(logits, case["num_rows"], block_size, num_blocks))


def test_chunking_does_not_change_the_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    case = random_selection_case(2, 6, 100, 16, 64, 2, seed=9)
    whole = _select(case, 10, candidate_block_size=8, num_candidate_blocks=4)
    monkeypatch.setattr(reference_indexer, "_ROW_CHUNK", 8)
    monkeypatch.setattr(reference_indexer, "_WORKSPACE_BYTES", 1)
    chunked = _select(case, 10, candidate_block_size=8, num_candidate_blocks=4)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_empty_batch() -> None:
    case = random_selection_case(1, 0, 10, 4, 32, 2, seed=11)
    rows, blocks = _select(case, 4, candidate_block_size=2, num_candidate_blocks=3)
    assert rows.shape == (0, 4) and blocks is not None and blocks.shape == (0, 3)


def test_bad_arguments_are_refused() -> None:
    case = random_selection_case(1, 3, 10, 4, 32, 2, seed=12)
    with pytest.raises(ValueError, match="unrestricted"):
        _select(
            case, 4, candidates=torch.zeros(3, 2, dtype=torch.int64), candidate_block_size=2, num_candidate_blocks=1
        )
    with pytest.raises(ValueError, match="candidate_block_size must be > 0"):
        _select(case, 4, num_candidate_blocks=2)
    case["weights"] = case["weights"][:, :1]
    with pytest.raises(ValueError, match=r"weights must have shape \(3, 2\)"):
        _select(case, 4)
