"""Quantized GEMMs of deepinfer-kernels: Triton (nvidia backend) vs the PyTorch reference, on one CUDA device.

Ops and shapes (K = 4096 unless --k is given):
- fp8_block_gemm and mxfp4_gemm: x [M, K] bf16 times one weight [N, K] for every M in --rows and N in --n;
- mxfp4_grouped_gemm: x [M, K] with every row routed to a uniformly random expert of E (--experts), weights
  [E, 2048, K] (the routed-expert shape of a 4096-wide model; --grouped-n changes it).

Each call is captured in a CUDA graph and the graph replayed (launch cost excluded); calls that cannot be captured
(the reference's grouped GEMM synchronizes to find the experts present; any call whose capture fails) are timed
eagerly and marked "eager". Times
are medians of CUDA-event measurements after warm-up. TFLOPS counts 2·M·N·K; "weight GB/s" counts the weight bytes
a call must read once (for the grouped GEMM: only the experts that received rows), the figure that matters when few
rows make the GEMM bandwidth bound.

Usage:
    python benchmarks/kernels_gemm.py
    python benchmarks/kernels_gemm.py --rows 1,64 --experts 256 --repeats 20

Prints a table and writes benchmarks/results/kernels_gemm-<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re

import torch

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.benchmarking import cuda_time_ms

BACKENDS = {"triton": Backend.NVIDIA, "reference": Backend.REFERENCE}


def device_label() -> str:
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return "nvidia-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    return gen


def random_bytes(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=generator(seed), device="cuda", dtype=torch.int32).to(torch.uint8)


def random_scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """UE8M0 scales with bytes 118…126 (2^−9 … 2^−1), the range of real weight scales."""
    return random_bytes(shape, seed, 118, 127).view(torch.float8_e8m0fnu)


def cases(args: argparse.Namespace) -> list[dict]:
    """Every (op, shape) with its inputs, FLOP count and weight bytes."""
    k = args.k
    out = []
    for n in args.n:
        w_q = (random_bytes((n, k), seed=n) & 0xF7).view(torch.float8_e4m3fn)  # bit 3 cleared: no NaN code
        w_scale = random_scales((-(-n // 32), k // 32), seed=n + 1)
        packed = random_bytes((n, k // 2), seed=n + 2).view(torch.int8)
        scale = random_scales((n, k // 32), seed=n + 3)
        for m in args.rows:
            x = torch.randn((m, k), generator=generator(m), device="cuda").to(torch.bfloat16)
            common = {"m": m, "n": n, "k": k, "flops": 2 * m * n * k}
            out.append({"op": "fp8_block_gemm", **common, "inputs": (x, w_q, w_scale), "weight_bytes": n * k})
            out.append({"op": "mxfp4_gemm", **common, "inputs": (x, packed, scale), "weight_bytes": n * k // 2})
    n = args.grouped_n
    for experts in args.experts:
        packed = random_bytes((experts, n, k // 2), seed=experts).view(torch.int8)
        scale = random_scales((experts, n, k // 32), seed=experts + 1)
        for m in args.rows:
            x = torch.randn((m, k), generator=generator(m), device="cuda").to(torch.bfloat16)
            ids = torch.randint(0, experts, (m,), generator=generator(m + experts), device="cuda")
            present = int(torch.unique(ids).numel())
            out.append(
                {
                    "op": "mxfp4_grouped_gemm",
                    "m": m,
                    "n": n,
                    "k": k,
                    "experts": experts,
                    "experts_with_rows": present,
                    "flops": 2 * m * n * k,
                    "inputs": (x, ids, packed, scale),
                    "weight_bytes": present * n * k // 2,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64,512,4096", help="comma-separated M values")
    parser.add_argument("--n", default="4096,2048", help="comma-separated N values of the dense GEMMs")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--experts", default="16,256", help="comma-separated E values of the grouped GEMM")
    parser.add_argument("--grouped-n", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--reference-repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_gemm-<device>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_gemm.py needs a CUDA device")
    args.rows = [int(v) for v in args.rows.split(",")]
    args.n = [int(v) for v in args.n.split(",")]
    args.experts = [int(v) for v in args.experts.split(",")]

    label = device_label()
    print(f"device {label}, torch {torch.__version__}; median of {args.repeats} (reference: {args.reference_repeats})")
    print(
        f"{'op':<20} {'M':>5} {'N':>5} {'K':>5} {'E':>4} {'backend':<10} {'us':>10} {'TFLOPS':>8} {'weight GB/s':>12}"
    )
    results = []
    for case in cases(args):
        inputs = case.pop("inputs")
        for backend_name, backend in BACKENDS.items():
            impl = implementation(case["op"], backend)
            out = torch.zeros(case["m"], case["n"], dtype=torch.bfloat16, device="cuda")
            repeats = args.repeats if backend is Backend.NVIDIA else args.reference_repeats
            # The reference grouped GEMM synchronizes with the host (it lists the experts present): never captured.
            capture = not (backend is Backend.REFERENCE and case["op"] == "mxfp4_grouped_gemm")
            run = functools.partial(impl, *inputs, out)
            ms, graphed = cuda_time_ms(run, warmup=args.warmup, repeats=repeats, capture=capture)
            point = {
                **case,
                "backend": backend_name,
                "median_us": ms * 1e3,
                "cuda_graph": graphed,
                "tflops": case["flops"] / ms / 1e9,
                "weight_gbps": case["weight_bytes"] / ms / 1e6,
            }
            results.append(point)
            experts = case.get("experts", "")
            mode = "" if graphed else " eager"
            print(
                f"{case['op']:<20} {case['m']:>5} {case['n']:>5} {case['k']:>5} {experts:>4} {backend_name:<10} "
                f"{point['median_us']:>10.1f} {point['tflops']:>8.2f} {point['weight_gbps']:>12.1f}{mode}"
            )
    path = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / f"kernels_gemm-{label}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": label, "torch": torch.__version__, "warmup": args.warmup, "repeats": args.repeats}
    meta["reference_repeats"] = args.reference_repeats
    path.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
