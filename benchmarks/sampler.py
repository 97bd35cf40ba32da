"""Sampler throughput vs batch size: reference (PyTorch) and fused (Triton) backends of deepinfer-sampling.

Measures one `Sampler.__call__` (masking, penalties, truncation, sampling, logprob outputs) on random logits at the
full vocabulary (129280 by default), for two parameter mixes: "temperature" (temperature 0.8 only) and
"top_k_top_p" (temperature 0.8, top_k 50, top_p 0.9, 5 top logprobs). The batch is built once outside the timing.
Each point is the median of `--repeats` timed calls after `--warmup` untimed ones; on CUDA every call is bracketed by
`torch.cuda.synchronize()`. One token is sampled per row, so tokens/s equals rows/s; logits/s counts rows × vocab.

Usage:
    python benchmarks/sampler.py                       # the device present: CUDA if visible, else CPU
    python benchmarks/sampler.py --batch-sizes 1,8,64 --repeats 5

Prints a table and writes benchmarks/results/sampler-<device>.json. The Triton backend is skipped on CPU (it would
run in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
from typing import Literal

import torch
from bench_common import median_wall_s

from deepinfer_sampling import Sampler, SamplerConfig, SamplingBatch, SamplingParams, SamplingRow, request_seed

SCENARIOS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9, top_logprobs=5),
}


def device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip()
    return "nvidia-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sampler-<device>.json)")
    args = parser.parse_args()

    device = torch.device(args.device)
    backends: list[Literal["reference", "triton"]] = ["reference", "triton"] if device.type == "cuda" else ["reference"]
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    label = device_label(device)
    results = []
    print(f"device {label}, vocab {args.vocab}, median of {args.repeats} after {args.warmup} warm-up calls")
    print(f"{'scenario':<12} {'backend':<10} {'batch':>6} {'ms':>10} {'rows/s':>12} {'logits/s':>12}")
    for scenario, params in SCENARIOS.items():
        for size in sizes:
            rows = [
                SamplingRow(params, request_seed(1, index_in_call=i, engine_seed=0, request_counter=0), position=100)
                for i in range(size)
            ]
            batch = SamplingBatch.build(rows, args.vocab, device)
            gen = torch.Generator().manual_seed(size)
            logits = (torch.randn(size, args.vocab, generator=gen) * 3).to(device=device, dtype=torch.bfloat16)
            for backend in backends:
                sampler = Sampler(SamplerConfig(backend=backend), args.vocab, device)
                seconds = median_wall_s(functools.partial(sampler, logits, batch), device, args.warmup, args.repeats)
                point = {
                    "scenario": scenario,
                    "backend": backend,
                    "batch_size": size,
                    "median_ms": seconds * 1e3,
                    "rows_per_s": size / seconds,
                    "tokens_per_s": size / seconds,
                    "logits_per_s": size * args.vocab / seconds,
                }
                results.append(point)
                print(
                    f"{scenario:<12} {backend:<10} {size:>6} {seconds * 1e3:>10.3f} "
                    f"{point['rows_per_s']:>12.1f} {point['logits_per_s']:>12.3e}"
                )
    out = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / f"sampler-{label}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": label, "vocab": args.vocab, "warmup": args.warmup, "repeats": args.repeats}
    meta["torch"] = torch.__version__
    out.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
