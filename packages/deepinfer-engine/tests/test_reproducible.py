"""The deterministic recipe on the CPU (tiny checkpoint, drafting on): with `DEEPINFER_BATCH_INVARIANT=1`,
`DEEPINFER_ENABLE_MTP_VARLEN=0` and a fixed `seq_seed`, a request's tokens are the same alone, at any position of
batches of other requests, in fresh engines, with synchronous and asynchronous scheduling; a prompt with its own
parameters keeps its tokens wherever it sits in the call."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts
from test_speculative import _edited_checkpoint

from deepinfer_engine import GenerateOutput, SamplingParams

# Zero final norms and no Markov bias: the drafter and the target agree, so sampled drafts are accepted.
AGREEING = {"norm.weight": 0.0, "mtp.0.norm.weight": 0.0, "mtp.0.markov_head.head.weight": 0.0}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


@pytest.fixture
def recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")


def _tokens(outputs: list[GenerateOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def test_request_tokens_do_not_depend_on_the_batch_or_the_engine(root: Path, recipe: None) -> None:
    prompt = random_prompts(1, 17, 17, seed=30)[0]
    target = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seq_seed=1234, ignore_eos=True)
    others = random_prompts(7, 3, 40, seed=31)
    other_params = [
        SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=0.5 + 0.1 * i, top_k=20 * i, max_tokens=4 + 2 * i, seq_seed=i)
        for i in range(7)
    ]
    # The exact compute mode's CPU forward is batch-invariant too: the log-probs agree bit for bit.
    runs: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
    for async_scheduling in (False, True):
        llm = make_llm(root, nextn=3, async_scheduling=async_scheduling)
        alone = llm.generate(prompt_token_ids=[prompt], sampling_params=[target], use_tqdm=False)[0]
        runs.append((alone.token_ids, alone.logprobs))
        for position in (0, 3, 7):
            prompts = [*others[:position], prompt, *others[position:]]
            params = [*other_params[:position], target, *other_params[position:]]
            output = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[position]
            runs.append((output.token_ids, output.logprobs))
        assert alone.metrics.num_verified_draft_tokens > 0
    fresh = make_llm(root, nextn=3, max_num_seqs=4).generate(
        prompt_token_ids=[prompt], sampling_params=target, use_tqdm=False
    )[0]
    runs.append((fresh.token_ids, fresh.logprobs))
    assert len(runs[0][0]) == 12
    assert all(run == runs[0] for run in runs)


def test_prompt_with_its_own_seeded_params_keeps_its_tokens_at_any_index(root: Path) -> None:
    llm = make_llm(root)
    prompts = random_prompts(4, 5, 20, seed=32)
    own = [SamplingParams(temperature=1.0, max_tokens=8, seq_seed=77, ignore_eos=True) for _ in range(4)]
    forward = llm.generate(prompt_token_ids=prompts, sampling_params=own, use_tqdm=False)
    backward = llm.generate(prompt_token_ids=prompts[::-1], sampling_params=own, use_tqdm=False)
    assert _tokens(forward) == _tokens(backward)[::-1]
    # One object shared by several prompts: each of them gets its own stream (the same prompt gives other tokens).
    shared = own[0]
    repeated = llm.generate(prompt_token_ids=[prompts[0]] * 3, sampling_params=shared, use_tqdm=False)
    assert repeated[0].token_ids == forward[0].token_ids
    assert len({o.token_ids for o in repeated}) == 3
    # The same object twice in a per-prompt list is shared too; separate equal objects are not.
    twice = llm.generate(prompt_token_ids=[prompts[0]] * 2, sampling_params=[shared, shared], use_tqdm=False)
    assert _tokens(twice) == _tokens(repeated[:2])
    equal = llm.generate(prompt_token_ids=[prompts[0]] * 2, sampling_params=own[:2], use_tqdm=False)
    assert _tokens(equal) == [list(forward[0].token_ids)] * 2


def test_asynchronous_scheduling_near_max_tokens_gives_the_tokens_of_synchronous(root: Path) -> None:
    # Every sampled draft of the agreeing checkpoint is accepted, so near max_tokens a request in flight would verify
    # more drafts than synchronous scheduling (it is planned from the least its step in flight emits); a position
    # scored as a verify row draws other random numbers than the fresh row synchronous scheduling gives it.
    model = str(_edited_checkpoint(root, "agreeing-drafter", AGREEING))
    prompts = random_prompts(6, 4, 20, seed=33)
    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seq_seed=50 + max_tokens, ignore_eos=True)
        for max_tokens in range(5, 11)
    ]
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(root, model=model, nextn=3, async_scheduling=async_scheduling)
        results.append(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    sync, asynchronous = results
    assert _tokens(asynchronous) == _tokens(sync)
    assert [o.metrics.num_accepted_draft_tokens for o in asynchronous] == [
        o.metrics.num_accepted_draft_tokens for o in sync
    ]
    assert all(o.metrics.num_accepted_draft_tokens > 0 for o in sync)
