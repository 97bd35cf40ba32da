"""benchmarks/long_context.py: the sweep plan, the model-level decode step over a randomly filled cache, and (slow)
a short end-to-end CPU run of the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def long_context(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import long_context

    return long_context


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer_engine import LLM

    llm = LLM(device="cpu", max_model_len=1024, num_cache_blocks=16, max_num_seqs=2)
    yield llm
    llm.close()


def test_plan_runs_generate_decode_only_within_the_prefill_budget(long_context):
    points = long_context.plan([8192, 131072], [1024, 131072], [1, 32], 131072, 64)
    keys = {(p.kind, p.method, p.batch, p.context) for p in points}
    generate_decode = {(b, c) for kind, method, b, c in keys if kind == "decode" and method == "generate"}
    assert generate_decode == {(1, 1024), (32, 1024), (1, 131072)}
    assert {(b, c) for kind, method, b, c in keys if method == "model-step"} == {
        (b, c) for b in (1, 32) for c in (1024, 131072)
    }
    assert ("prefill", "generate", 1, 8192) in keys and ("prefill", "generate", 1, 131072) in keys
    order = [(p.kind, p.method, p.batch, p.context) for p in points]
    assert order.index(("prefill", "generate", 1, 8192)) < order.index(("prefill", "generate", 1, 131072))
    assert order[-1] == ("decode", "generate", 1, 131072)  # the longest real prefill plus decode steps comes last


def test_model_step_reads_each_requests_own_filled_pages(long_context, tiny_llm):
    from deepinfer_model.cache_spec import CacheGroupKind

    model = long_context._engine_model(tiny_llm)
    context, bound = 300, 1026
    with torch.inference_mode():
        state, step, rows = long_context.decode_step(model, 2, context, bound, torch.device("cpu"), seed=5)
        pages = -(-(context + 1) // long_context.BLOCK_SIZE)
        assert step.block_table[:, :pages].tolist() == [[1, 2, 3], [4, 5, 6]]
        assert int(step.block_table[:, pages:].abs().sum()) == 0
        for group in state.spec.groups:
            if group.kind is not CacheGroupKind.PAGED:
                continue
            per = state.rows_per_block(group.name)
            for layer in group.layer_ids:
                filled = state.read(group.name, layer, torch.arange(per, 7 * per))
                assert torch.isfinite(filled).all() and filled.abs().amax(-1).gt(0).all(), (group.name, layer)
                assert int(state.read(group.name, layer, torch.arange(per)).abs().sum()) == 0  # the null page
        assert rows > 0
        before = model(step, state)
        assert before.shape == (2, model.config.text.vocab_size) and torch.isfinite(before).all()
        # Overwrite request 0's pages (compressed and index-K rows beyond its window): only its logits may move.
        for group in state.spec.groups:
            if group.kind is CacheGroupKind.PAGED:
                per = state.rows_per_block(group.name)
                for layer in group.layer_ids:
                    values = torch.full((pages * per, state.codec(group.name).width), 3.0)
                    state.write(group.name, layer, torch.arange(per, (1 + pages) * per), values)
        after = model(step, state)
    assert not torch.equal(after[0], before[0])
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)


@pytest.mark.slow
def test_script_cpu_run_writes_every_point(tmp_path):
    out = tmp_path / "long_context.json"
    command = [sys.executable, str(BENCHMARKS / "long_context.py"), "--device", "cpu", "--parts", "sweep,memory"]
    command += ["--prefill-contexts", "128", "--decode-contexts", "128,256", "--decode-batches", "1,2"]
    command += ["--decode-steps", "2", "--memory-context", "256", "--out", str(out)]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    points = result["points"]
    kinds = sorted((p["kind"], p["method"], p["batch"], p["context"]) for p in points)
    assert kinds == sorted(
        [("prefill", "generate", 1, 128), ("prefill", "memory", 1, 256)]
        + [("decode", method, b, c) for method in ("generate", "model-step") for b in (1, 2) for c in (128, 256)]
    )
    for point in points:
        assert "error" not in point and "skipped" not in point, point
        assert point["seconds"] > 0 and point["tokens_per_s"] > 0
    memory = next(p for p in points if p["method"] == "memory")
    assert memory["peak_gib"] >= memory["rss_after_load_gib"] > 0 and memory["checkpoint_gib"] > 0
    assert "x1.00 of the smallest context" in done.stdout
