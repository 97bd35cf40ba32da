"""Drafts for requests whose sampling reads their earlier tokens on the host: structured output, repetition /
presence / frequency penalties and golden tokens (CPU, tiny checkpoint). With temperature 0 drafting on gives the
tokens of drafting off, synchronous and asynchronous; the verify rows see the drafts before them as committed (the
grammar state after them, penalties counting them, golden tokens forcing them), checked where drafts are accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llm_support import make_llm, random_prompts
from test_speculative import _edited_checkpoint

from deepinfer_engine import LLM, GenerateOutput, SamplingParams
from deepinfer_engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput

# Zero final norms and no Markov bias: target and drafter logits are all zero, so both take token 0 greedily.
AGREEING = {"norm.weight": 0.0, "mtp.0.norm.weight": 0.0, "mtp.0.markov_head.head.weight": 0.0}
WORDS = {"schema_type": "regex", "schema": "[a-z]+( [a-z]+)*!"}


def _greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, **kwargs)


KINDS = {
    "grammar": _greedy(so_args=WORDS),
    "json": _greedy(so_args={"schema_type": "json", "schema": '{"type": "object"}'}),
    "repetition": _greedy(ignore_eos=True, repetition_penalty=1.5),
    "presence": _greedy(ignore_eos=True, presence_penalty=1.5),
    "frequency": _greedy(ignore_eos=True, frequency_penalty=-1.5),
    "golden": _greedy(ignore_eos=True, golden_token_ids=[7, 8, 9, 10, 11]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _tokens(outputs: list[GenerateOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def test_each_kind_drafts_and_equals_drafting_off(root: Path) -> None:
    prompts = random_prompts(3, 4, 20, seed=21)
    plain = make_llm(root, precision="fp32")
    engines = {mode: make_llm(root, precision="fp32", nextn=3, async_scheduling=mode) for mode in (False, True)}
    for name, params in KINDS.items():
        expected = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        for mode, llm in engines.items():
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            assert _tokens(outputs) == _tokens(expected), (name, mode)
            assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected], (name, mode)
            assert all(o.metrics.num_verified_draft_tokens > 0 for o in outputs), (name, mode)
    assert all(o.token_ids[:5] == (7, 8, 9, 10, 11) for o in expected)  # the last kind: golden


def test_accepted_drafts_meet_the_grammar_state_after_them(root: Path) -> None:
    # The agreeing checkpoint emits and drafts token 0 while the grammar waits for its trigger [0, 0, 0]. The trigger
    # completes inside a verify step, so the rows after it must be masked by the grammar (which forbids token 0).
    model = str(_edited_checkpoint(root, "agreeing-drafter", AGREEING))
    prompts = random_prompts(2, 4, 20, seed=22)
    params = [
        _greedy(so_args={**WORDS, "trigger_token_ids": [0, 0, 0]}),
        _greedy(so_args={**WORDS, "trigger_token_ids": [0, 0, 0, 0, 0]}),
    ]
    expected = make_llm(root, model=model).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids[:3] for o in expected] == [(0, 0, 0)] * 2
    assert all(0 not in o.token_ids[5:] and o.text.endswith("!") for o in expected)
    for mode in (False, True):
        llm = make_llm(root, model=model, nextn=3, async_scheduling=mode)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert _tokens(outputs) == _tokens(expected), mode
        assert all(o.metrics.num_accepted_draft_tokens >= 2 for o in outputs), mode


def test_drafts_equal_to_golden_tokens_are_accepted_and_others_corrected(root: Path) -> None:
    model = str(_edited_checkpoint(root, "agreeing-drafter", AGREEING))
    prompts = random_prompts(3, 4, 20, seed=23)
    golden = [0, 0, 0, 7, 0, 0, 0, 9, 0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, golden_token_ids=golden),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, golden_token_ids=golden[:4]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    expected = make_llm(root, model=model).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert expected[0].token_ids[: len(golden)] == tuple(golden)
    assert expected[1].token_ids[:4] == tuple(golden[:4])
    for mode in (False, True):
        llm = make_llm(root, model=model, nextn=3, async_scheduling=mode)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert _tokens(outputs) == _tokens(expected), mode
        # Drafts (all 0) are accepted where the golden token is 0 and rejected at 7 and 9.
        assert all(0 < o.metrics.num_accepted_draft_tokens < o.metrics.num_verified_draft_tokens for o in outputs[:2])


def _scheduled(prompt: list[int], params: SamplingParams, inputs: tuple[int, ...], drafts: int) -> ScheduledRequest:
    start = 0 if drafts == 0 else len(prompt)
    return ScheduledRequest(
        is_new=drafts == 0,
        input_token_ids=inputs,
        num_computed_tokens=start,
        num_draft_tokens=drafts,
        samples_token=True,
        first_new_block_index=0 if drafts == 0 else 2,
        new_block_ids=(1, 2) if drafts == 0 else (),
        request_id="penalised",
        num_prompt_tokens=len(prompt),
        state_slot=1,
        new_request=NewRequestData(params, 1, tuple(prompt)),
    )


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_penalty_rows_count_the_drafts_before_them(root: Path, penalty: str) -> None:
    # Zero target logits: the penalised greedy choice is the lowest id not generated yet, so after the prompt step's
    # token 0 the continuation is 1, 2, 3, 4 (EOS = 1 does not stop the runner). Verifying drafts [1, 2, 3] accepts
    # all three only if row j's penalty state holds drafts 1 … j.
    model = str(_edited_checkpoint(root, "agreeing-drafter", AGREEING))
    llm: LLM = make_llm(root, model=model, nextn=3)
    runner = llm.engine.runner
    prompt = random_prompts(1, 10, 10, seed=24)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **{penalty: 1.0})
    first = _scheduled(prompt, params, tuple(prompt), 0)
    out = runner.wait(runner.execute(SchedulerOutput(50_000, (first,), frozenset(), ())))
    assert out.sampled_token_ids[0] == (0,)
    step = _scheduled(prompt, params, (0, 1, 2, 3), 3)
    out = runner.wait(runner.execute(SchedulerOutput(50_001, (step,), frozenset(), ())))
    assert out.sampled_token_ids[0] == (1, 2, 3, 4)
    runner.wait(runner.execute(SchedulerOutput(50_002, (), frozenset({"penalised"}), ())))
