"""Speculative verification: losslessness (chi-square), argmax matching on greedy rows, layout and keying."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from deepinfer_sampling.speculative import redistribute_verified_drafts, row_layout, verify_rejection

V = 10
K = 3
N = 20_000
P_VALUE_FLOOR = 1e-4  # fixed seeds make every test deterministic; this only guards against an unlucky seed choice


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.to(torch.float64), dim=-1).to(torch.float32)


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(target probs [K + 1, V], draft probs [K, V]) for one scenario."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    target = _softmax(torch.randn(K + 1, V, generator=g) * 1.5)
    if name == "random":
        draft = _softmax(torch.randn(K, V, generator=g) * 1.5)
    elif name == "equal":
        draft = target[:K].clone()
    elif name == "draft_mass_where_target_has_none":
        target[:, V // 2 :] = 0.0  # as after a grammar mask or top-k
        target /= target.sum(-1, keepdim=True)
        draft = _softmax(torch.randn(K, V, generator=g))
        draft[:, V // 2 :] *= 50.0
        draft /= draft.sum(-1, keepdim=True)
    elif name == "certain_but_wrong":
        target[:, V - 1] = 0.0
        target /= target.sum(-1, keepdim=True)
        draft = torch.zeros(K, V)
        draft[:, V - 1] = 1.0  # the reference's pad draft
    elif name == "peaked_target":
        target = torch.zeros(K + 1, V)
        target[torch.arange(K + 1), torch.tensor([3, 1, 4, 1])] = 1.0
        draft = _softmax(torch.randn(K, V, generator=g))
    else:
        raise AssertionError(name)
    return target, draft


def _run(target: torch.Tensor, draft: torch.Tensor, penalty: float, seed_offset: int = 0):
    """N independent requests, each verifying K drafts sampled from ``draft``; returns tokens [N, K + 1], accepted."""
    g = torch.Generator().manual_seed(1234 + seed_offset)
    drafts = torch.stack([torch.multinomial(draft[j], N, replacement=True, generator=g) for j in range(K)], dim=1)
    draft_rows = torch.cat([drafts, torch.full((N, 1), -1)], dim=1).flatten()
    draft_prob_rows = torch.cat([draft, torch.zeros(1, V)]).repeat(N, 1)
    target_rows = torch.log(target).repeat(N, 1)
    seeds = torch.arange(N, dtype=torch.int64).repeat_interleave(K + 1) + 7919 * seed_offset
    positions = (100 + torch.arange(K + 1)).repeat(N)
    out = verify_rejection(
        target_rows,
        draft_rows,
        draft_prob_rows,
        torch.full((N,), K),
        seeds,
        positions,
        draft_prob_penalty=penalty,
    )
    return out.output_token_ids.view(N, K + 1), out.num_accepted_draft_tokens, drafts, out.accept_probs.view(N, K + 1)


def _assert_distribution(samples: torch.Tensor, probs: torch.Tensor, label: str) -> None:
    counts = torch.bincount(samples, minlength=V).to(torch.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, f"{label}: tokens with zero target mass were emitted: {counts}"
    if support.sum() > 1:
        observed = counts[support].numpy()
        p64 = probs[support].to(torch.float64)
        expected = (p64 / p64.sum() * counts.sum()).numpy()
        result = stats.chisquare(observed, expected)
        assert result.pvalue > P_VALUE_FLOOR, f"{label}: chi-square p={result.pvalue:.2e}, counts {counts.tolist()}"


CASES = ["random", "equal", "draft_mass_where_target_has_none", "certain_but_wrong", "peaked_target"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("penalty", [0.0, 5e-5])
def test_emitted_tokens_follow_the_target_distribution(case, penalty):
    if case == "equal" and penalty == 0.0:
        pytest.skip("p = q with no penalty leaves an empty residual; the penalty exists for exactly this case")
    target, draft = _case(case)
    tokens, num_accepted, drafts, _ = _run(target, draft, penalty)
    # Position 0: always emitted.
    _assert_distribution(tokens[:, 0], target[0], f"{case} position 0")
    # Position m > 0 exists iff drafts 1..m were accepted; then the prefix is the drafts and token m ~ q_m.
    for m in range(1, K + 1):
        reached = num_accepted >= m
        assert torch.equal(tokens[reached, :m], drafts[reached, :m])
        if reached.sum() >= 1000:
            _assert_distribution(tokens[reached, m], target[m], f"{case} position {m}")
    assert (tokens[torch.arange(N), num_accepted] >= 0).all()
    beyond = torch.arange(K + 1)[None, :] > num_accepted[:, None]
    assert (tokens[beyond] == -1).all()


@pytest.mark.parametrize("case", ["random", "draft_mass_where_target_has_none", "equal"])
def test_acceptance_statistics(case):
    penalty = 5e-5
    target, draft = _case(case)
    _, num_accepted, _, accept_probs = _run(target, draft, penalty, seed_offset=1)
    beta = torch.minimum(target[:K].double(), math.exp(-penalty) * draft.double()).sum(-1)
    # The reported accept probability of a verify row is 1 - residual mass = Σ min(q, αp).
    assert (accept_probs[0, :K].double() - beta).abs().max() < 1e-6
    assert (accept_probs[:, K] == 1).all()
    # Acceptances of different rows are independent here, so P(a >= m) = β_0 ⋯ β_{m-1}.
    for m in range(1, K + 1):
        expected = float(torch.prod(beta[:m]))
        observed = float((num_accepted >= m).double().mean())
        sigma = math.sqrt(max(expected * (1 - expected), 1e-12) / N)
        assert abs(observed - expected) <= 5 * sigma + 1e-9, (m, observed, expected)
    if case == "equal":
        assert float((num_accepted == K).double().mean()) > 0.999


def _one_hot_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """A greedy row's processed distribution: log-prob 0 on the argmax (ties → lowest id), −inf elsewhere."""
    return torch.full_like(logits, float("-inf")).scatter_(1, logits.argmax(-1, keepdim=True), 0.0)


