"""Time each op's fast implementation against the reference on one CUDA device.

Usage (needs a CUDA device; prints one line per op and shape):

    python packages/deepinfer-kernels/benchmarks/bench_ops.py

Each op is captured in a CUDA graph and the graph replayed, so Python launch cost is excluded; ops that cannot be
captured (the reference's MXFP4 decode builds a table on the device) are timed eagerly and marked "eager".
Timings are medians of CUDA-event measurements after warm-up; "GB/s" counts the bytes each op must read and write
once (inputs + outputs), so it is comparable with the device's memory bandwidth.
"""

from __future__ import annotations

import functools

import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.benchmarking import cuda_time_ms
from deepinfer_kernels.testing import random_e4m3, random_mxfp4_packed, random_normal, random_ue8m0


def _bench(op: str, args: tuple, outputs: tuple[torch.Tensor, ...], label: str) -> None:
    moved = sum(t.numel() * t.element_size() for t in (*args, *outputs) if isinstance(t, torch.Tensor))
    line = [f"{op:32s} {label:22s}"]
    for backend in (Backend.NVIDIA, Backend.REFERENCE):
        impl = implementation(op, backend)
        ms, graphed = cuda_time_ms(functools.partial(impl, *args, *outputs))
        mode = "" if graphed else " eager"
        line.append(f"{backend.value}: {ms * 1e3:9.1f} us {moved / ms / 1e6:8.1f} GB/s{mode}")
    print("  ".join(line))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_ops.py needs a CUDA device")
    cuda = "cuda"
    for rows in (16, 4096):
        x = random_normal((rows, 7168), seed=1, dtype=torch.bfloat16, device=cuda)
        w = random_normal((7168,), seed=2, dtype=torch.bfloat16, device=cuda)
        _bench("rms_norm", (x, w, 1e-6), (torch.empty_like(x),), f"[{rows}, 7168] bf16")
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=cuda)
        s = torch.empty((rows, 224), dtype=torch.float8_e8m0fnu, device=cuda)
        _bench("quantize_fp8_per_token_group", (x,), (q, s), f"[{rows}, 7168] bf16")
        q = random_e4m3((rows, 7168), seed=3, device=cuda)
        s = random_ue8m0((rows, 224), seed=4, device=cuda)
        _bench(
            "dequantize_fp8_per_token_group",
            (q, s),
            (torch.empty(x.shape, dtype=torch.bfloat16, device=cuda),),
            f"[{rows}, 7168] -> bf16",
        )
    for tokens in (16, 4096):
        x = random_normal((tokens, 64, 64), seed=5, dtype=torch.bfloat16, device=cuda)
        cos, sin = (t.to(cuda) for t in dk.rope_cos_sin(dk.rope_inverse_frequencies(64, 10000.0), tokens))
        _bench("apply_rope", (x, cos, sin), (torch.empty_like(x),), f"[{tokens}, 64, 64] bf16")
    w = random_normal((7168, 4096), seed=6, dtype=torch.bfloat16, device=cuda)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=cuda)
    s = torch.empty((224, 128), dtype=torch.float8_e8m0fnu, device=cuda)
    _bench("quantize_fp8_block", (w,), (q, s), "[7168, 4096] bf16")
    implementation("quantize_fp8_block", Backend.REFERENCE)(w, q, s)
    _bench(
        "dequantize_fp8_block",
        (q, s),
        (torch.empty(w.shape, dtype=torch.bfloat16, device=cuda),),
        "[7168, 4096] -> bf16",
    )
    packed = random_mxfp4_packed((3072, 2048), seed=7, device=cuda)
    s = random_ue8m0((3072, 128), seed=8, device=cuda)
    _bench(
        "dequantize_mxfp4",
        (packed, s),
        (torch.empty((3072, 4096), dtype=torch.bfloat16, device=cuda),),
        "[3072, 4096] -> bf16",
    )
    w = random_normal((3072, 4096), seed=9, dtype=torch.bfloat16, device=cuda)
    packed = torch.empty((3072, 2048), dtype=torch.int8, device=cuda)
    _bench("quantize_mxfp4", (w,), (packed, s), "[3072, 4096] bf16")


if __name__ == "__main__":
    main()
