"""Structured output through LLM.generate: grammar-constrained text is valid JSON, async == sync, and grammar
failures (bad schema, compile timeout) finish only their request with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_support import make_llm

from deepinfer_engine import FinishReason, SamplingParams

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
)
# Compact JSON as a regex: the random tiny model cannot wander into whitespace, so every request completes.
COMPACT_JSON = r'\{"color":"(red|green|blue)","ok":(true|false)\}'


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _check(value: object) -> None:
    assert isinstance(value, dict) and set(value) == {"color", "ok"}
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)


def test_json_outputs_are_valid_and_async_equals_sync(root: Path) -> None:
    params = [
        SamplingParams(temperature=0.7, max_tokens=96, seq_seed=i, so_args={"schema_type": "json", "schema": SCHEMA})
        for i in range(6)
    ]
    params += [
        SamplingParams(
            temperature=1.0, max_tokens=40, seq_seed=i, so_args={"schema_type": "regex", "schema": COMPACT_JSON}
        )
        for i in range(3)
    ]
    params.append(SamplingParams(temperature=1.0, max_tokens=8, seq_seed=9, ignore_eos=True))
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(root, precision="fp32", max_num_seqs=16, async_scheduling=async_scheduling)
        outputs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
        results.append([(o.token_ids, o.finish_reason) for o in outputs])
        schema_outputs, regex_outputs, free = outputs[:6], outputs[6:9], outputs[9]
        finished = [o for o in schema_outputs if o.finish_reason is FinishReason.STOP]
        assert len(finished) >= 3, [o.text for o in schema_outputs]
        for output in finished:
            _check(json.loads(output.text))
        for output in regex_outputs:
            assert output.finish_reason is FinishReason.STOP
            _check(json.loads(output.text))
        assert free.ok and len(free.token_ids) == 8
    assert results[0] == results[1]


def test_bad_schema_fails_only_its_request(root: Path) -> None:
    llm = make_llm(root, precision="fp32")
    params = [
        SamplingParams(max_tokens=4, so_args={"schema_type": "json", "schema": "{not json"}),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=20, so_args={"schema_type": "regex", "schema": "(yes|no)!"}),
    ]
    bad, good, regex = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert bad.finish_reason is FinishReason.STRUCTURED_OUTPUT_FAILED and bad.token_ids == ()
    assert bad.error_message is not None and bad.error_message.startswith("structured output failed (compile_error)")
    assert good.ok and len(good.token_ids) == 4
    assert regex.finish_reason is FinishReason.STOP and regex.text in ("yes!", "no!")


def test_compile_timeout_fails_only_its_request(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "0.001")
    llm = make_llm(root, precision="fp32")
    big = json.dumps(
        {
            "type": "object",
            "properties": {f"field_{i}": {"type": "array", "items": {"type": "number"}} for i in range(40)},
            "required": [f"field_{i}" for i in range(40)],
        }
    )
    params = [
        SamplingParams(max_tokens=4, so_args={"schema_type": "json", "schema": big}),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    slow, good = llm.generate(["a", "b"], params, use_tqdm=False)
    assert slow.finish_reason is FinishReason.STRUCTURED_OUTPUT_FAILED
    assert slow.error_message is not None and "(timeout)" in slow.error_message
    assert good.ok and len(good.token_ids) == 4


def test_structured_requests_survive_preemption(root: Path) -> None:
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=40, seq_seed=i, so_args={"schema_type": "regex", "schema": COMPACT_JSON}
        )
        for i in range(8)
    ]
    prompts = [[5 + i] * (10 + 3 * i) for i in range(8)]
    roomy = make_llm(root, precision="fp32").generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tight = make_llm(root, precision="fp32", block_size=4, num_cache_blocks=40)
    pressured = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in pressured) > 0
    assert [o.token_ids for o in pressured] == [o.token_ids for o in roomy]
    for output in pressured:
        _check(json.loads(output.text))


def test_a_row_with_nothing_left_to_sample_fails_only_its_request(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Ban every token whose text starts with "x": the grammar "x+" then allows nothing at the first step, so the
    # runner cannot sample for that request; it finishes with an error while the others complete.
    probe = make_llm(root, precision="fp32")
    vocab = probe.tokenizer.vocab_size
    banned = [t for t in range(3, vocab) if probe.tokenizer.decode([t]).startswith("x")]
    assert banned
    monkeypatch.setenv("DEEPINFER_DECODE_TOKEN_BLACKLIST", ",".join(map(str, banned)))
    llm = make_llm(root, precision="fp32")
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "x+"}),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    before, stuck, after = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert stuck.finish_reason is FinishReason.ERROR
    assert stuck.error_message == "no token could be sampled: every logit was masked or not finite"
    assert stuck.token_ids == () and stuck.logprobs == ()  # no fake token is kept
    assert before.ok and after.ok and len(before.token_ids) == len(after.token_ids) == 4
    assert llm.engine.cache_manager.num_free_blocks == llm.engine.cache_manager.num_usable_blocks
