"""A training run of tools/train_tiny.py split by ``--stop-after`` and resumed from ``--state`` writes the same
checkpoint, byte for byte, as the run done in one go (tools/tiny_resume.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT_RUN = "--seq-len 96 --target-steps 3 --draft-steps 2 --warmup 1 --fake-quant-steps 1 --anchors 16"


def _train(out: Path, *extra: str) -> str:
    command = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), *SHORT_RUN.split(), "--eval-per-task", "1"]
    command += ["--out", str(out / "ck"), "--data-dir", str(out / "data"), *extra]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_a_stopped_and_resumed_run_writes_the_same_checkpoint(tmp_path: Path) -> None:
    _train(tmp_path / "whole")
    state = str(tmp_path / "split" / "state")
    stopped = _train(tmp_path / "split", "--state", state, "--stop-after", "0")
    assert "saved target step 1" in stopped
    assert not (tmp_path / "split" / "ck").exists()
    resumed = _train(tmp_path / "split", "--state", state)
    assert "resuming from" in resumed
    weights = "model-00001-of-00001.safetensors"
    whole = (tmp_path / "whole" / "ck" / weights).read_bytes()
    assert (tmp_path / "split" / "ck" / weights).read_bytes() == whole
