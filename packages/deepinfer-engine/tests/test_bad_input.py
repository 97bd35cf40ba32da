"""Bad input to LLM.generate: the offending request finishes with an error finish reason and a message naming the
problem; every other request of the call completes normally and no request is dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llm_support import make_llm

from deepinfer_engine import LLM, FinishReason, GenerateOutput, SamplingParams

GOOD = [5, 6, 7, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_llm(tmp_path_factory.mktemp("deepinfer-cache"), max_model_len=64)


def _run(llm: LLM, prompts: list[list[int]], params: Any = PARAMS) -> list[GenerateOutput]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert len(outputs) == len(prompts), "no request may be dropped"
    return outputs


def _assert_good(output: GenerateOutput) -> None:
    assert output.ok and len(output.token_ids) == 3 and output.error_message is None


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    outputs = _run(llm, [GOOD, list(range(3, 3 + 65)), GOOD])
    _assert_good(outputs[0])
    _assert_good(outputs[2])
    bad = outputs[1]
    assert bad.finish_reason is FinishReason.PROMPT_LENGTH_EXCEEDED and bad.token_ids == ()
    assert bad.error_message is not None and "65 tokens exceeds max_model_len=64" in bad.error_message


def test_out_of_vocabulary_token_ids(llm: LLM) -> None:
    outputs = _run(llm, [[5, 1024, 6, -1], GOOD])
    assert outputs[0].finish_reason is FinishReason.ERROR
    assert outputs[0].error_message == "prompt token ids [1024, -1] are outside the vocabulary [0, 1024)"
    _assert_good(outputs[1])


def test_empty_prompt(llm: LLM) -> None:
    outputs = _run(llm, [GOOD, []])
    _assert_good(outputs[0])
    assert outputs[1].finish_reason is FinishReason.ERROR and outputs[1].error_message == "prompt must not be empty"


def test_invalid_sampling_parameters_per_prompt(llm: LLM) -> None:
    params: list[Any] = [
        {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True},
        {"temperature": -1.0},
        {"top_k": 0},
        {"no_such_field": 1},
        SamplingParams(n=2),
        PARAMS,
    ]
    outputs = _run(llm, [GOOD] * len(params), params)
    _assert_good(outputs[0])
    _assert_good(outputs[5])
    messages = [o.error_message for o in outputs[1:5]]
    assert all(o.finish_reason is FinishReason.ERROR for o in outputs[1:5])
    assert messages[0] is not None and "temperature must be >= 0" in messages[0]
    assert messages[1] is not None and "top_k must be -1 (disabled)" in messages[1]
    assert messages[2] is not None and "no_such_field" in messages[2]
    assert messages[3] is not None and "only n=1 is supported" in messages[3]


def test_call_level_mistakes_raise(llm: LLM) -> None:
    with pytest.raises(ValueError, match="needs prompts or prompt_token_ids"):
        llm.generate(use_tqdm=False)
    with pytest.raises(ValueError, match="prompts has 2 entries but prompt_token_ids has 1"):
        llm.generate(["a", "b"], prompt_token_ids=[GOOD], use_tqdm=False)
    with pytest.raises(ValueError, match="3 sampling params for 2 prompts"):
        llm.generate(["a", "b"], [PARAMS] * 3, use_tqdm=False)


def test_cache_too_small_for_max_model_len(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not fit the cache"):
        make_llm(tmp_path, max_model_len=4000, num_cache_blocks=8)
