"""SamplingParams / StructuredOutputSpec: defaults, normalisation, and one clear error per invalid value."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer_sampling import SAMPLING_EPS, SamplingParams, StructuredOutputSpec


def test_defaults_match_the_reference():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.top_logprobs) == (1.0, 1.0, -1, 16, 0)
    assert (p.ignore_eos, p.prompt_logprobs, p.first_n_token_no_eos, p.eos_id) == (False, False, 0, 0)
    assert p.so_args is None and p.seq_seed is None and p.golden_token_ids is None
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.n) == (0.0, 1.0, 0.0, 0.0, 1)
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.is_greedy and not p.has_penalties


@pytest.mark.parametrize("temperature", [0, 0.0, SAMPLING_EPS / 2])
def test_small_temperature_is_greedy_and_disables_truncation(temperature):
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.temperature == 0.0
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)


def test_validation_happens_before_the_greedy_rewrite():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=0, top_k=0)


def test_normalisation():
    p = SamplingParams(max_tokens=0, seq_seed=-1, golden_token_ids=[3, 4], stop_token_ids=[9], stop="END")
    assert p.max_tokens == 1
    assert p.seq_seed == 2**64 - 1
    assert p.golden_token_ids == (3, 4) and p.stop_token_ids == (9,) and p.stop == ("END",)
    assert SamplingParams(seq_seed=2**64 + 5).seq_seed == 5
    hash(p)  # frozen and made of tuples: shareable between requests


def test_so_args_mapping_becomes_a_spec():
    p = SamplingParams(so_args={"schema_type": "regex", "schema": "[a-z]+", "trigger_token_ids": [5, 6]})
    assert p.so_args == StructuredOutputSpec("regex", "[a-z]+", (5, 6), None)
    spec = StructuredOutputSpec("json_schema", '{"type": "object"}', trigger_token_ids=[1], bound_token_id=0)
    assert SamplingParams(so_args=spec).so_args is spec and spec.trigger_token_ids == (1,)


def test_params_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 2.0  # type: ignore[misc]


INVALID_VALUES = [
    ("temperature", -0.1, ValueError),
    ("temperature", float("nan"), ValueError),
    ("temperature", float("inf"), ValueError),
    ("temperature", "1", TypeError),
    ("top_p", 0.0, ValueError),
    ("top_p", 1.5, ValueError),
    ("top_p", -0.2, ValueError),
    ("top_k", 0, ValueError),
    ("top_k", -2, ValueError),
    ("top_k", 2**31, ValueError),
    ("top_k", 2.0, TypeError),
    ("top_k", True, TypeError),
    ("max_tokens", -1, ValueError),
    ("max_tokens", 2**31, ValueError),
    ("top_logprobs", -1, ValueError),
    ("top_logprobs", 1001, ValueError),
    ("first_n_token_no_eos", -1, ValueError),
    ("eos_id", -1, ValueError),
    ("ignore_eos", 1, TypeError),
    ("prompt_logprobs", "yes", TypeError),
    ("seq_seed", 1.5, TypeError),
    ("seq_seed", True, TypeError),
    ("golden_token_ids", [1, -2], ValueError),
    ("golden_token_ids", "abc", TypeError),
    ("stop_token_ids", [-1], ValueError),
    ("stop", [""], ValueError),
    ("stop", [3], ValueError),
    ("min_p", -0.1, ValueError),
    ("min_p", 1.1, ValueError),
    ("repetition_penalty", 0.0, ValueError),
    ("repetition_penalty", -1.0, ValueError),
    ("presence_penalty", 2.5, ValueError),
    ("presence_penalty", -2.5, ValueError),
    ("frequency_penalty", 3.0, ValueError),
    ("frequency_penalty", float("nan"), ValueError),
    ("n", 0, ValueError),
    ("so_args", "regex", TypeError),
]


@pytest.mark.parametrize(("field", "value", "error"), INVALID_VALUES, ids=[f"{f}={v!r}" for f, v, _ in INVALID_VALUES])
def test_invalid_value_names_the_field(field, value, error):
    with pytest.raises(error, match=field) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    offending = [value, *value] if isinstance(value, list) else [value]
    assert any(repr(v) in message or str(v) in message for v in offending), message


INVALID_SPECS = [
    ({"schema_type": "xml", "schema": "x"}, "schema_type"),
    ({"schema_type": "regex", "schema": ""}, "schema"),
    ({"schema_type": "regex"}, "schema"),
    ({"schema": "x"}, "schema_type"),
    ({"schema_type": "regex", "schema": "x", "serialized": "..."}, "serialized"),
    ({"schema_type": "regex", "schema": "x", "bound_token_ids": [1]}, "bound_token_ids"),
    ({"schema_type": "regex", "schema": "x", "extra": 1}, "extra"),
    ({"schema_type": "regex", "schema": "x", "trigger_token_ids": [1, -1]}, "trigger_token_ids"),
    ({"schema_type": "regex", "schema": "x", "trigger_token_ids": 5}, "trigger_token_ids"),
    ({"schema_type": "regex", "schema": "x", "bound_token_id": 3}, "bound_token_id"),
    ({"schema_type": "regex", "schema": "x", "trigger_token_ids": [1], "bound_token_id": -1}, "bound_token_id"),
    ({"schema_type": "regex", "schema": "x", "trigger_token_ids": [1], "bound_token_id": [2]}, "bound_token_id"),
]


@pytest.mark.parametrize(("so_args", "named"), INVALID_SPECS, ids=[n for _, n in INVALID_SPECS])
def test_invalid_so_args_name_the_key(so_args, named):
    with pytest.raises((ValueError, TypeError), match=named):
        SamplingParams(so_args=so_args)


@pytest.mark.parametrize(("given", "suggested"), [("seed", "seq_seed"), ("logprobs", "top_logprobs")])
def test_unknown_keyword_names_the_closest_field(given: str, suggested: str) -> None:
    with pytest.raises(TypeError, match=rf"unknown keyword argument\(s\) '{given}' \(did you mean '{suggested}'\?\)"):
        SamplingParams(**{given: 1})


def test_top_k_error_text_says_what_is_accepted() -> None:
    for bad in (0, -2):
        with pytest.raises(ValueError, match=r"top_k must be -1 \(disabled\) or an int in \[1, 2147483647\], got"):
            SamplingParams(top_k=bad)
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=1).top_k == 1
