"""The decode step's small fused ops at the scaled preset's shapes, before and after a kernel change: each op's outputs
on fixed inputs (to compare two source trees bit for bit) and its time a call at one token.

Ops: ``hc_mixes`` (m 4, H 5,120, TF32; 1, 3, 16, 17 and 300 tokens, the normal and the batch-invariant mode),
``engram_gate`` (4 streams, H 5,120; 1, 3 and 300 tokens), ``router_topk`` (384 experts, top 6; 1, 64 and 8,192
tokens). The one-token call is timed by ``cuda_time_ms`` (median of CUDA-graph replays). Run it once per kernel
version (an earlier commit's ``deepinfer-kernels/src`` first on PYTHONPATH) in one device call, passing the first
run's JSON to the second with --compare: the table then shows both times and whether every output is bitwise equal.
Outputs are stored beside the JSON (``.pt``) for that comparison.

Usage (PYTHONPATH holding the packages' src directories):
    python3 benchmarks/small_ops.py [--label new] [--out PATH] [--compare OTHER.json]

Prints the table last and writes JSON (default benchmarks/results/small_ops-<device>.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.benchmarking import cuda_time_ms
from deepinfer_kernels.testing import random_normal

HIDDEN, STREAMS, EXPERTS, TOP_K = 5120, 4, 384, 6
Case = tuple[str, Callable[[int], list[torch.Tensor]], tuple[int, ...]]


def _mixes(invariant: bool) -> Callable[[int], list[torch.Tensor]]:
    rows = (2 + STREAMS) * STREAMS
    weights = (
        random_normal((rows, STREAMS * HIDDEN), seed=1, dtype=torch.float32, std=0.05).cuda(),
        (random_normal((3,), seed=2, dtype=torch.float32).abs() + 0.5).cuda(),
        random_normal((rows,), seed=3, dtype=torch.float32, std=0.5).cuda(),
    )
    op = implementation("hc_mixes", Backend.NVIDIA)

    def run(tokens: int) -> list[torch.Tensor]:
        trunk = random_normal((tokens, STREAMS, HIDDEN), seed=tokens, dtype=torch.bfloat16, std=2.0).cuda()
        shapes = ((tokens, STREAMS), (tokens, STREAMS), (tokens, STREAMS, STREAMS))
        outs = [torch.empty(shape, device="cuda") for shape in shapes]
        with batch_invariant_ops(invariant):
            op(trunk, *weights, 1e-6, 1e-6, 20, True, *outs)
        return outs

    return run


def _engram(tokens: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    kv = random_normal((tokens, STREAMS + 1, HIDDEN), seed=tokens, dtype=torch.bfloat16).cuda()
    trunk = random_normal((tokens, STREAMS, HIDDEN), seed=tokens + 1, dtype=torch.bfloat16).cuda()
    norms = [(1 + 0.1 * torch.randn(STREAMS, HIDDEN, generator=generator)).to(torch.bfloat16).cuda() for _ in "qk"]
    active = (torch.rand(tokens, generator=generator) < 0.8).cuda()
    out = torch.empty_like(trunk)
    implementation("engram_gate", Backend.NVIDIA)(
        trunk=trunk, keys=kv[:, :STREAMS], value=kv[:, STREAMS], q_weight=norms[0], k_weight=norms[1],
        active=active, eps=1e-6, out=out,
    )  # fmt: skip
    return [out]


def _router(tokens: int) -> list[torch.Tensor]:
    bias = random_normal((EXPERTS,), seed=1, dtype=torch.float32, std=0.5).cuda()
    logits = random_normal((tokens, EXPERTS), seed=tokens, dtype=torch.float32, std=8.0).cuda()
    ids = torch.empty(tokens, TOP_K, dtype=torch.int64, device="cuda")
    weights = torch.empty(tokens, TOP_K, device="cuda")
    implementation("router_topk", Backend.NVIDIA)(logits, bias, TOP_K, 1.5, ids, weights)
    return [ids, weights]


def cases() -> list[Case]:
    return [
        ("hc_mixes", _mixes(False), (1, 3, 16, 17, 300)),
        ("hc_mixes invariant", _mixes(True), (1, 3, 16, 17, 300)),
        ("engram_gate", _engram, (1, 3, 300)),
        ("router_topk", _router, (1, 64, 8192)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="new")
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare", default=None, help="JSON of another version: adds its µs and the bits' equality")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("small_ops.py times CUDA kernels: no CUDA device here")
    out = pathlib.Path(args.out) if args.out else RESULTS / f"small_ops-{device_label('cuda')}.json"
    other = json.loads(pathlib.Path(args.compare).read_text()) if args.compare else None
    other_outputs = torch.load(pathlib.Path(args.compare).with_suffix(".pt")) if args.compare else {}
    records: list[dict[str, Any]] = []
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, run, token_counts in cases():
        for tokens in token_counts:
            outputs[f"{name} {tokens}"] = [t.cpu() for t in run(tokens)]
        one_token_us = cuda_time_ms(functools.partial(run, 1))[0] * 1e3
        same = None
        if other is not None:
            same = all(
                torch.equal(a, b)
                for tokens in token_counts
                for a, b in zip(outputs[f"{name} {tokens}"], other_outputs[f"{name} {tokens}"], strict=True)
            )
        records.append({"op": name, "tokens": list(token_counts), "us_one_token": one_token_us, "same_bits": same})
    torch.save(outputs, out.with_suffix(".pt"))
    meta = {"device": torch.cuda.get_device_name(), "label": args.label, "git_commit": git_commit()}
    out.write_text(json.dumps({**meta, "records": records}, indent=1))
    before = {r["op"]: r["us_one_token"] for r in other["records"]} if other else {}
    print(f"\n{'op':<20} {'µs (1 token)':>13} {'other µs':>9} {'ratio':>6}  same bits")
    for r in records:
        was = before.get(r["op"])
        other_us, ratio = (f"{was:9.2f}", f"{r['us_one_token'] / was:6.2f}") if was else (f"{'-':>9}", f"{'-':>6}")
        print(f"{r['op']:<20} {r['us_one_token']:13.2f} {other_us} {ratio}  {r['same_bits']}")


if __name__ == "__main__":
    main()
