"""The `deepinfer-engine generate` command line: output, error lines and exit statuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_engine.cli import main


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["generate", "--cache-dir", str(tmp_path), "--device", "cpu", "--no-progress", *extra]


def test_generate_prints_one_json_line_per_prompt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = _args(tmp_path, "--prompt", "Hello", "--prompt", "World", "--max-tokens", "3", "--temperature", "0")
    assert main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["Hello", "World"]
    assert all(len(r["token_ids"]) == 3 and r["finish_reason"] == "length" for r in records)
    assert main(argv) == 0
    plain = capsys.readouterr().out.splitlines()
    assert plain[0].startswith("'Hello' -> ") and plain[0].endswith("[length]")


def test_missing_checkpoint_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path, "--model", str(tmp_path / "absent"), "--prompt", "x")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deepinfer-engine: error: ") and "absent" in err[0]


def test_invalid_sampling_argument_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path, "--prompt", "x", "--top-p", "1.5")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["deepinfer-engine: error: top_p must be in (0, 1] (1 disables), got 1.5"]


def test_bad_json_schema_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args(tmp_path, "--prompt", "x", "--json-schema", "{not json")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--json-schema is not valid JSON" in err[0]


def test_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate"])
    assert info.value.code == 2


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer_engine", "generate", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "--json-schema" in result.stdout
