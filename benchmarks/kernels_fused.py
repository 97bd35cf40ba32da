"""Fused and grouped ops of deepinfer-kernels against the paths they replace, on one CUDA device at the
``v41-flash-scaled`` preset's decode shapes (docs/design/kernels.md, "Grouped FP8 GEMM", "GEMMs on a quantized
activation").

Cases (old path → new op), per token count (--rows):
- ``wo_a``: the attention's grouped output projection. Old: the model's previous CUDA path, FP8 round trip of the
  activation and an FP32 einsum over the weight dequantized on the call (the layer keeps no FP32 copy on CUDA).
  New: ``fp8_block_grouped_gemm`` on the FP8 weight.
- ``quantized-<name>``: an FP8 block GEMM of the preset on an activation already quantized (``fp8_block_gemm``,
  quantizer included → ``fp8_block_gemm_quantized``, codes and scales given).
- ``norm-<name>``: ``attn_norm`` (width H) and ``q_norm`` (width q_lora_rank) with their FP8 copy (``rms_norm`` +
  ``quantize_fp8_per_token_group`` → ``rms_norm_fp8``), and ``norm-<name>+gemm``: the norm and the FP8 GEMM reading it
  (``wq_a`` resp. ``wq_b``: ``rms_norm`` + ``fp8_block_gemm`` → ``rms_norm_fp8`` + ``fp8_block_gemm_quantized``).
  No weight bytes for the norm alone (copy% then 0).
- ``swiglu+w2``: the shared expert's SwiGLU and ``w2`` (``swiglu_clamped`` + ``fp8_block_gemm`` →
  ``swiglu_clamped_fp8`` + ``fp8_block_gemm_quantized``).
- ``hc_mixes``: the mHC mixes of the preset's trunk (m = 4 streams of H), TF32 products: old, in the batch-invariant
  mode; new, outside it (``cuda.hyper_connection`` says which mix-logits kernel each runs at a token count; run the
  script on an older ``deepinfer_kernels`` for that version's kernels). The weight bytes are ``fn``'s FP32 rows.

``--cases`` runs only the comma-separated families among ``wo_a``, ``norm``, ``swiglu``, ``quantized``, ``hc_mixes``.

Times are medians of CUDA-graph replays (``kernels_gemm.time_us``: one graph calls the op once per weight copy, the
copies exceeding L2). Prints a table last and writes JSON (default benchmarks/results/kernels_fused-<device>.json).
Run from the repository root: ``python benchmarks/kernels_fused.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from kernels_gemm import (
    copy_bandwidth_gbps,
    device_label,
    inputs_for,
    preset_shapes,
    time_us,
    weight_copies,
    write_results,
)

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops


def wo_a_shape() -> tuple[int, int, int]:
    """(groups, N, K per group) of the preset's ``wo_a``."""
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    k = text.num_attention_heads // text.o_groups * text.head_dim
    return text.o_groups, text.o_groups * text.o_lora_rank, k


def wo_a_case(tokens: int) -> tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Callable[[], None]]]:
    groups, n, k = wo_a_shape()
    x = torch.randn(tokens, groups * k, device="cuda")  # the attention output reaches wo_a in FP32
    grouped = implementation("fp8_block_grouped_gemm", Backend.NVIDIA)
    out = torch.empty(tokens, n, dtype=torch.float32, device="cuda")

    def make(old: bool, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], None]:
        if not old:
            return lambda: grouped(x, w_q, w_scale, out)

        def einsum_path() -> None:
            q, s = dk.quantize_fp8_per_token_group(x)
            x_hat = dk.dequantize_fp8_per_token_group(q, s).view(tokens, groups, k)
            w_hat = dk.dequantize_fp8_block(w_q, w_scale).view(groups, n // groups, k)
            out.copy_(torch.einsum("ngi,goi->ngo", x_hat, w_hat).reshape(tokens, n))

        return einsum_path

    point = {"case": "wo_a", "n": n, "k": k, "groups": groups, "tokens": tokens}
    return point, weight_copies(inputs_for("fp8_block_gemm", n, k, 0)), make


def quantized_case(
    name: str, n: int, k: int, tokens: int
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Callable[[], None]]]:
    x = torch.randn(tokens, k, device="cuda").to(torch.bfloat16)
    q, q_scale = dk.quantize_fp8_per_token_group(x)
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    dense = implementation("fp8_block_gemm", Backend.NVIDIA)
    from_codes = implementation("fp8_block_gemm_quantized", Backend.NVIDIA)

    def make(old: bool, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], None]:
        if old:
            return lambda: dense(x, w_q, w_scale, out)
        return lambda: from_codes(q, q_scale, w_q, w_scale, out)

    point = {"case": f"quantized-{name}", "n": n, "k": k, "groups": 1, "tokens": tokens}
    return point, weight_copies(inputs_for("fp8_block_gemm", n, k, 0)), make


def norm_pair(
    name: str, width: int, n: int, tokens: int
) -> list[tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Any]]]:
    """The norm of ``width`` columns alone, and with the FP8 GEMM [n, width] that reads it."""
    x = torch.randn(tokens, width, device="cuda").to(torch.bfloat16)
    weight = torch.randn(width, device="cuda").to(torch.bfloat16)
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    dense = implementation("fp8_block_gemm", Backend.NVIDIA)
    from_codes = implementation("fp8_block_gemm_quantized", Backend.NVIDIA)

    def alone(old: bool) -> Callable[[], Any]:
        if old:
            return lambda: dk.quantize_fp8_per_token_group(dk.rms_norm(x, weight, 1e-6))
        return lambda: dk.rms_norm_fp8(x, weight, 1e-6)

    def with_gemm(old: bool, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], None]:
        if old:
            return lambda: dense(dk.rms_norm(x, weight, 1e-6), w_q, w_scale, out)
        return lambda: from_codes(*dk.rms_norm_fp8(x, weight, 1e-6)[1:], w_q, w_scale, out)

    return [
        ({"case": f"norm-{name}", "n": width, "k": width, "groups": 1, "tokens": tokens}, [()] * 16, alone),
        (
            {"case": f"norm-{name}+gemm", "n": n, "k": width, "groups": 1, "tokens": tokens},
            weight_copies(inputs_for("fp8_block_gemm", n, width, 0)),
            with_gemm,
        ),
    ]