def _argmax_matching(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> tuple[list, list]:
    """(output ids, accepted per request) of greedy verification, request by request."""
    argmax, outputs, accepted, row = logits.argmax(-1).tolist(), [], [], 0
    for d in num_drafts.tolist():
        kept = 0
        while kept < d and drafts[row + kept] == argmax[row + kept]:
            kept += 1
        outputs += [argmax[r] if r - row <= kept else -1 for r in range(row, row + d + 1)]
        accepted.append(kept)
        row += d + 1
    return outputs, accepted


def test_one_hot_targets_reduce_to_argmax_matching():
    target_logits = torch.tensor(
        [
            [0.0, 2.0, 1.0, 2.0],  # argmax 1 (tie with 3 → lowest id)
            [5.0, 0.0, 0.0, 0.0],  # argmax 0
            [0.0, 0.0, 0.0, 9.0],  # argmax 3 (fresh row of request 0)
            [0.0, 0.0, 7.0, 0.0],  # request 1 has no drafts: fresh row, argmax 2
            [1.0, 0.0, 0.0, 0.0],  # request 2 verify row: draft 2 ≠ argmax 0
            [0.0, 3.0, 0.0, 0.0],  # request 2 fresh row (not reached)
        ]
    )
    drafts = torch.tensor([1, 0, -1, -1, 2, -1])
    draft_probs = torch.full((6, 4), 0.25)
    seeds = torch.arange(6)
    out = verify_rejection(_one_hot_logprobs(target_logits), drafts, draft_probs, torch.tensor([2, 0, 1]), seeds, seeds)
    assert out.num_accepted_draft_tokens.tolist() == [2, 0, 0]
    assert out.output_token_ids.tolist() == [1, 0, 3, 2, 0, -1]


def test_rejection_with_one_hot_targets_equals_argmax_matching():
    g = torch.Generator().manual_seed(5)
    num_requests = 64
    num_drafts = torch.randint(0, K + 1, (num_requests,), generator=g)
    rows = int((num_drafts + 1).sum())
    logits = torch.randn(rows, V, generator=g)
    draft_probs = _softmax(torch.randn(rows, V, generator=g))
    # Half the drafts are the argmax, so long accepted prefixes occur.
    drafts = torch.where(torch.rand(rows, generator=g) < 0.5, logits.argmax(-1), torch.randint(0, V, (rows,)))
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    rejection = verify_rejection(_one_hot_logprobs(logits), drafts, draft_probs, num_drafts, seeds, torch.arange(rows))
    outputs, accepted = _argmax_matching(logits, drafts, num_drafts)
    assert rejection.output_token_ids.tolist() == outputs
    assert rejection.num_accepted_draft_tokens.tolist() == accepted
    assert max(accepted) >= 2


def _random_step(num_requests: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, K + 1, (num_requests,), generator=g)
    rows = int((num_drafts + 1).sum())
    target = torch.log(_softmax(torch.randn(rows, V, generator=g)))
    draft_probs = _softmax(torch.randn(rows, V, generator=g))
    drafts = torch.multinomial(draft_probs, 1, generator=g)[:, 0]
    request_seeds = torch.randint(0, 2**62, (num_requests,), generator=g)
    layout = row_layout(num_drafts, rows)
    seeds = request_seeds[layout.row_to_request]
    positions = 50 + 3 * layout.row_to_request + layout.row_offset
    return target, drafts, draft_probs, num_drafts, seeds, positions, layout


def test_results_do_not_depend_on_batch_composition():
    target, drafts, draft_probs, num_drafts, seeds, positions, layout = _random_step(24, 11)
    batch = verify_rejection(target, drafts, draft_probs, num_drafts, seeds, positions)
    for request in range(24):
        rows = layout.row_to_request == request
        alone = verify_rejection(
            target[rows],
            drafts[rows],
            draft_probs[rows],
            num_drafts[request : request + 1],
            seeds[rows],
            positions[rows],
        )
        assert torch.equal(alone.output_token_ids, batch.output_token_ids[rows])
        assert alone.num_accepted_draft_tokens.item() == batch.num_accepted_draft_tokens[request].item()
    # Reversed request order gives each request the same tokens.
    order = torch.cat([torch.nonzero(layout.row_to_request == r).flatten() for r in reversed(range(24))])
    reversed_out = verify_rejection(
        target[order], drafts[order], draft_probs[order], num_drafts.flip(0), seeds[order], positions[order]
    )
    assert torch.equal(reversed_out.output_token_ids, batch.output_token_ids[order])


def test_row_layout():
    layout = row_layout(torch.tensor([2, 0, 1]), 6)
    assert layout.row_to_request.tolist() == [0, 0, 0, 1, 2, 2]
    assert layout.row_offset.tolist() == [0, 1, 2, 0, 0, 1]
    assert layout.is_fresh.tolist() == [False, False, True, True, False, True]


def test_forced_tokens_override_verification():
    target, drafts, draft_probs, num_drafts, seeds, positions, layout = _random_step(16, 3)
    forced = torch.where(layout.row_offset % 2 == 0, drafts, -1)
    forced[layout.is_fresh] = 7
    out = verify_rejection(target, drafts, draft_probs, num_drafts, seeds, positions, forced_token_ids=forced)
    emitted = out.output_token_ids >= 0
    forced_rows = emitted & (forced >= 0)
    assert torch.equal(out.output_token_ids[forced_rows], forced[forced_rows])
    # A forced verify row equal to its draft is always accepted.
    on_even_verify = (layout.row_offset == 0) & ~layout.is_fresh
    assert (out.num_accepted_draft_tokens[layout.row_to_request[on_even_verify]] >= 1).all()


def test_sentinel_draft_is_rejected_and_resampled_from_target():
    target = torch.log(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))
    out = verify_rejection(
        target,
        torch.tensor([-1, -1]),
        torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]),
        torch.tensor([1]),
        torch.tensor([9, 9]),
        torch.tensor([4, 5]),
    )
    assert out.num_accepted_draft_tokens.tolist() == [0]
    assert out.output_token_ids.tolist() == [1, -1]


