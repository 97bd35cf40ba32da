"""engram_lookup: the public op's contract and validation; the Triton kernel (interpreter on CPU, compiled on CUDA)
against the reference on fresh random inputs. Integer hashing and byte copies: equal bit for bit."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation


def _inputs(tokens: int, ngram: int, heads: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    columns = (ngram - 1) * heads
    sizes = torch.randint(50, 400, (columns,), generator=g)
    table_rows = int(sizes.sum())
    rows = torch.randint(0, 2**40, (tokens, ngram), generator=g)
    rows[0, 1] = 0  # a pad id among them
    return {
        "rows": rows,
        # Odd multipliers near 2^62: the products wrap around int64, so hashes of both signs occur.
        "multipliers": 2 * torch.randint(2**60, 2**61, (ngram,), generator=g) + 1,
        "sizes": sizes,
        "offsets": torch.cumsum(sizes, 0) - sizes,
        "weight": torch.randint(0, 256, (table_rows, width), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "scale": torch.randint(0, 256, (table_rows, width // 32), generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu
        ),
    }


def _run(backend: Backend, device: str, args: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    moved = {name: tensor.to(device) for name, tensor in args.items()}
    tokens, columns = args["rows"].shape[0], args["sizes"].numel()
    codes = torch.empty((tokens, columns * args["weight"].shape[1]), dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((tokens, columns * args["scale"].shape[1]), dtype=torch.float8_e8m0fnu, device=device)
    implementation("engram_lookup", backend)(**moved, codes=codes, scales=scales)
    return codes.cpu().view(torch.uint8), scales.cpu().view(torch.uint8)


@pytest.mark.parametrize(("tokens", "ngram", "heads", "width"), [(7, 4, 8, 256), (3, 3, 2, 128), (1, 2, 3, 64)])
def test_triton_matches_the_reference(triton_device: str, tokens: int, ngram: int, heads: int, width: int) -> None:
    args = _inputs(tokens, ngram, heads, width, seed=tokens * 100 + heads)
    folded = args["rows"][:, 0] * args["multipliers"][0]
    signs = set()
    for n in range(1, ngram):
        folded = folded ^ (args["rows"][:, n] * args["multipliers"][n])
        signs |= set(torch.sign(folded).tolist())
    assert tokens == 1 or signs == {-1, 1}  # the remainder of a negative hash is taken into [0, size)
    fast = _run(Backend.NVIDIA, triton_device, args)
    ref = _run(Backend.REFERENCE, "cpu", args)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


def test_reference_takes_the_hash_modulo_each_columns_table() -> None:
    """One token by hand: orders 2 and 3 of a 3-gram, two heads each, rows numbered by their own first byte."""
    sizes = torch.tensor([5, 7, 11, 13])
    offsets = torch.tensor([0, 5, 12, 23])
    weight = torch.arange(36, dtype=torch.uint8)[:, None].expand(36, 32).contiguous().view(torch.float8_e4m3fn)
    scale = torch.zeros(36, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    rows, multipliers = torch.tensor([[3, -4, 9]]), torch.tensor([5, 7, 11])
    codes, scales = dk.engram_lookup(rows, multipliers, sizes, offsets, weight, scale)
    h2 = (3 * 5) ^ (-4 * 7)  # -19
    h3 = h2 ^ (9 * 11)  # -116
    expected = [h2 % 5 + 0, h2 % 7 + 5, h3 % 11 + 12, h3 % 13 + 23]  # Python's % is the floor remainder
    assert codes.view(torch.uint8).view(1, 4, 32)[0, :, 0].tolist() == expected
    assert scales.shape == (1, 4)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"rows": torch.zeros(2, 3, dtype=torch.int32)}, TypeError, "rows"),
        ({"rows": torch.zeros(2, 1, dtype=torch.int64)}, ValueError, "N >= 2"),
        ({"multipliers": torch.ones(4, dtype=torch.int64)}, ValueError, "multipliers"),
        ({"sizes": torch.ones(5, dtype=torch.int64)}, ValueError, "sizes"),
        ({"offsets": torch.zeros(3, dtype=torch.int64)}, ValueError, "offsets"),
        ({"weight": torch.zeros(10, 32)}, TypeError, "weight"),
        ({"scale": torch.zeros(9, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, ValueError, "scale"),
    ],
)
def test_bad_arguments_are_named(change: dict, error: type[Exception], match: str) -> None:
    args = {
        "rows": torch.zeros(2, 3, dtype=torch.int64),
        "multipliers": torch.ones(3, dtype=torch.int64),
        "sizes": torch.full((4,), 3, dtype=torch.int64),
        "offsets": torch.zeros(4, dtype=torch.int64),
        "weight": torch.zeros(10, 32, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "scale": torch.zeros(10, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }
    with pytest.raises(error, match=match):
        dk.engram_lookup(**{**args, **change})


def test_no_tokens_give_empty_rows() -> None:
    codes, scales = dk.engram_lookup(
        torch.zeros(0, 3, dtype=torch.int64),
        torch.ones(3, dtype=torch.int64),
        torch.full((4,), 3, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
        torch.zeros(10, 32, dtype=torch.uint8).view(torch.float8_e4m3fn),
        torch.zeros(10, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    )
    assert codes.shape == (0, 128) and scales.shape == (0, 4)
