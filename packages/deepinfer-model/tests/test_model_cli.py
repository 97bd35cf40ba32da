"""Command line: write-checkpoint, inspect, and one-line errors with a non-zero exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_model.cli import main
from deepinfer_model.config import preset_json


def test_inspect_config_prints_layer_map_and_formats(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "YOCO: n_prefill_layer = 4: producer layers 0-3, consumer layers 4-6" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isdigit() or line.startswith("mtp.")}
    assert rows["2"][1:8] == ["C2", "2", "<-1", "source", "<-1", "-", "yes"]
    assert rows["5"][1:9] == ["C1", "1", "<-4", "source", "<-4", "<-4", "-", "consumer"]
    assert rows["mtp.0"][1] == "DSpark"
    assert "MXFP4 e2m1 packed" in out and "12,153,272" in out


def test_write_then_inspect_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert main(["write-checkpoint", "--config", "tiny", "--out", str(out), "--seed", "4"]) == 0
    assert "12,153,272 bytes (seed 4)" in capsys.readouterr().out
    assert main(["inspect", "--model", str(out)]) == 0
    assert "all tensors present and well-formed" in capsys.readouterr().out
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    assert main(["inspect", "--model", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint does not match the configuration") and err.count("\n") == 1


def test_config_file_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    data = json.loads(preset_json("tiny"))
    path.write_text(json.dumps(data))
    assert main(["inspect", "--config", str(path)]) == 0
    data["text_config"]["num_experts_per_tok"] = 99
    path.write_text(json.dumps(data))
    assert main(["inspect", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: config key 'text_config.num_experts_per_tok' = 99 is invalid: must be <= n_routed_experts (8)\n"
    )


def test_unknown_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["write-checkpoint", "--config", "no-such-preset", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config 'no-such-preset' is neither a preset") and err.count("\n") == 1


def test_module_entry_point_without_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "deepinfer_model", "inspect", "--model", "/nonexistent/checkpoint"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "error: checkpoint directory /nonexistent/checkpoint does not exist or is not a directory\n"
    assert "Traceback" not in result.stderr and result.stdout == ""
