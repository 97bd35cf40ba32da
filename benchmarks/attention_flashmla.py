"""The package's sparse attention against FlashMLA's sparse prefill kernel, at the ``v41-flash-scaled`` preset's
prefill shape, on one CUDA device (docs/performance.md, "Next"; docs/benchmarks.md).

FlashMLA has no SM90 kernel for the V4.1 row formats. The ``sgl-flash-mla`` wheel's legacy extension
(``flash_mla_sparse_fwd(..., use_legacy=True)``) runs on SM90 over BF16 keys: ``kv [s_kv, 1, D]`` and, per query,
``indices [T, 1, topk]`` into it (−1: no key), with the per-head sink. So this script builds the package's key table
(``cuda.flashmla.key_table``: both sources' pools decoded into one BF16 ``kv``, exact, the compressed source's rows
offset behind the window pool's) and times, on the same queries, keys and sink as ``kernels_attention.py``:

- ``package``: ``deepinfer_kernels.sparse_attention`` (nvidia backend, exact mode: probabilities rounded to BF16
  against the final maximum, FP32 output);
- ``flashmla``: ``flash_mla_sparse_fwd`` alone (the key table decoded beforehand);
- ``flashmla+decode``: the pools' decoding into the BF16 table plus the call;
- ``flashmla+decode+copy`` and ``+widen``: that, and the BF16 output widened into an FP32 ``out`` by ATen's converting
  copy (the path before the twenty-ninth session) or by ``cuda.flashmla.widen`` (the path now): what a model step
  pays.

FlashMLA's online softmax rounds each probability to BF16 against a running maximum and writes BF16, so it is
compared with the reference by max |out − ref| / max |ref| and reported, not held to the package's bound. Times are
CUDA-graph replays (``cuda_time_ms``); TFLOP/s = 4 · heads · width · keys · queries / time.

Usage (PYTHONPATH holding the packages' src directories; ``sgl-flash-mla`` importable as ``flash_mla``):
    python3 benchmarks/attention_flashmla.py [--queries 2048,8192] [--check 64]

Prints a table last and writes JSON (default benchmarks/results/attention_flashmla-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list
from kernels_attention import build_inputs, preset_shape
from kernels_gemm import time_us

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.cuda.flashmla import key_table, widen


def run_point(shape: dict[str, Any], queries: int, args: Any, flash_mla: Any) -> list[dict[str, Any]]:
    inputs = build_inputs(shape, queries, args.pool_rows)
    q, sources, sink, scale = inputs["q"], inputs["sources"], inputs["sink"], inputs["scale"]
    check = min(args.check, queries)
    expected = torch.empty((check, *q.shape[1:]), dtype=torch.float32, device="cuda")
    head = [dk.KeySource(s.pool, s.rows[:check], s.fmt) for s in sources]
    implementation("sparse_attention", Backend.REFERENCE)(q[:check], head, sink, scale, True, expected)

    package_out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    package = implementation("sparse_attention", Backend.NVIDIA)

    def run_package() -> None:
        package(q, sources, sink, scale, True, package_out)

    kv, indices = key_table(sources, queries)

    def run_flashmla() -> torch.Tensor:
        out, _, _ = flash_mla.flash_mla_sparse_fwd(
            q, kv, indices, scale, d_v=shape["width"], attn_sink=sink, use_legacy=True
        )
        return out

    def run_flashmla_decoded() -> torch.Tensor:
        table, rows = key_table(sources, queries)
        out, _, _ = flash_mla.flash_mla_sparse_fwd(
            q, table, rows, scale, d_v=shape["width"], attn_sink=sink, use_legacy=True
        )
        return out

    wide = torch.empty(q.shape, dtype=torch.float32, device="cuda")

    def run_flashmla_copied() -> None:
        wide.copy_(run_flashmla_decoded())

    def run_flashmla_widened() -> None:
        widen(run_flashmla_decoded(), wide)

    run_package()
    flash_out = run_flashmla()
    torch.cuda.synchronize()
    scale_ref = float(expected.abs().max())
    errors = {
        "package": float((package_out[:check] - expected).abs().max()) / scale_ref,
        "flashmla": float((flash_out[:check].float() - expected).abs().max()) / scale_ref,
    }
    for name in ("flashmla+decode", "flashmla+decode+copy", "flashmla+decode+widen"):
        errors[name] = errors["flashmla"]
    keys = sum(s.rows.shape[1] for s in sources)
    flops = 4 * q.shape[1] * q.shape[2] * keys * queries
    rows = []
    variants = (
        ("package", run_package),
        ("flashmla", run_flashmla),
        ("flashmla+decode", run_flashmla_decoded),
        ("flashmla+decode+copy", run_flashmla_copied),
        ("flashmla+decode+widen", run_flashmla_widened),
    )
    for name, fn in variants:
        ms = time_us([fn], args.repeats) / 1e3
        rows.append({"queries": queries, "name": name, "ms": ms, "tflops": flops / ms / 1e9, "error": errors[name]})
    for r in rows:
        r["time_ratio_to_package"] = r["ms"] / rows[0]["ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int_list, default=[2048, 8192], help="queries (tokens) per call")
    parser.add_argument("--pool-rows", type=int, default=8192, help="rows of each source's pool")
    parser.add_argument("--check", type=int, default=64, help="queries compared with the reference")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_flashmla-<dev>)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_flashmla.py needs a CUDA device")
    try:
        import flash_mla
    except ImportError as error:
        raise SystemExit(f"attention_flashmla.py needs the sgl-flash-mla wheel (import flash_mla): {error}") from error
    shape = preset_shape()
    results = [r for queries in args.queries for r in run_point(shape, queries, args, flash_mla)]
    device = device_label("cuda")
    out = pathlib.Path(args.out) if args.out else RESULTS / f"attention_flashmla-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device,
        "git_commit": git_commit(),
        "pool_rows": args.pool_rows,
        "shape": {**shape, "compressed_format": shape["compressed_format"].name},
    }
    out.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    print(
        f"\nsparse attention, {shape['heads']} heads × {shape['width']}, {shape['window']} FP8 + {shape['topk']} "
        f"{shape['compressed_format'].name} keys a query (TFLOP/s = 4·H·D·keys·queries / time; error: "
        "max |out − ref| / max |ref| on the first queries)"
    )
    print(f"{'queries':>7} {'variant':<21} {'ms':>9} {'TFLOP/s':>8} {'x package':>9} {'error':>9}")
    for r in results:
        print(
            f"{r['queries']:>7} {r['name']:<21} {r['ms']:>9.4f} {r['tflops']:>8.2f} "
            f"{r['time_ratio_to_package']:>9.3f} {r['error']:>9.2e}"
        )


if __name__ == "__main__":
    main()
