"""uniform_compressed_rows and position_sources: the Triton kernels (interpreter on CPU, compiled on CUDA)
equal the reference on random uniform steps (decode, verify and padded requests whose context is 0); the reference
against the formulas, entry by entry; validation."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation


def _step(contexts: list[int], query_len: int, seed: int) -> dict[str, torch.Tensor]:
    """A uniform step: every request computes ``query_len`` tokens ending at its context (a context of 0 is a
    padded graph slot: q_start 0, nothing computed)."""
    g = torch.Generator().manual_seed(seed)
    context = torch.tensor(contexts)
    q_len = torch.where(context > 0, torch.full_like(context, query_len), 0)
    return {
        "q_start": context - q_len,
        "context_lens": context,
        "cu_query_lens": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q_len, 0)]),
        "state_slots": torch.randperm(3 * len(contexts), generator=g)[: len(contexts)],
    }


def _rows(backend: Backend, device: str, step: dict, ratio: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = step["q_start"].shape[0] * count
    request = torch.full((total,), 7, dtype=torch.int64, device=device)
    row = torch.full((total,), 7, dtype=torch.int64, device=device)
    op = implementation("uniform_compressed_rows", backend)
    op(step["q_start"].to(device), step["context_lens"].to(device), ratio, count, request, row)
    return request.cpu(), row.cpu()


def _sources(
    backend: Backend, device: str, step: dict, request: torch.Tensor, row: torch.Tensor, ratio: int, ring: int
) -> tuple[torch.Tensor, ...]:
    shape = (row.shape[0], ratio)
    token = torch.full(shape, 7, dtype=torch.int64, device=device)
    ring_row = torch.full(shape, 7, dtype=torch.int64, device=device)
    in_chunk = torch.zeros(shape, dtype=torch.bool, device=device)
    per_request = [step[name].to(device) for name in ("q_start", "cu_query_lens", "context_lens", "state_slots")]
    num_tokens = int(step["cu_query_lens"][-1])
    implementation("position_sources", backend)(
        request.to(device), row.to(device), ratio, *per_request, ring, num_tokens, token, ring_row, in_chunk
    )
    return token.cpu(), ring_row.cpu(), in_chunk.cpu()


@pytest.mark.parametrize(
    ("contexts", "query_len", "ratio", "ring"),
    [
        ([1, 2, 9, 130, 0], 1, 2, 3),  # decode; a padded slot
        ([5, 64, 0, 301], 1, 1, 4),
        ([7, 40, 12], 5, 2, 7),  # verify steps of 5 tokens
        ([16, 0, 33], 4, 4, 8),
    ],
)
def test_triton_equals_the_reference(
    triton_device: str, contexts: list[int], query_len: int, ratio: int, ring: int
) -> None:
    step = _step(contexts, query_len, seed=sum(contexts) + ratio)
    count = query_len // ratio + (1 if ratio > 1 else 0)
    ref = _rows(Backend.REFERENCE, "cpu", step, ratio, count)
    fast = _rows(Backend.NVIDIA, triton_device, step, ratio, count)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    request, row = ref
    for i in range(row.shape[0]):
        r, j = divmod(i, count)
        first, last = int(step["q_start"][r]) // ratio, (int(step["context_lens"][r]) - 1) // ratio
        assert int(request[i]) == r and int(row[i]) == min(first + j, last)
    ref_sources = _sources(Backend.REFERENCE, "cpu", step, request, row, ratio, ring)
    fast_sources = _sources(Backend.NVIDIA, triton_device, step, request, row, ratio, ring)
    for fast_part, ref_part in zip(fast_sources, ref_sources, strict=True):
        assert torch.equal(fast_part, ref_part)
    token, ring_row, in_chunk = ref_sources
    last_token = max(int(step["cu_query_lens"][-1]) - 1, 0)
    for i in range(row.shape[0]):
        r = int(request[i])
        start, context = int(step["q_start"][r]), int(step["context_lens"][r])
        for c in range(ratio):
            p = min(int(row[i]) * ratio + c, context - 1)
            assert bool(in_chunk[i, c]) == (p >= start)
            assert int(token[i, c]) == min(max(int(step["cu_query_lens"][r]) + p - start, 0), last_token)
            assert int(ring_row[i, c]) == int(step["state_slots"][r]) * ring + p % ring  # Python's % is floor


def test_public_ops_allocate_and_validate() -> None:
    step = _step([3, 8], 1, seed=1)
    request, row = dk.uniform_compressed_rows(step["q_start"], step["context_lens"], 2, 1)
    assert request.tolist() == [0, 1] and row.tolist() == [1, 3]
    token, ring_row, in_chunk = dk.position_sources(
        request, row, 2, step["q_start"], step["cu_query_lens"], step["context_lens"], step["state_slots"], 4, 2
    )
    assert token.shape == ring_row.shape == in_chunk.shape == (2, 2) and in_chunk.dtype == torch.bool
    # request 0 (positions 2, 3 → 2, 2: its last position, computed now); request 1 (6 from the ring, 7 now)
    assert in_chunk.tolist() == [[True, True], [False, True]] and token[:, 1].tolist() == [0, 1]
    empty = dk.uniform_compressed_rows(step["q_start"], step["context_lens"], 2, 0)
    assert empty[0].shape == (0,)
    with pytest.raises(ValueError, match="ratio must be an int >= 1"):
        dk.uniform_compressed_rows(step["q_start"], step["context_lens"], 0, 1)
    with pytest.raises(ValueError, match="per-request tensors must be"):
        dk.uniform_compressed_rows(step["q_start"], step["context_lens"][:1], 2, 1)
    with pytest.raises(TypeError, match="q_start"):
        dk.uniform_compressed_rows(step["q_start"].int(), step["context_lens"], 2, 1)
    with pytest.raises(ValueError, match="request and row must both be"):
        dk.position_sources(
            request[:1], row, 2, step["q_start"], step["cu_query_lens"], step["context_lens"], step["state_slots"], 4, 2
        )
    with pytest.raises(ValueError, match=r"cu_query_lens"):
        dk.position_sources(
            request, row, 2, step["q_start"], step["cu_query_lens"][:2], step["context_lens"], step["state_slots"], 4, 2
        )
    with pytest.raises(ValueError, match="ratio and ring must be ints >= 1"):
        dk.position_sources(
            request, row, 2, step["q_start"], step["cu_query_lens"], step["context_lens"], step["state_slots"], 0, 2
        )