def norm_cases(tokens: int) -> list[tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Any]]]:
    """``attn_norm`` → ``wq_a`` and ``q_norm`` → ``wq_b`` of the preset."""
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    heads_dim = text.num_attention_heads * text.head_dim
    return [
        *norm_pair("attn", text.hidden_size, text.q_lora_rank, tokens),
        *norm_pair("q", text.q_lora_rank, heads_dim, tokens),
    ]


def swiglu_case(tokens: int) -> tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Any]]:
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    half, hidden = text.n_shared_experts * text.moe_intermediate_size, text.hidden_size
    t = torch.randn(tokens, 2 * half, device="cuda").to(torch.bfloat16)
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    dense = implementation("fp8_block_gemm", Backend.NVIDIA)
    from_codes = implementation("fp8_block_gemm_quantized", Backend.NVIDIA)

    def make(old: bool, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], None]:
        if old:
            return lambda: dense(dk.swiglu_clamped(t, 10.0), w_q, w_scale, out)
        return lambda: from_codes(*dk.swiglu_clamped_fp8(t, 10.0), w_q, w_scale, out)

    point = {"case": "swiglu+w2", "n": hidden, "k": half, "groups": 1, "tokens": tokens}
    return point, weight_copies(inputs_for("fp8_block_gemm", hidden, half, 0)), make


def hc_mixes_case(tokens: int) -> tuple[dict[str, Any], list[tuple[torch.Tensor, ...]], Callable[..., Any]]:
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    m, hidden = text.hc_mult, text.hidden_size
    rows = (2 + m) * m
    trunk = torch.randn(tokens, m, hidden, device="cuda").to(torch.bfloat16)
    scale = torch.rand(3, device="cuda") + 0.5
    base = torch.randn(rows, device="cuda")
    outs = [torch.empty(shape, device="cuda") for shape in ((tokens, m), (tokens, m), (tokens, m, m))]
    mixes = implementation("hc_mixes", Backend.NVIDIA)

    def make(old: bool, fn: torch.Tensor) -> Callable[[], None]:
        def call() -> None:
            with batch_invariant_ops(old):
                mixes(trunk, fn, scale, base, 1e-6, 1e-6, 20, True, *outs)

        return call

    copies = [(torch.randn(rows, m * hidden, device="cuda") * 0.05,) for _ in range(16)]
    return {"case": "hc_mixes", "n": rows, "k": m * hidden, "groups": 1, "tokens": tokens}, copies, make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cases", default=None, help="comma-separated case families (default: all)")
    parser.add_argument("--out", default=None, help="JSON path (default results/kernels_fused-<device>.json)")
    args = parser.parse_args()
    families: dict[str, Callable[[int], list[Any]]] = {
        "wo_a": lambda t: [wo_a_case(t)],
        "norm": norm_cases,
        "swiglu": lambda t: [swiglu_case(t)],
        "quantized": lambda t: [quantized_case(name, n, k, t) for name, n, k in preset_shapes()["fp8_block_gemm"]],
        "hc_mixes": lambda t: [hc_mixes_case(t)],
    }
    chosen = args.cases.split(",") if args.cases else list(families)
    unknown = sorted(set(chosen) - set(families))
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; the cases are {sorted(families)}")
    if not torch.cuda.is_available():
        raise SystemExit("kernels_fused.py needs a CUDA device")
    torch.manual_seed(0)
    label = device_label()
    copy_gbps = copy_bandwidth_gbps()
    results: list[dict[str, Any]] = []
    for tokens in (int(v) for v in args.rows.split(",")):
        cases = [case for family in chosen for case in families[family](tokens)]
        for point, copies, make in cases:
            try:
                point["old_us"] = time_us([make(True, *w) for w in copies], args.repeats)
                point["new_us"] = time_us([make(False, *w) for w in copies], args.repeats)
            except RuntimeError as error:  # e.g. a path that cannot be graph-captured: report it, time the rest
                print(f"{point['case']} tokens={tokens}: {error}", flush=True)
                continue
            point["speedup"] = point["old_us"] / point["new_us"]
            point["weight_bytes"] = sum(w.numel() * w.element_size() for w in copies[0])
            point["new_copy_fraction"] = point["weight_bytes"] / point["new_us"] / 1e3 / copy_gbps
            results.append(point)
            print(f"{point['case']} tokens={tokens}: {point['old_us']:.1f} -> {point['new_us']:.1f} us", flush=True)
    write_results(args.out, "kernels_fused", label, args.repeats, copy_gbps, results)
    print(f"{'case':<28} {'N':>6} {'K':>5} {'tok':>4} {'old us':>8} {'new us':>8} {'x':>5} {'copy%':>6}")
    for p in results:
        print(
            f"{p['case'][:28]:<28} {p['n']:>6} {p['k']:>5} {p['tokens']:>4} {p['old_us']:>8.1f} {p['new_us']:>8.1f} "
            f"{p['speedup']:>5.1f} {100 * p['new_copy_fraction']:>5.0f}%"
        )


if __name__ == "__main__":
    main()
