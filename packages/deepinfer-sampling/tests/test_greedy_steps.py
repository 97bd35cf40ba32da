"""The greedy shortcuts against the general code on fresh random inputs, bit for bit: `verify_greedy` against
`verify_rejection` on one-hot targets, the all-greedy branch of `processed_logprobs` against the same rows in a mixed
batch, and `Sampler.processed_is_raw_argmax` against the processed distribution it stands for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_sampling import Sampler, SamplerConfig, SamplingBatch, SamplingParams, SamplingRow
from deepinfer_sampling.speculative import row_layout, verify_greedy, verify_rejection

V = 24
NEXTN = 4
GREEDY = SamplingParams(temperature=0.0)


def _one_hot_step(seed: int) -> dict[str, torch.Tensor]:
    """A packed step of greedy rows: one-hot targets (ties in the logits, some all −inf rows), drafts that are the
    argmax, another token or −1, and draft distributions of every kind (random, one-hot, zero)."""
    g = torch.Generator().manual_seed(seed)
    num_requests = 40
    num_drafts = torch.randint(0, NEXTN + 1, (num_requests,), generator=g)
    rows = int((num_drafts + 1).sum())
    logits = torch.randint(-3, 4, (rows, V), generator=g).float()  # small integers: ties at the maximum
    target = torch.full_like(logits, float("-inf")).scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
    target[torch.rand(rows, generator=g) < 0.1] = float("-inf")  # rows with nothing to sample
    kind = torch.randint(0, 3, (rows,), generator=g)
    drafts = torch.where(kind == 0, logits.argmax(-1), torch.randint(0, V, (rows,), generator=g))
    drafts = torch.where(kind == 2, -1, drafts)
    probs = torch.softmax(torch.randn(rows, V, generator=g), dim=-1)
    one_hot = torch.zeros(rows, V).scatter_(1, drafts.clamp(min=0)[:, None], 1.0)
    choice = torch.randint(0, 3, (rows, 1), generator=g)
    draft_probs = torch.where(choice == 0, probs, torch.where(choice == 1, one_hot, 0.0))
    forced = torch.where(torch.rand(rows, generator=g) < 0.2, torch.randint(0, V, (rows,), generator=g), -1)
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    positions = torch.randint(0, 1000, (rows,), generator=g)
    return {
        "target": target,
        "drafts": drafts,
        "draft_probs": draft_probs,
        "num_drafts": num_drafts,
        "seeds": seeds,
        "positions": positions,
        "forced": forced,
    }


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("penalty", [0.0, 5e-5])
@pytest.mark.parametrize("with_forced", [False, True])
def test_verify_greedy_equals_rejection_on_one_hot_targets(seed, penalty, with_forced):
    step = _one_hot_step(seed)
    forced = step["forced"] if with_forced else None
    general = verify_rejection(
        step["target"],
        step["drafts"],
        step["draft_probs"],
        step["num_drafts"],
        step["seeds"],
        step["positions"],
        forced_token_ids=forced,
        draft_prob_penalty=penalty,
    )
    layout = row_layout(step["num_drafts"], step["target"].shape[0])
    for given_layout in (None, layout):
        greedy = verify_greedy(
            step["target"], step["drafts"], step["num_drafts"], forced_token_ids=forced, layout=given_layout
        )
        assert torch.equal(greedy.output_token_ids, general.output_token_ids)
        assert torch.equal(greedy.num_accepted_draft_tokens, general.num_accepted_draft_tokens)
    assert general.num_accepted_draft_tokens.max() >= 2  # long accepted prefixes occur
    # accept_probs: q(x) on verify rows with a draft, 1 on fresh rows, 0 on rows without a draft.
    has_draft = ~layout.is_fresh & (step["drafts"] >= 0)
    q_of_draft = step["target"].exp().gather(1, step["drafts"].clamp(min=0)[:, None])[:, 0]
    expected = torch.where(has_draft, q_of_draft, layout.is_fresh.float())
    assert torch.equal(greedy.accept_probs, expected)


def _rows(params: list[SamplingParams], **row) -> list[SamplingRow]:
    return [SamplingRow(params=p, seed=11 * i + 5, position=30 + i, **row) for i, p in enumerate(params)]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_all_greedy_batches_give_the_rows_they_give_in_a_mixed_batch(batch_invariant):
    g = torch.Generator().manual_seed(3)
    config = SamplerConfig(backend="reference", batch_invariant=batch_invariant, banned_token_ids=(2, 9))
    sampler = Sampler(config, V, "cpu")
    greedy = [
        GREEDY,
        SamplingParams(temperature=0.0, first_n_token_no_eos=4, eos_id=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4),
    ] * 3
    sampled = SamplingParams(temperature=0.8, top_k=5)
    history = {"num_generated_tokens": 2, "output_token_ids": (4, 4), "prompt_token_ids": (7, 3)}
    logits = torch.randint(-3, 4, (len(greedy) + 1, V), generator=g).float()
    logits[4] = float("-inf")  # nothing to sample
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(greedy) + 1, 1), generator=g, dtype=torch.int32)
    alone = SamplingBatch.build(_rows(greedy, **history), V, "cpu")
    mixed = SamplingBatch.build(_rows([*greedy, sampled], **history), V, "cpu")
    assert alone.all_greedy and not mixed.all_greedy
    for mask in (None, bitmask):
        one_hot, invalid = sampler.processed_logprobs(logits[:-1], alone, None if mask is None else mask[:-1])
        reference, reference_invalid = sampler.processed_logprobs(logits, mixed, mask)
        assert torch.equal(one_hot, reference[:-1])
        assert torch.equal(invalid, reference_invalid[:-1])
    # The same rows with the all-greedy branch turned off give the same distributions too.
    general = dataclasses.replace(alone, all_greedy=False)
    assert torch.equal(
        sampler.processed_logprobs(logits[:-1], general)[0], sampler.processed_logprobs(logits[:-1], alone)[0]
    )


def _raw_argmax_logits(num_rows: int, seed: int) -> torch.Tensor:
    """Logits with ties at the maximum, ±0.0 maxima, and invalid rows (NaN, +inf, all −inf)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 4, (num_rows, V), generator=g).float()
    logits[0] = torch.where(logits[0] > 0, -0.0, logits[0])  # the maximum is −0.0 at some ids and +0.0 at others
    logits[0, 5] = 0.0
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    return logits


