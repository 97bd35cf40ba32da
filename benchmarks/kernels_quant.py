"""The (de)quantizers on one CUDA device at the ``v41-flash-scaled`` preset's activation widths, against the copy
bandwidth measured in the same run (docs/design/kernels.md, "Quantization").

Per width ``K`` (the FP8 GEMMs' and the MoE GEMMs' inputs) and row count (--rows):

- ``quantize``: ``cuda.gemm.quantized_activation`` (per-token 32-column e4m3 codes and UE8M0 scales);
- ``quantize-deinterleaved``: ``cuda.gemm.deinterleaved_activation`` (the codes in the MXFP4 kernels' order);
- ``dequantize``: ``dequantize_fp8_per_token_group`` of those codes into BF16 (the ``dequant_bf16`` GEMMs' operand);
- ``values-sorted``: ``quantized_values`` as the MoE's ``swap_bf16`` GEMM calls it, the BF16 dequantization written
  in a random expert order of six product rows a token, word-pair columns (its bytes count each gathered read);

at the preset's attention output (its heads and head width, BF16 as FlashMLA leaves it, --rows rows):

- ``values-rotated``: ``quantized_values`` with the de-rotation of each head's tail in the launch (``wo_a``'s ``x̂``
  since the thirty-second session);
- ``widen-rotate-values``: the same ``x̂`` as before it: widened into FP32 (``cuda.flashmla.widen``), the tails
  rotated in place (``apply_rope``), then ``quantized_values`` of the FP32 copy (the same checksum);

and per FP8 weight ``dequantize-block``: ``dequantize_fp8_block`` into BF16. Each is timed by ``cuda_time_ms``
(median of CUDA-graph replays); bytes are those read plus written once. Run it once per kernel version (an earlier
commit's ``deepinfer-kernels/src`` first on PYTHONPATH) in one device call and pass the first run's JSON to the next
with --compare; the output records a checksum of the codes, equal between versions that write the same bytes.

Usage (PYTHONPATH holding the packages' src directories and benchmarks/):
    python3 benchmarks/kernels_quant.py [--rows 256,8192] [--label new] [--out PATH] [--compare OTHER.json]

Prints the table last and writes JSON (default benchmarks/results/kernels_quant-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable
from typing import Any

import machine_rates
import torch
from bench_common import RESULTS, device_label, git_commit, int_list
from kernels_gemm import preset_shapes

import deepinfer_kernels as dk
from deepinfer_kernels.benchmarking import cuda_time_ms
from deepinfer_model.config import load_preset

_GROUP = 32


def activation_widths() -> list[int]:
    """Distinct K of the preset's FP8 block GEMMs and MoE GEMMs."""
    shapes = preset_shapes()
    return sorted({k for op in ("fp8_block_gemm", "mxfp4_grouped_gemm") for _, _, k in shapes[op]})


def checksum(codes: torch.Tensor) -> int:
    weights = torch.arange(1, codes.shape[-1] + 1, device=codes.device, dtype=torch.int64)
    return int((codes.view(torch.uint8).to(torch.int64) * weights).sum())


def experts_per_token() -> int:
    return load_preset("v41-flash-scaled").text.num_experts_per_tok


def activation_cases(rows: int, k: int) -> list[tuple[str, Callable[[], Any], int]]:
    from deepinfer_kernels.cuda.gemm import deinterleaved_activation, quantized_activation
    from deepinfer_kernels.cuda.quant import quantized_values

    x = torch.randn((rows, k), generator=torch.Generator(device="cuda").manual_seed(k), device="cuda")
    x = x.to(torch.bfloat16)
    q_bytes, scale_bytes = quantized_activation(x)
    q, scale = q_bytes.view(torch.float8_e4m3fn), scale_bytes.view(torch.float8_e8m0fnu)
    coded = rows * k + rows * k // _GROUP  # codes and scales
    top_k = experts_per_token()
    order = torch.randperm(top_k * rows, generator=torch.Generator(device="cuda").manual_seed(rows), device="cuda")
    values = torch.empty((top_k * rows, k), dtype=torch.bfloat16, device="cuda")

    def sorted_values() -> torch.Tensor:
        quantized_values(x, values, order=order, word_pairs=True, repeats=top_k)
        return values

    return [
        ("quantize", lambda: quantized_activation(x), 2 * rows * k + coded),
        ("quantize-deinterleaved", lambda: deinterleaved_activation(x), 2 * rows * k + coded),
        (
            "dequantize",
            lambda: dk.dequantize_fp8_per_token_group(q, scale, out_dtype=torch.bfloat16),
            coded + 2 * q.numel(),
        ),
        ("values-sorted", sorted_values, 4 * values.numel()),
    ]