def test_bad_inputs_are_rejected():
    target, drafts, draft_probs, num_drafts, seeds, positions, _ = _random_step(4, 2)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection(target, drafts, draft_probs[:, :-1], num_drafts, seeds, positions)
    with pytest.raises(ValueError, match="positions"):
        verify_rejection(target, drafts, draft_probs, num_drafts, seeds, positions[:-1])
    with pytest.raises(ValueError, match="draft_prob_penalty"):
        verify_rejection(target, drafts, draft_probs, num_drafts, seeds, positions, draft_prob_penalty=-1.0)


@pytest.mark.gpu
def test_verification_does_not_sync_with_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, drafts, draft_probs, num_drafts, seeds, positions, _ = _random_step(32, 8)
    tensors = [t.cuda() for t in (target, drafts, draft_probs, num_drafts, seeds, positions)]
    verify_rejection(*tensors)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = verify_rejection(*tensors)
        confidences = torch.rand(32, K, device="cuda")
        redistributed = redistribute_verified_drafts(confidences, confidences[:, 0] > 0.2, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = verify_rejection(target, drafts, draft_probs, num_drafts, seeds, positions)
    assert torch.equal(out.num_accepted_draft_tokens.cpu(), cpu.num_accepted_draft_tokens)
    assert int(redistributed.sum()) == 40


def test_verification_on_the_samplers_processed_distribution():
    """Target rows processed by the sampler (grammar bitmask, temperature, top-k): the emitted first token follows
    the processed distribution, and grammar-invalid drafts are never accepted."""
    from deepinfer_sampling import Sampler, SamplerConfig, SamplingBatch, SamplingParams, SamplingRow, request_seed
    from deepinfer_sampling.structured import allocate_token_bitmask

    num_requests = 8000
    g = torch.Generator().manual_seed(21)
    params = SamplingParams(temperature=0.7, top_k=4, seq_seed=5)
    rows = [
        SamplingRow(params, request_seed(5, index_in_call=r, engine_seed=0, request_counter=0), position=100 + j)
        for r in range(num_requests)
        for j in range(K + 1)
    ]
    batch = SamplingBatch.build(rows, V, "cpu")
    logits = torch.randn(K + 1, V, generator=g).repeat(num_requests, 1)
    bitmask = allocate_token_bitmask(len(rows), V)
    bitmask[:, 0] = (1 << 7) - 1  # the grammar allows tokens 0..6 only
    target, invalid = Sampler(SamplerConfig(backend="reference"), V, "cpu").processed_logprobs(logits, batch, bitmask)
    assert not invalid.any()
    draft = _softmax(torch.randn(K, V, generator=g))  # puts mass on grammar-invalid tokens too
    drafts = torch.stack([torch.multinomial(draft[j], num_requests, True, generator=g) for j in range(K)], dim=1)
    draft_rows = torch.cat([drafts, torch.full((num_requests, 1), -1)], dim=1).flatten()
    out = verify_rejection(
        target,
        draft_rows,
        torch.cat([draft, torch.zeros(1, V)]).repeat(num_requests, 1),
        torch.full((num_requests,), K),
        batch.seeds,
        batch.positions,
    )
    tokens = out.output_token_ids.view(num_requests, K + 1)
    _assert_distribution(tokens[:, 0], torch.exp(target[0]), "processed position 0")
    emitted = tokens[tokens >= 0]
    assert (emitted < 7).all()
    accepted_drafts = drafts[torch.arange(K)[None, :] < out.num_accepted_draft_tokens[:, None]]
    assert (accepted_drafts < 7).all() and accepted_drafts.numel() > 0


def test_request_without_drafts_gets_the_plain_samplers_token():
    """The fresh row draws from stream SAMPLE, so verifying zero drafts equals normal sampling bit for bit."""
    from deepinfer_sampling import Sampler, SamplerConfig, SamplingBatch, SamplingParams, SamplingRow, request_seed

    g = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.9, top_p=0.8, seq_seed=77)
    rows = [
        SamplingRow(params, request_seed(77, index_in_call=r, engine_seed=0, request_counter=0), 30 + r)
        for r in range(64)
    ]
    batch = SamplingBatch.build(rows, V, "cpu")
    logits = torch.randn(64, V, generator=g)
    sampler = Sampler(SamplerConfig(backend="reference"), V, "cpu")
    target, _ = sampler.processed_logprobs(logits, batch)
    out = verify_rejection(
        target,
        torch.full((64,), -1),
        torch.zeros(64, V),
        torch.zeros(64, dtype=torch.int64),
        batch.seeds,
        batch.positions,
    )
    assert torch.equal(out.output_token_ids, sampler(logits, batch).token_ids)
    assert (out.num_accepted_draft_tokens == 0).all()
