"""benchmarks/roofline_counts.py against hand counts on the tiny preset and the built-in checkpoint's safetensors
headers; benchmarks/roofline.py's decode point and records on the built-in checkpoint; (slow) the script end to end
on the CPU."""

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
RECORD_KEYS = {"kind", "batch", "prompt", "step_ms", "floor_ms", "ratio"}


@pytest.fixture
def counts(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roofline_counts

    return roofline_counts


@pytest.fixture
def roofline(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import roofline

    return roofline


@pytest.fixture(scope="module")
def tiny():
    from deepinfer_model.config import load_preset

    return load_preset("tiny")


def test_weight_bytes_equal_the_builtin_checkpoints_headers(counts):
    from deepinfer_engine.model_source import builtin_checkpoint_dir
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.loading.safetensors_io import read_header

    directory = builtin_checkpoint_dir()
    config = ModelConfig.from_json(directory / "config.json")
    by_role = dict.fromkeys(counts.ROLES, 0)
    for shard in directory.glob("*.safetensors"):
        for name, record in read_header(shard).tensors.items():
            by_role[counts.tensor_role(name)] += record.num_bytes
    weights = counts.weight_bytes(config)
    assert weights.by_role == by_role
    assert weights.total - weights.by_role["routed_expert"] == sum(by_role.values()) - by_role["routed_expert"]
    assert weights.by_role["routed_expert"] == sum(weights.routed_expert) * config.text.n_routed_experts


def test_weight_bytes_hand_counts_on_tiny(counts, tiny):
    weights = counts.weight_bytes(tiny)
    h, i, v = 256, 128, 1024
    assert weights.by_role["head"] == weights.by_role["embed"] == v * h * 2  # BF16
    # MXFP4 w1, w3, w2: two codes a byte plus one UE8M0 scale per 32 weights.
    assert weights.routed_expert == (3 * (i * h // 2 + i * h // 32),) * 7
    # FP8 shared expert: one byte a weight plus one scale per 32x32 block, 7 layers.
    assert weights.by_role["shared_expert"] == 7 * 3 * (i * h + (i // 32) * (h // 32))
    # The drafter's context keys: main_proj [H, 2H] FP8 + scales, main_norm BF16, attn.wkv [D, H] FP8 + scales and
    # kv_norm BF16 of the one DSpark block.
    assert weights.by_role["drafter_keys"] == (h * 2 * h + 8 * 16) + 2 * h + (128 * h + 4 * 8) + 2 * 128
    assert weights.step_dense == sum(weights.by_role[r] for r in ("dense", "head", "shared_expert", "drafter_keys"))


def test_expected_distinct_experts(counts):
    assert counts.expected_distinct_experts(384, 6, 1) == pytest.approx(6)
    assert counts.expected_distinct_experts(8, 2, 0) == 0
    assert counts.expected_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert 383 < counts.expected_distinct_experts(384, 6, 1024) <= 384
    with pytest.raises(ValueError, match="top_k"):
        counts.expected_distinct_experts(8, 9, 1)


def test_cache_bytes_hand_counts_on_tiny(counts, tiny):
    # Layers 0-6: ratios 0,2,2,0,1,1,1; W 64; K 16; D 128 (FP8 row 132 B, FP4 row 72 B); index rows 68 B;
    # index sources 1, 2, 4, 5; candidate source 4 (8 blocks x 8 rows bound layer 5); C2 KV source 1.
    got = counts.cache_bytes_per_request(tiny.text, 40)
    # klen = 41 // 2 = 20 for C2, 41 for C1: every compressed layer selects 16 rows.
    assert got == {
        "window": 7 * 40 * 132,
        "compressed": 5 * 16 * 72,
        "index_k": (20 + 20 + 41 + 41) * 68,
        "compressor_state": 1 * 2 * 128 * 4,
    }
    far = counts.cache_bytes_per_request(tiny.text, 100)
    assert far["window"] == 7 * 63 * 132  # the ring's rows before the step: W - 1
    assert far["index_k"] == (50 + 50 + 101 + 64) * 68  # layer 5 scores only its candidate blocks' 64 rows


def test_decode_bytes_sum_their_parts(counts, tiny):
    weights = counts.weight_bytes(tiny)
    step = counts.decode_bytes(tiny, 3, 40, distinct_experts=[2, 3, 4, 5, 6, 2, 2])
    assert step.routed_experts == 24 * weights.routed_expert[0]
    assert step.embed_rows == 3 * 256 * 2
    assert step.engram_rows == 2 * 3 * (2 * 2) * (128 + 4)  # 2 layers, (N_g - 1) * h_e rows a token
    assert step.cache == {k: 3 * v for k, v in counts.cache_bytes_per_request(tiny.text, 40).items()}
    parts = step.step_dense + step.routed_experts + step.embed_rows + step.engram_rows + sum(step.cache.values())
    assert step.total == parts
    uniform = counts.decode_bytes(tiny, 3, 40)
    assert uniform.distinct_experts == (pytest.approx(8 * (1 - 0.75**3)),) * 7
    with pytest.raises(ValueError, match="one count per backbone layer"):
        counts.decode_bytes(tiny, 3, 40, distinct_experts=[2])


def test_gemm_params_per_token_match_the_catalogues_matrices(counts, tiny):
    from deepinfer_model.loading.catalogue import build_catalogue

    per_token = (
        "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
        "hc_attn_fn", "hc_ffn_fn", "ffn.gate.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight",
        "ffn.shared_experts.w2.weight", "attn.compressor.wkv.weight", "attn.compressor.wgate.weight",
        "attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight", "engram.wkv.weight",
    )  # fmt: skip
    entries = build_catalogue(tiny)
    for layer in range(tiny.text.num_hidden_layers):
        prefix = f"layers.{layer}."
        dense = sum(e.num_parameters for e in entries if e.name.removeprefix(prefix) in per_token)
        expert = sum(e.num_parameters for e in entries if e.name.startswith(f"{prefix}ffn.experts.0."))
        assert counts.gemm_params_per_token(tiny.text, layer) == dense + 2 * expert, layer


def test_prefill_flops_hand_counts_on_tiny(counts, tiny):
    flops = counts.prefill_flops(tiny, 4)
    # keys(t) for t = 0..3: window 1+2+3+4 = 10 on all 7 layers; selected rows C2: 0+1+1+2, C1: 1+2+3+4.
    assert flops["attention"] == 4 * 8 * 128 * (7 * 10 + 2 * 4 + 3 * 10)
    assert flops["indexer"] == 2 * 4 * 128 * (4 + 4 + 10 + 10)  # index sources 1, 2 (C2) and 4, 5 (C1)
    assert flops["head"] == 2 * 1024 * 256
    per_token = sum(counts.gemm_params_per_token(tiny.text, layer) for layer in range(7))
    index_keys = 2 * (2 + 4) * 128 * 128  # index-K sources 1 (C2: 2 rows) and 4 (C1: 4 rows)
    drafter = 2 * 4 * (2 * 256 * 256 + 128 * 256)
    assert flops["gemm"] == 2 * 4 * per_token + index_keys + drafter


@pytest.fixture(scope="module")
def tiny_llm():
    from deepinfer_engine import LLM

    llm = LLM(device="cpu", max_model_len=256, num_cache_blocks=8, max_num_seqs=1, enforce_eager=True)
    yield llm
    llm.close()


def test_decode_point_counts_routed_experts_and_makes_a_record(roofline, tiny_llm):
    model = tiny_llm.model
    point = roofline.run_decode(model, 1, 20, 21, 1, torch.device("cpu"))
    assert point["distinct_experts"] == [2] * 7  # one token picks top_k = 2 distinct experts in every layer
    rates = {"bandwidth": {"bytes_per_s": 1e9}, "gemm": {"flop_per_s": 1e9}}
    record = roofline.roofline_record("decode", point, model.config, rates)
    assert set(record) >= RECORD_KEYS and (record["kind"], record["batch"], record["prompt"]) == ("decode", 1, 20)
    assert record["bytes"] == roofline.roofline_counts.decode_bytes(model.config, 1, 20).total
    assert record["floor_ms"] == pytest.approx(record["bytes"] / 1e6)
    assert record["ratio"] == pytest.approx(record["step_ms"] / record["floor_ms"])


def test_mode_points_restore_the_model_and_changes_compare_like_with_like(roofline, tiny_llm):
    model = tiny_llm.model
    seen = roofline.mode_point(
        model,
        {"batch_invariant": True, "dependent_launch": True},
        lambda: {"modes": (model.batch_invariant, model.dependent_launch)},
    )
    assert seen == {"modes": (True, True), "batch_invariant": True, "dependent_launch": True}
    assert (model.batch_invariant, model.dependent_launch) == (False, False)

    def record(kind, size, invariant, dependent, step_ms, branch=False):
        size_key = {"batch": size, "prompt": 128} if kind == "decode" else {"batch": 1, "prompt": size}
        return {
            "kind": kind,
            **size_key,
            "batch_invariant": invariant,
            "dependent_launch": dependent,
            "branch_streams": branch,
            "flashmla": False,
            "step_ms": step_ms,
        }

    records = [
        record("decode", 1, False, False, 2.0),
        record("decode", 1, False, True, 1.8),
        record("decode", 1, True, False, 2.2),
        record("decode", 1, True, True, 2.42),
        record("decode", 1, False, False, 1.9, branch=True),
        record("decode", 1, False, True, 1.52, branch=True),
        record("decode", 64, True, True, 99.0),  # no like point with a mode off: in no comparison
        record("prefill", 64, False, False, 10.0),
        record("prefill", 64, False, True, 9.0),
        record("prefill", 64, False, False, 9.5, branch=True),
    ]
    change = roofline.mode_change(records, "batch_invariant", ("decode",))
    assert change == {"1": pytest.approx(0.1), "1 +dependent_launch": pytest.approx(2.42 / 1.8 - 1)}
    change = roofline.mode_change(records, "dependent_launch", ("decode", "prefill"))
    assert change == {
        "1": pytest.approx(-0.1),
        "1 +batch_invariant": pytest.approx(0.1),
        "1 +branch_streams": pytest.approx(-0.2),
        "prefill 64": pytest.approx(-0.1),
    }
    change = roofline.mode_change(records, "branch_streams", ("decode", "prefill"))
    assert change == {
        "1": pytest.approx(-0.05),
        "1 +dependent_launch": pytest.approx(1.52 / 1.8 - 1),
        "prefill 64": pytest.approx(-0.05),
    }


@pytest.mark.slow
def test_script_cpu_run_writes_every_record(tmp_path):
    out = tmp_path / "roofline.json"
    command = [sys.executable, str(BENCHMARKS / "roofline.py"), "--device", "cpu", "--decode-batches", "1,2"]
    command += ["--prefill-lens", "16", "--decode-repeats", "2", "--prefill-repeats", "1", "--copy-mib", "8"]
    command += ["--gemm-size", "128", "--out", str(out)]
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["header"]["bandwidth"]["bytes_per_s"] > 0 and result["header"]["gemm"]["flop_per_s"] > 0
    assert [(r["kind"], r["batch"], r["prompt"]) for r in result["records"]] == [
        ("decode", 1, 128),
        ("decode", 2, 128),
        ("prefill", 1, 16),
    ]
    assert all(2 <= n <= 4 for n in result["records"][1]["distinct_experts"])  # 2 tokens, top_k 2 of 8
    for record in result["records"]:
        assert set(record) >= RECORD_KEYS
        assert record["step_ms"] > 0 and record["floor_ms"] > 0
        assert record["ratio"] == pytest.approx(record["step_ms"] / record["floor_ms"])
    assert result["skipped"] == [] and result["errors"] == []
    assert "floor ms" in done.stdout.splitlines()[-4]


@pytest.fixture
def rates(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import machine_rates

    return machine_rates


def test_machine_rates_on_the_cpu(rates):
    copy = rates.copy_bandwidth(torch.device("cpu"), 4, repeats=2)
    assert copy["bytes"] == 2 * 4 * 2**20 and copy["bytes_per_s"] == pytest.approx(copy["bytes"] / copy["ms"] * 1e3)
    gemm = rates.gemm_rate(torch.device("cpu"), 64, repeats=2)
    assert gemm["flops"] == 2 * 64**3 and gemm["flop_per_s"] > 0 and "FP32" in gemm["method"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_machine_rates_on_cuda(rates):
    device = torch.device("cuda")
    assert rates.copy_bandwidth(device, 64, repeats=3)["bytes_per_s"] > 1e10
    gemm = rates.gemm_rate(device, 1024, repeats=3)
    assert "error" not in gemm and gemm["flop_per_s"] > 1e12 and "_scaled_mm" in gemm["method"]


def test_profile_step_counts_decode_and_prefill_steps(monkeypatch, tiny_llm):
    """benchmarks/profile_step.py's points on the CPU stand-in: a one-request decode step and a 24-token prefill each
    count the aten ops the model code calls (the table lists every op counted)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_step

    cpu = torch.device("cpu")
    decode = profile_step.profile_point(tiny_llm.model, "decode", 1, 20, steps=1, warmup=0, device=cpu)
    prefill = profile_step.profile_point(tiny_llm.model, "prefill", 24, 20, steps=1, warmup=0, device=cpu)
    assert (decode["kind"], decode["batch"], decode["context"]) == ("decode", 1, 20)
    assert (prefill["kind"], prefill["batch"], prefill["prompt"]) == ("prefill", 1, 24)
    for point in (decode, prefill):
        assert point["unit"] == "aten ops" and point["launches_per_step"] > 100
        assert point["launches_per_step"] == sum(entry["calls_per_step"] for entry in point["top"])
    assert prefill["time_us_per_step"] > 0
    assert "sites" not in decode


def test_profile_step_lists_the_source_lines_that_launch_ops(monkeypatch, tiny_llm):
    """``--sites``: the busiest package source lines of a decode step, most first; views and conversions that had
    nothing to do are not counted, in-place writes and new tensors are."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_step

    point = profile_step.profile_point(
        tiny_llm.model, "decode", 1, 20, steps=1, warmup=0, device=torch.device("cpu"), sites=12
    )
    sites = point["sites"]
    assert len(sites) == 12
    assert all("/" in entry["site"] and entry["site"].startswith("deepinfer_") for entry in sites)
    calls = [entry["calls_per_step"] for entry in sites]
    assert calls == sorted(calls, reverse=True) and calls[-1] > 0
    x = torch.ones(4, 3)
    counter = profile_step._SiteCounter()
    with torch.inference_mode(), counter:  # as the sites pass runs the model
        x.view(12)
        x.to(torch.float32)
        x.reshape(3, 4)
        x.to(torch.bfloat16)
        x.t().contiguous()
        x.clone().add_(1)
    assert {op: n for (_, op), n in counter.counts.items()} == {
        "aten::to": 1,
        "aten::contiguous": 1,
        "aten::clone": 1,
        "aten::add_": 1,
    }