def rotation_cases(rows: int) -> list[tuple[str, Callable[[], Any], int]]:
    from deepinfer_kernels.cuda.flashmla import widen
    from deepinfer_kernels.cuda.quant import quantized_values
    from deepinfer_kernels.cuda.rope import HeadRotation, apply_rope

    text = load_preset("v41-flash-scaled").text
    heads, width, rope_dim = text.num_attention_heads, text.head_dim, text.qk_rope_head_dim
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn((rows, heads, width), generator=generator, device="cuda").to(torch.bfloat16)
    angles = torch.rand((rows, rope_dim // 2), generator=generator, device="cuda") * 1e3
    cos, sin = torch.cos(angles), -torch.sin(angles)
    values = torch.empty((rows, heads * width), dtype=torch.bfloat16, device="cuda")
    wide = torch.empty(x.shape, dtype=torch.float32, device="cuda")
    tail = wide[..., width - rope_dim :]

    def rotated() -> torch.Tensor:
        quantized_values(x.view(rows, -1), values, rotation=HeadRotation(cos, sin, width))
        return values

    def chained() -> torch.Tensor:
        widen(x, wide)
        apply_rope(tail, cos, sin, tail)
        quantized_values(wide.view(rows, -1), values)
        return values

    elements, rotated_elements = x.numel(), rows * heads * rope_dim
    return [
        ("values-rotated", rotated, 4 * elements),
        ("widen-rotate-values", chained, 12 * elements + 8 * rotated_elements),
    ]


def weight_case(n: int, k: int) -> Callable[[], Any]:
    w = torch.randn((n, k), generator=torch.Generator(device="cuda").manual_seed(n + k), device="cuda")
    w_q, w_scale = dk.quantize_fp8_block(w)
    return lambda: dk.dequantize_fp8_block(w_q, w_scale, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int_list, default=[256, 8192])
    parser.add_argument("--label", default="new")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--compare", type=pathlib.Path, default=None, help="JSON of another version: adds its us")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_quant.py needs a CUDA device")
    copy = machine_rates.copy_bandwidth(torch.device("cuda"), 1024)["bytes_per_s"]
    records = []

    def record(name: str, rows: int, k: int, fn: Callable[[], Any], moved: int) -> None:
        result = fn()
        codes = result[0] if isinstance(result, tuple) else result
        ms, _ = cuda_time_ms(fn)
        us = ms * 1e3
        bandwidth = moved / (us * 1e-6)
        records.append(
            {"op": name, "rows": rows, "k": k, "us": us, "bytes": moved, "copy_fraction": bandwidth / copy,
             "checksum": checksum(codes.view(torch.uint8))}
        )  # fmt: skip
        print(f"{args.label} {name} rows={rows} K={k}: {us:.1f} us", flush=True)

    for rows in args.rows:
        for k in activation_widths():
            for name, fn, moved in activation_cases(rows, k):
                record(name, rows, k, fn, moved)
        text = load_preset("v41-flash-scaled").text
        for name, fn, moved in rotation_cases(rows):
            record(name, rows, text.num_attention_heads * text.head_dim, fn, moved)
    for name, n, k in preset_shapes()["fp8_block_gemm"]:
        record(f"dequantize-block {name}", n, k, weight_case(n, k), 3 * n * k)
    out = args.out or RESULTS / f"kernels_quant-{device_label('cuda')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "label": args.label,
        "git_commit": git_commit(),
        "copy_bytes_per_s": copy,
    }
    out.write_text(json.dumps({**meta, "records": records}, indent=1) + "\n")
    other = {}
    if args.compare:
        other = {(r["op"], r["rows"], r["k"]): r for r in json.loads(args.compare.read_text())["records"]}
    print(f"\ncopy bandwidth {copy / 1e12:.3f} TB/s (read + written)")
    versus = f"{'other us':>9} {'ratio':>6} {'same':>5}"
    print(f"{'op':<32} {'rows':>6} {'K':>6} {args.label + ' us':>10} {'copy%':>6} {versus}")
    for r in records:
        o = other.get((r["op"], r["rows"], r["k"]))
        versus = f"{o['us']:>9.1f} {r['us'] / o['us']:>6.2f} {o['checksum'] == r['checksum']!s:>5}" if o else ""
        print(f"{r['op']:<32} {r['rows']:>6} {r['k']:>6} {r['us']:>10.1f} {100 * r['copy_fraction']:>5.0f}% {versus}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
