"""window_key_rows: the Triton kernel (interpreter on CPU, compiled on CUDA) equals the reference on random steps of
decode tokens and prefill chunks, with and without a window floor; the reference against the formula, entry by
entry; validation."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation


def _step(query_lens: list[int], starts: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(query_lens)
    return {
        "positions": torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens, strict=True)]),
        "token_request": torch.repeat_interleave(torch.arange(len(starts)), lens),
        "q_start": torch.tensor(starts),
        "cu_query_lens": torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]),
        "state_slots": torch.randperm(2 * len(starts), generator=g)[: len(starts)],
        "window_floor": torch.tensor([max(s - 3, 0) for s in starts]),
    }


def _run(backend: Backend, device: str, args: dict, floored: bool, ring: int, window: int) -> tuple[torch.Tensor, ...]:
    moved = {name: tensor.to(device) for name, tensor in args.items()}
    if not floored:
        moved["window_floor"] = None
    shape = (args["positions"].shape[0], window)
    history = torch.full(shape, 7, dtype=torch.int64, device=device)
    own = torch.full(shape, 7, dtype=torch.int64, device=device)
    num_key_tokens = int(args["cu_query_lens"][-1])
    implementation("window_key_rows", backend)(**moved, ring=ring, window=window, num_key_tokens=num_key_tokens,
                                               history=history, own=own)  # fmt: skip
    return history.cpu(), own.cpu()


@pytest.mark.parametrize("floored", [False, True])
@pytest.mark.parametrize(
    ("query_lens", "starts", "ring", "window"),
    [([1, 1, 1], [0, 5, 300], 8, 8), ([6, 1, 40], [0, 20, 9], 16, 12), ([3], [130], 128, 128)],
)
def test_triton_equals_the_reference(
    triton_device: str, floored: bool, query_lens: list[int], starts: list[int], ring: int, window: int
) -> None:
    args = _step(query_lens, starts, seed=sum(query_lens) + window)
    fast = _run(Backend.NVIDIA, triton_device, args, floored, ring, window)
    ref = _run(Backend.REFERENCE, "cpu", args, floored, ring, window)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    history, own = ref
    for i, (position, request) in enumerate(
        zip(args["positions"].tolist(), args["token_request"].tolist(), strict=True)
    ):
        start, first = int(args["q_start"][request]), int(args["cu_query_lens"][request])
        floor = int(args["window_floor"][request]) if floored else 0
        for w in range(window):
            p = position - window + 1 + w
            read = p >= max(floor, 0)
            assert int(own[i, w]) == (first + p - start if read and p >= start else -1)
            assert int(history[i, w]) == (
                int(args["state_slots"][request]) * ring + p % ring if read and p < start else -1
            )
    assert (history >= 0).any() or starts == [0] * len(starts)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"positions": torch.zeros(2, dtype=torch.int32)}, TypeError, "positions"),
        ({"token_request": torch.zeros(3, dtype=torch.int64)}, ValueError, "token_request"),
        ({"cu_query_lens": torch.zeros(1, dtype=torch.int64)}, ValueError, "cu_query_lens"),
        ({"window_floor": torch.zeros(2, dtype=torch.int64)}, ValueError, "window_floor"),
        ({"ring": 0}, ValueError, "ring"),
    ],
)
def test_validation_names_the_argument(change: dict, error: type[Exception], match: str) -> None:
    args = {
        "positions": torch.zeros(2, dtype=torch.int64),
        "token_request": torch.zeros(2, dtype=torch.int64),
        "q_start": torch.zeros(1, dtype=torch.int64),
        "cu_query_lens": torch.tensor([0, 2]),
        "state_slots": torch.zeros(1, dtype=torch.int64),
        "window_floor": None,
        "ring": 4,
        "window": 4,
        "num_key_tokens": 2,
    }
    with pytest.raises(error, match=match):
        dk.window_key_rows(**{**args, **change})
