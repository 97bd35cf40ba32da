"""tools/train_tiny.py end to end on the CPU with a few steps: it writes a checkpoint the ordinary loader accepts,
the held-out files and a training summary, and a run split by ``--stop-after`` and resumed from ``--state`` writes the
same checkpoint as the run in one go (slow: about a minute a run on two cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference_values import values_from_stored

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_few_training_steps_write_a_loadable_checkpoint(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(ROOT / "tools" / "train_tiny.py"),
        *("--out", str(tmp_path / "ckpt"), "--data-dir", str(tmp_path / "data")),
        *("--target-steps", "2", "--draft-steps", "1", "--seq-len", "128", "--warmup", "1"),
        *("--fake-quant-steps", "1", "--anchors", "16", "--eval-per-task", "1"),
    ]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    checkpoint = load_checkpoint_dir(tmp_path / "ckpt")
    assert checkpoint.config.text.vocab_size == 1024
    summary = json.loads((tmp_path / "ckpt" / "training_summary.json").read_text())
    assert summary["target_steps"] == 2 and summary["draft_steps"] == 1
    assert set(summary["heldout_stored"]) >= {"add", "count", "copy", "date", "json", "fact", "dspark_tokens_per_step"}
    shipped = (ROOT / "benchmarks" / "data" / "tiny_heldout.jsonl").read_bytes()
    assert (tmp_path / "data" / "tiny_heldout.jsonl").read_bytes() == shipped


def _short_run(out: Path, *extra: str) -> str:
    command = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--out", str(out / "ckpt")]
    command += ["--data-dir", str(out / "data"), "--target-steps", "3", "--draft-steps", "2", "--seq-len", "96"]
    command += ["--warmup", "1", "--fake-quant-steps", "1", "--anchors", "16", "--eval-per-task", "1", *extra]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    return subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout


@pytest.mark.slow
def test_a_stopped_and_resumed_run_writes_the_same_checkpoint(tmp_path: Path) -> None:
    _short_run(tmp_path / "whole")
    state = str(tmp_path / "split" / "state")
    stopped = _short_run(tmp_path / "split", "--state", state, "--stop-after", "0")
    assert "saved target step 1" in stopped
    assert not (tmp_path / "split" / "ckpt").exists()
    assert "resuming from" in _short_run(tmp_path / "split", "--state", state)
    weights = "model-00001-of-00001.safetensors"
    whole = (tmp_path / "whole" / "ckpt" / weights).read_bytes()
    assert (tmp_path / "split" / "ckpt" / weights).read_bytes() == whole


@pytest.mark.slow
def test_a_batched_run_trains_on_batch_sequences_a_step(tmp_path: Path) -> None:
    log = _short_run(tmp_path, "--batch", "2")
    assert "--workers 1 --batch 2 --target-steps 3 --draft-steps 2 --seq-len 96" in log
    summary = json.loads((tmp_path / "ckpt" / "training_summary.json").read_text())
    assert summary["batch"] == 2 and summary["train_tokens"] == (3 + 2) * 2 * 96
    assert load_checkpoint_dir(tmp_path / "ckpt").config.text.num_hidden_layers == 7


@pytest.mark.slow
def test_a_drafter_stage_from_a_written_checkpoint_keeps_its_target(tmp_path: Path) -> None:
    # Second stage (docs/builtin-checkpoint.md): --init-from a written checkpoint, --target-steps 0, drafter only.
    _short_run(tmp_path / "first")
    first = tmp_path / "first" / "ckpt"
    out = tmp_path / "second"
    _short_run(out, "--init-from", str(first), "--target-steps", "0", "--draft-steps", "2")
    before, after = load_checkpoint_dir(first).tensors, load_checkpoint_dir(out / "ckpt").tensors
    config = load_checkpoint_dir(first).config
    old, new = values_from_stored(config, before), values_from_stored(config, after)
    assert all(torch.equal(new[name], value) for name, value in old.items() if not name.startswith("mtp."))
    assert any(not torch.equal(new[name], value) for name, value in old.items() if name.startswith("mtp."))
    assert (out / "ckpt" / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()
    summary = json.loads((out / "ckpt" / "training_summary.json").read_text())
    assert summary["target_steps"] == 0 and summary["init_from"]["target_steps"] == 3


def test_init_from_a_missing_or_foreign_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "tools" / "train_tiny.py"), "--out", str(tmp_path / "out")]
    command += ["--target-steps", "0", "--draft-steps", "1", "--init-from"]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    missing = subprocess.run([*command, str(tmp_path / "none")], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "--init-from: checkpoint directory" in missing.stderr
    foreign = tmp_path / "foreign"
    builtin = ROOT / "packages" / "deepinfer-engine" / "src" / "deepinfer_engine" / "builtin_checkpoint"
    shutil.copytree(builtin, foreign)
    config = json.loads((foreign / "config.json").read_text())
    config.get("text_config", config)["rms_norm_eps"] = 1e-5
    (foreign / "config.json").write_text(json.dumps(config))
    other = subprocess.run([*command, str(foreign)], capture_output=True, text=True, env=env)
    assert other.returncode == 2 and "not a checkpoint of the tiny preset" in other.stderr
