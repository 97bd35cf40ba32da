"""benchmarks/sweep.py: each point's decode step against its floor, and a short CPU run of the script on the built-in
checkpoint (JSON, PNG, the table last)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import sweep

    return sweep


def test_floor_is_the_decode_bytes_at_the_mean_context_over_the_bandwidth(sweep):
    from deepinfer_model.config import load_preset

    config = load_preset("tiny")
    point = {"prompt_len": 100, "output_len": 40, "batch_size": 4, "mean_decode_tokens_per_s": 50.0}
    got = sweep.with_floor(point, config, 2e9)
    expected_bytes = sweep.roofline_counts.decode_bytes(config, 4, 120).total
    assert got["decode_context"] == 120
    assert got["floor_ms"] == pytest.approx(expected_bytes / 2e9 * 1e3)
    assert got["decode_step_ms"] == pytest.approx(20.0)
    assert got["ratio"] == pytest.approx(20.0 / got["floor_ms"])
    assert sweep.with_floor({**point, "mean_decode_tokens_per_s": None}, config, 2e9)["ratio"] is None


def test_script_cpu_run_writes_json_plot_and_table(tmp_path):
    out = tmp_path / "sweep.json"
    command = [sys.executable, str(BENCHMARKS / "sweep.py"), "--device", "cpu", "--prompt-lens", "8"]
    command += ["--output-lens", "3", "--batch-sizes", "2", "--copy-mib", "8", "--out", str(out)]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["header"]["bandwidth"]["bytes_per_s"] > 0 and record["skipped"] == []
    assert [(r["prompt_len"], r["output_len"], r["batch_size"]) for r in record["results"]] == [(8, 3, 2)]
    for r in record["results"]:
        assert r["generated_tokens"] == 3 * r["batch_size"] and r["all_finished_ok"]
        assert r["floor_ms"] > 0 and r["ratio"] == pytest.approx(r["decode_step_ms"] / r["floor_ms"])
    assert out.with_suffix(".png").stat().st_size > 0  # matplotlib is a dev dependency
    lines = done.stdout.strip().splitlines()
    header = lines[-1 - len(record["results"])]
    assert header.split()[:4] == ["prompt", "output", "batch", "out"]  # the throughput table comes last
