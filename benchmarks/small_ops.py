"""The step's small fused ops at the scaled preset's shapes, before and after a kernel change: each op's outputs on
fixed inputs (to compare two source trees bit for bit) and its time a call.

Ops: ``hc_mixes`` (m 4, H 5,120, TF32; 1, 3, 16, 17 and 300 tokens, the normal and the batch-invariant mode),
``engram_gate`` (4 streams, H 5,120; 1, 3 and 300 tokens), ``router_topk`` (384 experts, top 6; 1, 64 and 8,192
tokens), all timed at one token; ``swiglu_clamped`` with routing weights (the routed experts, I 2,304; 1, 3, 300 and
2,000 rows, timed at 1 and at 49,152 rows, an 8K prompt's six rows a token) and ``swiglu_clamped_fp8`` (the shared
expert; 1, 3 and 300 rows, timed at 1 and 8,192). Inputs are made before the timed call, which ``cuda_time_ms``
times (median of CUDA-graph replays). Run it once per kernel version (an earlier commit's ``deepinfer-kernels/src``
first on PYTHONPATH) in one device call, passing the first run's JSON to the second with --compare: the table then
shows both times and whether every output is bitwise equal. Outputs are stored beside the JSON (``.pt``) for that
comparison.

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

HIDDEN, STREAMS, EXPERTS, TOP_K, INTERMEDIATE = 5120, 4, 384, 6, 2304
Call = tuple[Callable[[], object], list[torch.Tensor]]
# name, inputs and outputs at a token count (the call and the tensors it writes), token counts whose outputs are
# compared, token counts timed.
Case = tuple[str, Callable[[int], Call], tuple[int, ...], tuple[int, ...]]


def _mixes(invariant: bool) -> Callable[[int], Call]:
    rows = (2 + STREAMS) * STREAMS
    weights = (
        random_normal((rows, STREAMS * HIDDEN), seed=1, dtype=torch.float32, std=0.05).cuda(),
        (random_normal((3,), seed=2, dtype=torch.float32).abs() + 0.5).cuda(),
        random_normal((rows,), seed=3, dtype=torch.float32, std=0.5).cuda(),
    )
    op = implementation("hc_mixes", Backend.NVIDIA)

    def prepare(tokens: int) -> Call:
        trunk = random_normal((tokens, STREAMS, HIDDEN), seed=tokens, dtype=torch.bfloat16, std=2.0).cuda()
        shapes = ((tokens, STREAMS), (tokens, STREAMS), (tokens, STREAMS, STREAMS))
        outs = [torch.empty(shape, device="cuda") for shape in shapes]

        def call() -> None:
            with batch_invariant_ops(invariant):
                op(trunk, *weights, 1e-6, 1e-6, 20, True, *outs)

        return call, outs

    return prepare


def _engram(tokens: int) -> Call:
    generator = torch.Generator().manual_seed(tokens)
    kv = random_normal((tokens, STREAMS + 1, HIDDEN), seed=tokens, dtype=torch.bfloat16).cuda()
    trunk = random_normal((tokens, STREAMS, HIDDEN), seed=tokens + 1, dtype=torch.bfloat16).cuda()
    norms = [(1 + 0.1 * torch.randn(STREAMS, HIDDEN, generator=generator)).to(torch.bfloat16).cuda() for _ in "qk"]
    active = (torch.rand(tokens, generator=generator) < 0.8).cuda()
    out = torch.empty_like(trunk)
    op = implementation("engram_gate", Backend.NVIDIA)
    call = functools.partial(
        op, trunk=trunk, keys=kv[:, :STREAMS], value=kv[:, STREAMS], q_weight=norms[0], k_weight=norms[1],
        active=active, eps=1e-6, out=out,
    )  # fmt: skip
    return call, [out]


def _router(tokens: int) -> Call:
    bias = random_normal((EXPERTS,), seed=1, dtype=torch.float32, std=0.5).cuda()
    logits = random_normal((tokens, EXPERTS), seed=tokens, dtype=torch.float32, std=8.0).cuda()
    ids = torch.empty(tokens, TOP_K, dtype=torch.int64, device="cuda")
    weights = torch.empty(tokens, TOP_K, device="cuda")
    op = implementation("router_topk", Backend.NVIDIA)
    return functools.partial(op, logits, bias, TOP_K, 1.5, ids, weights), [ids, weights]


def _swiglu(tokens: int) -> Call:
    # The routed experts' SwiGLU: a routing weight a row, BF16 out (a token's six rows at prefill).
    t = random_normal((tokens, 2 * INTERMEDIATE), seed=tokens, dtype=torch.bfloat16, std=4.0).cuda()
    weight = random_normal((tokens,), seed=tokens + 1, dtype=torch.float32).abs().cuda()
    out = torch.empty(tokens, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")
    return functools.partial(implementation("swiglu_clamped", Backend.NVIDIA), t, 10.0, weight, out), [out]


def _swiglu_fp8(tokens: int) -> Call:
    # The shared expert's SwiGLU with w2's FP8 copy.
    t = random_normal((tokens, 2 * INTERMEDIATE), seed=tokens, dtype=torch.bfloat16, std=4.0).cuda()
    q = torch.empty(tokens, INTERMEDIATE, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(tokens, INTERMEDIATE // 32, dtype=torch.float8_e8m0fnu, device="cuda")
    call = functools.partial(implementation("swiglu_clamped_fp8", Backend.NVIDIA), t, 10.0, None, q, scale)
    return call, [q.view(torch.uint8), scale.view(torch.uint8)]


def cases() -> list[Case]:
    return [
        ("hc_mixes", _mixes(False), (1, 3, 16, 17, 300), (1,)),
        ("hc_mixes invariant", _mixes(True), (1, 3, 16, 17, 300), (1,)),
        ("engram_gate", _engram, (1, 3, 300), (1,)),
        ("router_topk", _router, (1, 64, 8192), (1,)),
        ("swiglu routed", _swiglu, (1, 3, 300, 2000), (1, 6 * 8192)),
        ("swiglu_fp8 shared", _swiglu_fp8, (1, 3, 300), (1, 8192)),
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
    for name, prepare, token_counts, timed in cases():
        for tokens in token_counts:
            call, written = prepare(tokens)
            call()
            outputs[f"{name} {tokens}"] = [t.cpu() for t in written]
        same = None
        if other is not None:
            same = all(
                torch.equal(a, b)
                for tokens in token_counts
                for a, b in zip(outputs[f"{name} {tokens}"], other_outputs[f"{name} {tokens}"], strict=True)
            )
        for tokens in timed:
            call, _ = prepare(tokens)
            ms, graphed = cuda_time_ms(call)
            records.append({"op": name, "tokens": tokens, "us": ms * 1e3, "graphed": graphed, "same_bits": same})
        torch.cuda.empty_cache()
    torch.save(outputs, out.with_suffix(".pt"))
    meta = {"device": torch.cuda.get_device_name(), "label": args.label, "git_commit": git_commit()}
    out.write_text(json.dumps({**meta, "records": records}, indent=1))
    before = {(r["op"], r["tokens"]): r["us"] for r in other["records"]} if other else {}
    print(f"\n{'op':<20} {'tokens':>7} {'µs':>10} {'other µs':>10} {'ratio':>6}  same bits")
    for r in records:
        was = before.get((r["op"], r["tokens"]))
        other_us, ratio = (f"{was:10.2f}", f"{r['us'] / was:6.2f}") if was else (f"{'-':>10}", f"{'-':>6}")
        print(f"{r['op']:<20} {r['tokens']:>7} {r['us']:10.2f} {other_us} {ratio}  {r['same_bits']}")


if __name__ == "__main__":
    main()
