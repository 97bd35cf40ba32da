"""engram_ngram_rows: the public op's contract and validation; the Triton kernel (interpreter on CPU, compiled on
CUDA) against the reference on fresh random steps. Integer gathers and selects: equal bit for bit."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation

PAD = 2


def _step(query_lens: list[int], starts: list[int], ngram: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Requests computing ``query_lens[r]`` tokens from position ``starts[r]``; ids past the table and table entries
    of −1 (tokens outside the compressed vocabulary) among them, and prefixes with missing (−1) tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(query_lens)
    old_to_new = torch.randint(0, 50, (vocab,), generator=g)
    old_to_new[torch.randint(0, vocab, (vocab // 10,), generator=g)] = -1
    input_ids = torch.randint(0, vocab + vocab // 8, (tokens,), generator=g)
    prefix_ids = torch.randint(0, vocab, (len(starts), ngram - 1), generator=g)
    prefix_ids[0, 0] = -1
    return {
        "input_ids": input_ids,
        "positions": torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]),
        "token_request": torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(query_lens)),
        "q_start": torch.tensor(starts),
        "prefix_ids": prefix_ids,
        "old_to_new": old_to_new,
    }


def _run(backend: Backend, device: str, args: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    moved = {name: tensor.to(device) for name, tensor in args.items()}
    tokens, ngram = args["input_ids"].shape[0], args["prefix_ids"].shape[1] + 1
    rows = torch.empty((tokens, ngram), dtype=torch.int64, device=device)
    active = torch.empty((tokens,), dtype=torch.bool, device=device)
    implementation("engram_ngram_rows", backend)(**moved, pad_id=PAD, rows=rows, active=active)
    return rows.cpu(), active.cpu()


@pytest.mark.parametrize(
    ("query_lens", "starts", "ngram"),
    [
        ([1, 1, 1, 1], [0, 2, 57, 300], 4),  # decode tokens, two of them near the start
        ([5, 1, 140], [0, 9, 3], 4),  # prefill chunks with prefixes, more than one program's tokens
        ([3, 2], [1, 0], 2),
    ],
)
def test_triton_matches_the_reference(triton_device: str, query_lens: list[int], starts: list[int], ngram: int) -> None:
    args = _step(query_lens, starts, ngram, vocab=300, seed=sum(query_lens) + ngram)
    fast = _run(Backend.NVIDIA, triton_device, args)
    ref = _run(Backend.REFERENCE, "cpu", args)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    rows = ref[0]
    assert (rows == PAD).any() and (rows != PAD).any() and not ref[1].all()  # pads, ids and inactive tokens occur


def test_reference_reads_the_prefix_and_cuts_at_an_unknown_id() -> None:
    """One request computing positions 2 … 4 of ids [10, 11 | 12, 13, 14]: the prefix holds positions 0 and 1; id 13 is
    outside the compressed vocabulary, so its own row is all pads (the token inactive) and the n-gram reaching back
    past it ends in pads."""
    old_to_new = torch.arange(100) + 1000
    old_to_new[13] = -1
    rows, active = dk.engram_ngram_rows(
        torch.tensor([12, 13, 14]),
        torch.tensor([2, 3, 4]),
        torch.zeros(3, dtype=torch.int64),
        torch.tensor([2]),
        torch.tensor([[10, 11]]),
        old_to_new,
        PAD,
    )
    assert rows.tolist() == [[1012, 1011, 1010], [PAD, PAD, PAD], [1014, PAD, PAD]]
    assert active.tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"input_ids": torch.zeros(3, dtype=torch.int32)}, TypeError, "input_ids"),
        ({"positions": torch.zeros(2, dtype=torch.int64)}, ValueError, "positions"),
        ({"prefix_ids": torch.zeros(1, 0, dtype=torch.int64)}, ValueError, "prefix_ids"),
        ({"old_to_new": torch.zeros(2, 2, dtype=torch.int64)}, ValueError, "old_to_new"),
        ({"pad_id": 2.0}, TypeError, "pad_id"),
    ],
)
def test_bad_arguments_are_named(change: dict, error: type[Exception], match: str) -> None:
    args = {
        "input_ids": torch.zeros(3, dtype=torch.int64),
        "positions": torch.arange(3),
        "token_request": torch.zeros(3, dtype=torch.int64),
        "q_start": torch.zeros(1, dtype=torch.int64),
        "prefix_ids": torch.full((1, 2), -1, dtype=torch.int64),
        "old_to_new": torch.arange(10),
        "pad_id": PAD,
    }
    with pytest.raises(error, match=match):
        dk.engram_ngram_rows(**{**args, **change})