@pytest.mark.parametrize("force_top_k", [0, 3])
def test_processed_is_raw_argmax_holds_where_it_says(force_top_k):
    sampler = Sampler(SamplerConfig(backend="reference", force_top_k=force_top_k), V, "cpu")
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=-0.6, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, first_n_token_no_eos=2, eos_id=4),
        SamplingParams(temperature=0.0, golden_token_ids=(6, 6), top_logprobs=2),
    ] * 3
    rows = [dataclasses.replace(row, num_generated_tokens=2) for row in _rows(params)]
    assert sampler.processed_is_raw_argmax(rows)
    for seed in range(5):
        logits = _raw_argmax_logits(len(rows), seed)
        processed, invalid = sampler.processed_logprobs(logits, SamplingBatch.build(rows, V, "cpu"))
        raw_invalid = (~(logits < float("inf"))).any(-1) | (logits.amax(-1) == float("-inf"))
        assert torch.equal(invalid, raw_invalid)
        one_hot = torch.full_like(logits, float("-inf")).scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
        assert torch.equal(processed[~invalid], one_hot[~invalid])
        assert (processed[invalid] == float("-inf")).all()


def test_processed_is_raw_argmax_is_false_when_anything_moves_the_argmax():
    sampler = Sampler(SamplerConfig(backend="reference"), V, "cpu")
    banning = Sampler(SamplerConfig(backend="reference", banned_token_ids=(3,)), V, "cpu")
    assert sampler.processed_is_raw_argmax(_rows([GREEDY] * 2))
    assert sampler.processed_is_raw_argmax([])
    assert not banning.processed_is_raw_argmax(_rows([GREEDY]))
    assert not sampler.processed_is_raw_argmax(_rows([GREEDY, SamplingParams(temperature=0.5)]))
    assert not sampler.processed_is_raw_argmax(_rows([SamplingParams(temperature=0.0, first_n_token_no_eos=1)]))
    penalised = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sampler.processed_is_raw_argmax(_rows([penalised]))
    assert not sampler.processed_is_raw_argmax(_rows([penalised], num_generated_tokens=1, output_token_ids=(5,)))
    repeating = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert not sampler.processed_is_raw_argmax(_rows([repeating], prompt_token_ids=(5,)))
