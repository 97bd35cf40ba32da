"""Sparse attention on one CUDA device at the ``v41-flash-scaled`` preset's shape, for prefill and decode query counts
(docs/design/kernels.md, "sparse_attention").

Inputs (exact mode: BF16 queries, probabilities rounded to BF16), for each of --queries: ``[T, heads, width]`` (64 × 512
from the preset), a window source of ``sliding_window`` (128) FP8 keys per query and a compressed source of
``index_topk`` (512) keys per query in the preset's compressed-row format (FP4_E4M3 with ``use_fp4_sparse_kv``;
--compressed-format picks another), every key a random row of a pool of --pool-rows (8192) rows encoded by the package's
``encode_rows``. Every key is valid: the tiles are the same work either way.

Checks each variant's output on the first --check queries against ``reference.attention.sparse_attention`` (max
|out − ref| ≤ 2^-8 · max |ref|, the GPU test's bound in exact mode), then times one call (``cuda_time_ms``: median of
CUDA-graph replays) of:
- ``old``: the previous non-split kernel (``attention_baseline.py``: blocks of 32 heads, logits recomputed in pass 2);
- ``new``: the package's path at ``TILES`` (split over the keys when the queries are few, as a decode step is);
- every --configs variant of it (``;``-separated ``key=value,...`` overrides of ``TILES``);
- ``new@<programs>`` for each of --split-targets: the path with ``SPLIT_TARGET_PROGRAMS`` at that value (fewer
  programs of (query, head block) than the target make a call split its keys, into about that many programs);
- ``inv-<keys>`` (and ``inv-<keys>+<i>`` for the i-th of --configs) for each of --invariant-chunks: the path in
  batch-invariant mode with chunks of that many keys (``INVARIANT_CHUNK_KEYS``): split when the queries are few, else
  added in one program a query (``chunks_kernel``, its value sweep ``chunks_block_v``).

Reports ms per call, attention TFLOP/s = 4 · heads · width · keys · queries / time (the q·kᵀ and p·v products at two
FLOPs a multiply-add, each counted once: neither the old kernel's second logits pass nor anything else repeated is
counted), the time ratio to ``old`` (new / old, below 1 is faster) and the compiled kernels' registers, spilled bytes
and shared memory.

Usage (PYTHONPATH holding the packages' src directories):
    python3 benchmarks/kernels_attention.py [--queries 1,64,256,8192] [--configs "block_v=256;num_stages=2"]
        [--invariant-chunks 64,128] [--split-targets 132,264]

Prints the table last and writes JSON (default benchmarks/results/kernels_attention-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
import triton
from attention_baseline import TILES as OLD_TILES
from attention_baseline import attend_before_kernel, sparse_attention_before
from bench_common import RESULTS, device_label, git_commit, int_list

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.benchmarking import cuda_time_ms

TOLERANCE = 2.0**-8

Op = Callable[[torch.Tensor, list[dk.KeySource], torch.Tensor, float, bool, torch.Tensor], None]


def preset_shape() -> dict[str, Any]:
    """Heads, width, window keys, compressed keys and compressed-row format of the scaled preset."""
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    compressed = dk.RowFormat.FP4_E4M3 if text.use_fp4_sparse_kv else dk.RowFormat.FP8
    return {
        "heads": text.num_attention_heads,
        "width": text.head_dim,
        "window": text.sliding_window,
        "topk": text.index_topk,
        "compressed_format": compressed,
    }


def build_inputs(shape: dict[str, Any], queries: int, pool_rows: int) -> dict[str, Any]:
    """Queries, sink and the two sources, every row valid and drawn uniformly from its pool."""
    generator = torch.Generator(device="cuda").manual_seed(0)

    def pool(fmt: dk.RowFormat) -> torch.Tensor:
        values = torch.randn((pool_rows, shape["width"]), generator=generator, device="cuda")
        return dk.encode_rows(values, fmt)

    def rows(count: int) -> torch.Tensor:
        return torch.randint(0, pool_rows, (queries, count), generator=generator, device="cuda")

    sources = [
        dk.KeySource(pool(dk.RowFormat.FP8), rows(shape["window"]), dk.RowFormat.FP8),
        dk.KeySource(pool(shape["compressed_format"]), rows(shape["topk"]), shape["compressed_format"]),
    ]
    q = torch.randn((queries, shape["heads"], shape["width"]), generator=generator, device="cuda")
    sink = torch.randn((shape["heads"],), generator=generator, device="cuda")
    return {"q": q.to(torch.bfloat16), "sources": sources, "sink": sink, "scale": shape["width"] ** -0.5}


def compiled_kernels(kernels: tuple[Any, ...]) -> set[Any]:
    """Every compiled variant of the Triton kernels in their JIT caches (the cache's layout changes between
    versions)."""
    found = set()
    for kernel in kernels:
        for entry in getattr(kernel, "device_caches", {}).values():
            for part in entry if isinstance(entry, tuple) else (entry,):
                if isinstance(part, dict):
                    found.update(v for v in part.values() if hasattr(v, "metadata"))
    return found


def kernel_stats(kernels: tuple[Any, ...], before: set[Any]) -> dict[str, Any]:
    """Registers, spilled bytes and shared memory of the one variant of ``kernels`` compiled since ``before`` (None
    where unknown, or where none or several were compiled)."""
    new = compiled_kernels(kernels) - before
    if len(new) != 1:
        return {"registers": None, "spill_bytes": None, "shared_bytes": None}
    compiled = next(iter(new))
    return {
        "registers": getattr(compiled, "n_regs", None),
        "spill_bytes": getattr(compiled, "n_spills", None),
        "shared_bytes": getattr(compiled.metadata, "shared", None),
    }


def run_variant(
    name: str, op: Op, kernels: tuple[Any, ...], config: dict[str, Any], inputs: dict[str, Any], args: Any
) -> dict:
    """Check ``op`` on the first queries against the reference, then time it on all of them."""
    q, sources, sink, scale = inputs["q"], inputs["sources"], inputs["sink"], inputs["scale"]
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    before = compiled_kernels(kernels)
    op(q, sources, sink, scale, True, out)
    torch.cuda.synchronize()
    stats = kernel_stats(kernels, before)
    check = min(args.check, q.shape[0])
    head = [dk.KeySource(s.pool, s.rows[:check], s.fmt) for s in sources]
    expected = torch.empty((check, *q.shape[1:]), dtype=torch.float32, device="cuda")
    implementation("sparse_attention", Backend.REFERENCE)(q[:check], head, sink, scale, True, expected)
    error = float((out[:check] - expected).abs().max() / expected.abs().max())
    if not error <= TOLERANCE:
        raise SystemExit(f"{name}: max |out - ref| / max |ref| = {error:.3g} > {TOLERANCE:.3g}")
    ms, graphed = cuda_time_ms(lambda: op(q, sources, sink, scale, True, out), warmup=2, repeats=args.repeats)
    keys = sum(s.rows.shape[1] for s in sources)
    flops = 4 * q.shape[1] * q.shape[2] * keys * q.shape[0]
    return {
        "name": name,
        "config": config,
        "ms": ms,
        "graphed": graphed,
        "tflops": flops / ms / 1e9,
        "max_rel_error": error,
        **stats,
    }


def parse_configs(text: str) -> list[dict[str, int]]:
    """``"block_v=256,num_stages=2;block_n=32"`` → [{"block_v": 256, "num_stages": 2}, {"block_n": 32}]."""
    configs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        configs.append({key.strip(): int(value) for key, value in (item.split("=") for item in part.split(","))})
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int_list, default=[8192], help="queries (tokens) per call, comma-separated")
    parser.add_argument("--pool-rows", type=int, default=8192, help="rows of each source's pool")
    parser.add_argument("--compressed-format", default=None, help="row format of the compressed source (RowFormat)")
    parser.add_argument("--configs", default="", help="';'-separated TILES overrides to time as well")
    parser.add_argument("--invariant-chunks", type=int_list, default=[], help="batch-invariant chunk keys to time")
    parser.add_argument("--split-targets", type=int_list, default=[], help="SPLIT_TARGET_PROGRAMS values to time")
    parser.add_argument("--check", type=int, default=64, help="queries checked against the reference")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_attention-<dev>)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_attention.py needs a CUDA device")
    from deepinfer_kernels.batch_invariant import batch_invariant_ops
    from deepinfer_kernels.cuda import attention
    from deepinfer_kernels.cuda.attention_kernels import chunks_kernel, prefill_kernel, split_sums_kernel

    shape = preset_shape()
    if args.compressed_format:
        shape["compressed_format"] = dk.RowFormat[args.compressed_format]
    # The new path reads TILES and INVARIANT_CHUNK_KEYS at each call.
    new_op = implementation("sparse_attention", Backend.NVIDIA)
    new_kernels = (prefill_kernel, split_sums_kernel)
    invariant_kernels = (chunks_kernel, split_sums_kernel)
    default_tiles, default_chunk = dict(attention.TILES), attention.INVARIANT_CHUNK_KEYS
    results = []
    for queries in args.queries:
        inputs = build_inputs(shape, queries, args.pool_rows)
        rows = [run_variant("old", sparse_attention_before, (attend_before_kernel,), OLD_TILES, inputs, args)]
        for i, overrides in enumerate([{}, *parse_configs(args.configs)]):
            attention.TILES = {**default_tiles, **overrides}
            rows.append(
                run_variant("new" if i == 0 else f"new+{i}", new_op, new_kernels, attention.TILES, inputs, args)
            )
        attention.TILES = default_tiles
        default_target = attention.SPLIT_TARGET_PROGRAMS
        for target in args.split_targets:
            attention.SPLIT_TARGET_PROGRAMS = target
            rows.append(run_variant(f"new@{target}", new_op, new_kernels, {"target_programs": target}, inputs, args))
        attention.SPLIT_TARGET_PROGRAMS = default_target
        for chunk in args.invariant_chunks:
            attention.INVARIANT_CHUNK_KEYS = chunk
            for i, overrides in enumerate([{}, *parse_configs(args.configs)]):
                attention.TILES = {**default_tiles, **overrides}
                name = f"inv-{chunk}" if i == 0 else f"inv-{chunk}+{i}"
                with batch_invariant_ops():
                    config = {"chunk_keys": chunk, **attention.TILES}
                    rows.append(run_variant(name, new_op, invariant_kernels, config, inputs, args))
        attention.TILES = default_tiles
        attention.INVARIANT_CHUNK_KEYS = default_chunk
        for r in rows:
            r["queries"] = queries
            r["time_ratio_to_old"] = r["ms"] / rows[0]["ms"]
        results += rows

    device = device_label("cuda")
    out = pathlib.Path(args.out) if args.out else RESULTS / f"kernels_attention-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": device,
        "triton": triton.__version__,
        "git_commit": git_commit(),
        "queries": args.queries,
        "pool_rows": args.pool_rows,
        "shape": {**shape, "compressed_format": shape["compressed_format"].name},
    }
    out.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"wrote {out}")
    print(
        f"\nsparse_attention: {shape['heads']} heads × {shape['width']}, {shape['window']} FP8 + {shape['topk']} "
        f"{shape['compressed_format'].name} keys a query (Triton {triton.__version__}; TFLOP/s = 4·H·D·keys·queries / "
        "time; new/old: time ratio to the old non-split kernel at the same queries)"
    )
    print(f"{'queries':>7} {'variant':<8} {'ms':>9} {'TFLOP/s':>8} {'new/old':>8} {'regs':>5} {'spill B':>8} config")
    for r in results:
        regs, spill = r["registers"], r["spill_bytes"]
        print(
            f"{r['queries']:>7} {r['name']:<8} {r['ms']:>9.4f} {r['tflops']:>8.2f} {r['time_ratio_to_old']:>8.3f} "
            f"{regs if regs is not None else '?':>5} {spill if spill is not None else '?':>8} {r['config']}"
        )


if __name__ == "__main__":
    main()
