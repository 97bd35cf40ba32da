"""The DEEPINFER_* declarations: parsing, validation errors, unsupported variables and docs/env.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_engine.envs import ENV_VARS, EnvStatus, markdown_table, read_env

DOCS = Path(__file__).resolve().parents[3] / "docs" / "env.md"


def test_defaults_when_unset() -> None:
    settings = read_env({})
    assert settings["DEEPINFER_BATCH_INVARIANT"] is False
    assert settings["DEEPINFER_ZERO_OVERHEAD_SCHEDULING"] is True
    assert settings["DEEPINFER_XGRAMMAR_TIMEOUT"] == 20.0
    assert settings["DEEPINFER_HF_MODEL_DIR"] is None


@pytest.mark.parametrize(("text", "expected"), [("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)])
def test_booleans(text: str, expected: bool) -> None:
    assert read_env({"DEEPINFER_BATCH_INVARIANT": text})["DEEPINFER_BATCH_INVARIANT"] is expected


def test_empty_value_means_default() -> None:
    assert read_env({"DEEPINFER_ZERO_OVERHEAD_SCHEDULING": ""})["DEEPINFER_ZERO_OVERHEAD_SCHEDULING"] is True


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DEEPINFER_BATCH_INVARIANT", "maybe", "expected a boolean"),
        ("DEEPINFER_XGRAMMAR_TIMEOUT", "soon", "expected a number"),
        ("DEEPINFER_XGRAMMAR_TIMEOUT", "0", "must be >= 0.001"),
        ("DEEPINFER_SO_BUILDER_CPUS", "1.5", "expected an integer"),
        ("DEEPINFER_NUM_STATE_SLOTS_RATIO", "0.5", "must be >= 1.0"),
        ("DEEPINFER_ACCELERATOR", "bogus", "expected one of 'nvidia', 'ascend', 'cpu'"),
    ],
)
def test_invalid_value_names_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=name) as info:
        read_env({name: value})
    assert message in str(info.value)


def test_unsupported_variable_set_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"DEEPINFER_PREFILL_STORE_EXTRA_STATE.*not supported.*external KV store"):
        read_env({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "1"})


def test_unsupported_variable_at_its_default_is_accepted() -> None:
    read_env({"DEEPINFER_PREFILL_STORE_EXTRA_STATE": "0", "DEEPINFER_USE_NEXTN_DECODE": "0"})


def test_yoco_prefill_truncation_variables_are_parsed() -> None:
    settings = read_env(
        {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "Compact", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "140"}
    )
    assert settings["DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE"] == "compact"
    assert settings["DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"] == 140
    with pytest.raises(ValueError, match=r"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE='trim'.*'off', 'mask', 'compact'"):
        read_env({"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "trim"})


def test_not_applicable_variable_is_accepted(recwarn: pytest.WarningsRecorder) -> None:
    read_env({"DEEPINFER_XGRAMMAR_DEBUG": "1"})
    assert not recwarn.list  # a declared variable, so no "unknown variable" warning


def test_unknown_name_lookup_is_an_error() -> None:
    with pytest.raises(KeyError, match="DEEPINFER_CPP_LOG_LEVEL is not a supported"):
        read_env({})["DEEPINFER_CPP_LOG_LEVEL"]


def test_names_are_unique_and_documented() -> None:
    names = [var.name for var in ENV_VARS]
    assert len(names) == len(set(names))
    for var in ENV_VARS:
        assert var.name.startswith("DEEPINFER_") and var.doc
        assert var.status is EnvStatus.SUPPORTED or var.note, f"{var.name} needs a reason"


def test_docs_env_md_holds_the_current_table() -> None:
    assert markdown_table() in DOCS.read_text(), "regenerate with: python -m deepinfer_engine.envs"
