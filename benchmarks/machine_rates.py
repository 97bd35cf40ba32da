"""The machine's own rates that a roofline divides by, measured in the same run as the steps they bound: the copy
bandwidth (bytes read + written by one large copy) and the dense GEMM rate (FP8 on CUDA through `torch._scaled_mm`,
cuBLASLt's FP8 GEMM; an FP32 matmul on a CPU, which has no FP8 units)."""

from __future__ import annotations

import traceback
from typing import Any

import torch
from bench_common import median_wall_s

__all__ = ["copy_bandwidth", "gemm_rate"]


def _median_ms(fn: Any, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn` after two warm-up calls: CUDA-event timing on CUDA, wall time elsewhere."""
    if device.type == "cuda":
        from deepinfer_kernels.benchmarking import cuda_time_ms

        return cuda_time_ms(fn, warmup=2, repeats=repeats, capture=False)[0]
    return median_wall_s(fn, device, warmup=2, repeats=repeats) * 1e3


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 10) -> dict[str, Any]:
    """Bytes per second of `dst.copy_(src)` over two `mib`-MiB buffers on `device`, counting each byte once read and
    once written (2 × `mib` MiB per copy)."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device, repeats)
    moved = 2 * src.numel()
    return {
        "method": f"tensor.copy_ of {mib} MiB, bytes read + written",
        "bytes": moved,
        "ms": ms,
        "bytes_per_s": moved / (ms / 1e3),
    }


def gemm_rate(device: torch.device, size: int, repeats: int = 10) -> dict[str, Any]:
    """FLOP/s (2 per multiply-add) of one `size`³ product on `device`: on CUDA `torch._scaled_mm` of random e4m3
    matrices with unit per-tensor scales and a BF16 result; elsewhere an FP32 `torch.matmul`. An op that fails (a GPU
    without FP8 GEMMs) gives a record with "error" and no rate."""
    flops = 2 * size**3
    generator = torch.Generator(device=device).manual_seed(0)
    try:
        if device.type == "cuda":
            a = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn)
            b = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn).t()  # column-major
            one = torch.ones((), dtype=torch.float32, device=device)
            method = "torch._scaled_mm (cuBLASLt FP8 e4m3, per-tensor scales, BF16 out)"

            def product() -> None:
                torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        else:
            a = torch.randn(size, size, generator=generator)
            b = torch.randn(size, size, generator=generator)
            method = "torch.matmul FP32 (CPU: no FP8 GEMM)"

            def product() -> None:
                torch.matmul(a, b)

        ms = _median_ms(product, device, repeats)
    except Exception as exc:
        traceback.print_exc()
        return {"method": f"{size}^3 FP8 GEMM", "error": f"{type(exc).__name__}: {exc}", "flop_per_s": None}
    return {"method": f"{method}, {size}^3", "flops": flops, "ms": ms, "flop_per_s": flops / (ms / 1e3)}
