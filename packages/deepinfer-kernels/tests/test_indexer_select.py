"""indexer_select (public op) against the whole score matrix: top-k with ties, candidate restriction, candidate
blocks, streaming chunks, empty batches; the Triton path's int32 and int64 sort keys."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from _cache_inputs import dense_candidate_blocks, dense_logits, dense_selection, random_selection_case

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.reference import indexer as reference_indexer

F = dk.RowFormat


def _op_args(case: dict, topk: int, round_bf16: bool, device: str = "cpu") -> tuple:
    """The op's arguments up to ``round_logits_bf16`` for a case, its tensors on ``device``."""
    names = ("q", "weights", "key_pool", "block_table", "rows_per_block", "token_request", "num_rows", "max_rows")
    q, weights, pool, table, per_block, token_request, num_rows, max_rows = (
        case[name].to(device) if isinstance(case[name], torch.Tensor) else case[name] for name in names
    )
    return q, weights, pool, F.FP4_UE8M0, table, per_block, token_request, num_rows, max_rows, topk, round_bf16


def _select(case: dict, topk: int, round_bf16: bool = True, **kwargs: object) -> tuple:
    return dk.indexer_select(*_op_args(case, topk, round_bf16), **kwargs)


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


def _select_on(
    backend: Backend,
    device: str,
    case: dict,
    topk: int,
    round_bf16: bool,
    candidates: torch.Tensor | None = None,
    block_size: int = 0,
    num_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``backend``'s own implementation on ``device``: rows [T, topk] and blocks [T, num_blocks] (or None), on the
    CPU."""
    num_tokens = case["q"].shape[0]
    rows = torch.full((num_tokens, topk), -7, dtype=torch.int64, device=device)
    blocks = torch.full((num_tokens, num_blocks), -7, dtype=torch.int64, device=device) if num_blocks else None
    implementation("indexer_select", backend)(
        *_op_args(case, topk, round_bf16, device), None if candidates is None else candidates.to(device), block_size,
        num_blocks, rows, blocks,
    )  # fmt: skip
    return rows.cpu(), None if blocks is None else blocks.cpu()


@pytest.fixture
def triton_indexer(triton_device: str) -> ModuleType:
    """The Triton indexer module (imported after ``triton_device`` checked that Triton runs here)."""
    from deepinfer_kernels.cuda import indexer

    return indexer


@pytest.fixture
def key_dtypes(triton_indexer: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of the merged sort keys of every selection the Triton path writes."""
    seen: list[torch.dtype] = []
    write_ids = triton_indexer._write_ids

    def recording(out: torch.Tensor, merged: torch.Tensor, selected: int, chunk_is_selection: bool) -> None:
        seen.append(merged.dtype)
        write_ids(out, merged, selected, chunk_is_selection)

    monkeypatch.setattr(triton_indexer, "_write_ids", recording)
    return seen


def _tied_case(seed: int) -> dict:
    """150 rows that each hold one of five keys, one of them all zeros: a query's logits take at most five values, so
    ties (lower id first) decide most of its rows and blocks; the even queries have negative weights only, so their
    logits are negative or zero (the zero key's rows then rank first)."""
    case = random_selection_case(2, 8, 150, 16, 32, 3, seed=seed)
    keys = torch.cat([case["key_pool"][:4], dk.encode_rows(torch.zeros(1, 32), F.FP4_UE8M0)])
    pick = torch.randint(0, 5, (case["key_pool"].shape[0],), generator=torch.Generator().manual_seed(seed))
    case["key_pool"] = keys[pick]
    case["weights"][::2] = -case["weights"][::2].abs()
    case["num_rows"][:4] = torch.tensor([150, 0, 1, 149])
    return case


@pytest.mark.parametrize(
    ("round_bf16", "max_ids", "key_dtype"),
    [(True, 1 << 16, torch.int32), (True, 149, torch.int64), (False, 1 << 16, torch.int64)],
)
def test_triton_sort_keys_select_as_dense(
    triton_device: str,
    triton_indexer: ModuleType,
    key_dtypes: list[torch.dtype],
    monkeypatch: pytest.MonkeyPatch,
    round_bf16: bool,
    max_ids: int,
    key_dtype: torch.dtype,
) -> None:
    """The Triton path merges int32 sort keys with BF16 logits and ids below ``_KEY32_MAX_IDS`` (150 rows, 19
    blocks), int64 keys past it (lowered to 149) or with FP32 logits; every way the rows, candidate blocks and
    restricted rows are those of the whole score matrix, with ties, negative and zero logits, over three row chunks
    (torch.topk merges) and one query a chunk."""
    monkeypatch.setattr(triton_indexer, "_KEY32_MAX_IDS", max_ids)
    monkeypatch.setattr(triton_indexer, "_MAX_ROW_CHUNK", 64)
    monkeypatch.setattr(triton_indexer, "_WORKSPACE_BYTES", 1)
    case = _tied_case(seed=13)
    logits = dense_logits(case, round_bf16)
    row_ids = torch.arange(150)
    visible = row_ids[None, :] < case["num_rows"][:, None]
    rows, blocks = _select_on(Backend.NVIDIA, triton_device, case, 20, round_bf16, block_size=8, num_blocks=6)
    assert torch.equal(rows, dense_selection(logits, visible, 20))
    assert blocks is not None and torch.equal(blocks, dense_candidate_blocks(logits, case["num_rows"], 8, 6))
    gen = torch.Generator().manual_seed(14)
    candidates = torch.full((8, 12), -1)
    for t in range(8):
        count = int(torch.randint(5, 13, (1,), generator=gen))
        candidates[t, :count] = torch.randperm(19, generator=gen)[:count].sort().values
    rows, _ = _select_on(Backend.NVIDIA, triton_device, case, 12, round_bf16, candidates, block_size=8)
    in_block = ((row_ids[None, :, None] // 8) == candidates[:, None, :]).any(-1)
    assert torch.equal(rows, dense_selection(logits, in_block & visible, 12))
    assert key_dtypes == [key_dtype] * 3 * 8


def test_triton_restricted_rows_past_sixteen_bits_take_int64_keys(
    triton_device: str, key_dtypes: list[torch.dtype]
) -> None:
    """A restricted layer scans only 32 slots (four candidate blocks of 8) but its rows reach past 2^16: the ids do not
    fit an int32 key, so even with BF16 logits the keys are int64, and the rows are the reference's."""
    max_rows = (1 << 16) + 64
    case = random_selection_case(1, 3, max_rows, 64, 32, 2, seed=17)
    case["num_rows"][:] = max_rows
    candidates = torch.tensor([[3, 8190, 8193, 8199], [0, 1, 2, 8195], [8192, 8197, -1, -1]])
    rows, _ = _select_on(Backend.NVIDIA, triton_device, case, 16, True, candidates, block_size=8)
    expected, _ = _select_on(Backend.REFERENCE, "cpu", case, 16, True, candidates, block_size=8)
    assert torch.equal(rows, expected) and bool((rows >= 1 << 16).any())
    assert key_dtypes == [torch.int64]
