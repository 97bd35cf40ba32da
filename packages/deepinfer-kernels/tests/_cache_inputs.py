"""Random paged-cache inputs and plain dense re-computations shared by the attention / indexer / store tests."""

from __future__ import annotations

import torch

import deepinfer_kernels as dk
from deepinfer_kernels.testing import random_normal, seeded_generator

__all__ = [
    "assert_equivalent_selection",
    "dense_attention",
    "dense_candidate_blocks",
    "dense_logits",
    "dense_selection",
    "random_pool",
    "random_rows",
    "random_selection_case",
]


def random_pool(num_rows: int, width: int, fmt: dk.RowFormat, *, seed: int, device: str = "cpu") -> torch.Tensor:
    """[num_rows, bytes] uint8 pool holding encoded random rows (row norms vary over two orders of magnitude)."""
    values = random_normal((num_rows, width), seed=seed)
    spread = torch.exp(torch.rand((num_rows, 1), generator=seeded_generator(seed + 1)) * 4 - 2)
    return dk.encode_rows(values * spread, fmt).to(device)


def random_rows(num_tokens: int, count: int, pool_rows: int, *, seed: int, missing: float = 0.2) -> torch.Tensor:
    """[T, count] int64 random flat rows with a ``missing`` share of −1."""
    gen = seeded_generator(seed)
    rows = torch.randint(0, max(pool_rows, 1), (num_tokens, count), generator=gen)
    return torch.where(torch.rand((num_tokens, count), generator=gen) < missing, -1, rows)


def dense_attention(
    q: torch.Tensor, sources: list[dk.KeySource], sink: torch.Tensor, scale: float, round_probs_bf16: bool
) -> torch.Tensor:
    """All keys of all queries at once, softmax with the sink as an extra column (a different formulation)."""
    width = q.shape[-1]
    keys = torch.cat([dk.decode_rows(s.pool[s.rows.clamp(min=0)], s.fmt, width) for s in sources], dim=1)
    valid = torch.cat([s.rows >= 0 for s in sources], dim=1)
    logits = torch.einsum("thd,tnd->thn", q.double(), keys.double()) * scale
    logits = torch.where(valid[:, None, :], logits, -torch.inf)
    sink_col = sink.double()[None, :, None].expand(q.shape[0], -1, 1)
    full = torch.cat([logits, sink_col], dim=-1)
    peak = full.amax(dim=-1, keepdim=True)
    probs = torch.exp(full - peak)
    denom = probs.sum(dim=-1, keepdim=True)
    numer = probs[..., :-1]
    if round_probs_bf16:
        numer = numer.float().to(torch.bfloat16).double()
    return (torch.einsum("thn,tnd->thd", numer, keys.double()) / denom).float()


def dense_logits(case: dict, round_bf16: bool) -> torch.Tensor:
    """Index logits [T, max_rows] of every row of every query of a :func:`random_selection_case` (the whole matrix)."""
    rows = torch.arange(case["max_rows"])
    per_block = case["rows_per_block"]
    pages = case["block_table"].long()[case["token_request"].long()][:, rows // per_block]
    flat = pages * per_block + rows % per_block
    keys = dk.decode_rows(case["key_pool"][flat], dk.RowFormat.FP4_UE8M0).double()
    scores = torch.relu(torch.einsum("thd,tbd->thb", case["q"].double(), keys))
    logits = torch.einsum("th,thb->tb", case["weights"].double(), scores).float()
    return logits.to(torch.bfloat16).float() if round_bf16 else logits


def dense_selection(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Top ``k`` valid scores per row (ties → lower index), ascending, −1 padded; over the whole matrix."""
    ids = []
    for t in range(scores.shape[0]):
        candidates = [(-float(scores[t, b]), b) for b in range(scores.shape[1]) if valid[t, b]]
        chosen = sorted(b for _, b in sorted(candidates)[:k])
        ids.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(ids, dtype=torch.int64).view(scores.shape[0], k)


def random_selection_case(
    num_requests: int, num_tokens: int, max_rows: int, rows_per_block: int, dim: int, heads: int, *, seed: int
) -> dict:
    """A paged index-K pool with shuffled pages, queries, weights and per-token visible row counts."""
    gen = seeded_generator(seed)
    blocks_per_request = -(-max_rows // rows_per_block)
    num_blocks = num_requests * blocks_per_request + 3
    pages = torch.randperm(num_blocks, generator=gen)[: num_requests * blocks_per_request]
    block_table = pages.view(num_requests, blocks_per_request)
    pool = random_pool(num_blocks * rows_per_block, dim, dk.RowFormat.FP4_UE8M0, seed=seed + 2)
    fp4 = dk.RowFormat.FP4_UE8M0
    q = dk.decode_rows(dk.encode_rows(random_normal((num_tokens, heads, dim), seed=seed + 3), fp4), fp4)
    weights = random_normal((num_tokens, heads), seed=seed + 4)
    token_request = torch.randint(0, max(num_requests, 1), (num_tokens,), generator=gen)
    num_rows = torch.randint(0, max_rows + 1, (num_tokens,), generator=gen)
    return {
        "q": q,
        "weights": weights,
        "key_pool": pool,
        "block_table": block_table,
        "rows_per_block": rows_per_block,
        "token_request": token_request,
        "num_rows": num_rows,
        "max_rows": max_rows,
    }


def dense_candidate_blocks(logits: torch.Tensor, num_rows: torch.Tensor, block_size: int, k: int) -> torch.Tensor:
    """Best ``k`` blocks per query: max valid logit (capped at the BF16 max), the newest row's block forced in."""
    num_tokens, max_rows = logits.shape
    num_blocks = -(-max_rows // block_size)
    score = torch.full((num_tokens, num_blocks), -torch.inf)
    for t in range(num_tokens):
        for b in range(int(num_rows[t])):
            value = min(float(logits[t, b]), float(torch.finfo(torch.bfloat16).max))
            score[t, b // block_size] = max(float(score[t, b // block_size]), value)
        if num_rows[t] > 0:
            score[t, (int(num_rows[t]) - 1) // block_size] = torch.inf
    return dense_selection(score, score > -torch.inf, k)


def assert_equivalent_selection(actual: torch.Tensor, expected: torch.Tensor, scores: torch.Tensor, tol: float) -> None:
    """Two selections [T, k] (ascending ids, −1 at the end) agree up to near-ties of ``scores`` [T, n].

    Same number of ids per query; every id is real and distinct; the sorted scores of the chosen ids agree within
    ``tol`` (so swapping rows whose scores differ by less than ``tol`` is allowed); ids whose score is more than
    ``tol`` away from the k-th best are chosen by both.
    """
    assert actual.shape == expected.shape
    count = (actual >= 0).sum(dim=1)
    assert torch.equal(count, (expected >= 0).sum(dim=1)), "different numbers of selected ids"
    for t in range(actual.shape[0]):
        a, e = actual[t, : count[t]], expected[t, : count[t]]
        assert bool((actual[t, count[t] :] == -1).all()), f"query {t}: −1 entries not at the end"
        assert torch.equal(a, torch.sort(a).values) and a.unique().numel() == a.numel(), f"query {t}: ids {a}"
        sa, se = torch.sort(scores[t, a]).values, torch.sort(scores[t, e]).values
        assert bool(((sa - se).abs() <= tol).all()), f"query {t}: chosen scores differ beyond {tol}"
        if count[t]:
            kth = se[0]
            clear = e[scores[t, e] > kth + tol]
            assert bool(torch.isin(clear, a).all()), f"query {t}: a clearly better id was not chosen"
