"""Quantized GEMMs and the LM head of deepinfer-kernels on one CUDA device, at the ``v41-flash-scaled`` preset's
decode shapes (docs/hardware.md, "Kernels").

Shapes come from the preset's tensor catalogue: every FP8-block GEMM weight (q/kv/o projections, the indexer's
``wq_b``, the shared expert's merged ``[w1; w3]`` and ``w2``, Engram's ``wkv``, DSpark's ``main_proj``), the routed
experts' MXFP4 ``[w1; w3]`` and ``w2`` (one expert: ``mxfp4_gemm``; all experts with 6 routed experts per token:
``mxfp4_grouped_gemm``), and every BF16 weight the model multiplies (``bf16_gemm``: the compressor's ``wkv`` and
``wgate``, the indexer's ``weights_proj`` and ``wk`` with BF16 outputs, the router's gate, the LM head and DSpark's
Markov head with FP32 outputs).

Per shape and row count (--rows, tokens; the grouped GEMM gets 6 rows per token) it reports the median time per call
of CUDA-graph replays (one graph calls the op once per weight copy, enough copies to exceed L2, at most 32: the
weights come from HBM and the graph launch cost is shared), the weight bytes a call must read once (grouped: only
the experts that got rows), their GB/s and the ratio to the copy bandwidth measured in the same run (a 1 GiB
device-to-device copy, read + write bytes), and the rate ``2·rows·N·K`` / time in TFLOP/s (prefill-size row counts
are compute-bound).

Modes:
- ``--baseline``: times whatever ``deepinfer_kernels`` is on the path with its own tile choice (run it against the
  previous sources to get the "old" column); ``bf16_gemm`` as the model ran it before the op existed: cuBLAS
  ``torch.mm(x, w.t(), out_dtype=float32)``, then a rounding copy for a BF16 output.
- default: with ``--tune``, times ``gemm_candidates.candidate_configs`` per (op, row bucket, N, K) (``--decodings``
  limits the MMA candidates, ``--max-candidates`` their number: the first candidates are the default tile in each
  decoding), records every candidate's time, keeps the fastest and prints the ``MEASURED``
  entries; checks that the candidates of one decoding give the same bits (the K-chunk order is the same for all
  tiles) and whether row 0 of an M-row call equals the 1-row call (``bf16_gemm``: GEMV tiles up to two rows only).
  ``--compare old.json`` adds the old-vs-new ratio.
- ``--on-codes``: the FP8 block GEMM reads the quantizer's codes (``fp8_block_gemm_quantized``, the path of a fused
  norm's consumers: ``wq_a``, ``wkv``, the shared ``w1``) instead of the BF16 activation, timed and tuned so; the
  quantizer runs once, outside the timed graph.

Prints the table last and writes JSON (default benchmarks/results/kernels_gemm-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deepinfer_kernels import quantize_fp8_per_token_group
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.benchmarking import cuda_time_ms

TOP_K = 6
# The BF16 weights the model multiplies (the embedding, the Markov embedding and Engram's gate vectors are read by row).
_BF16_PRODUCTS = ("wkv.weight", "wgate.weight", "weights_proj.weight", "wk.weight", "gate.weight", "head.weight")


def device_label() -> str:
    name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip()
    return "nvidia-" + re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def random_bytes(shape: tuple[int, ...], low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, shape, device="cuda", dtype=torch.int32).to(torch.uint8)


def scales(shape: tuple[int, ...]) -> torch.Tensor:
    """UE8M0 scales with bytes 118…126 (2^−9 … 2^−1), the range of real weight scales."""
    return random_bytes(shape, 118, 127).view(torch.float8_e8m0fnu)


def preset_shapes() -> dict[str, list[tuple[str, int, int]]]:
    """(name, N, K) per op from the v41-flash-scaled catalogue; merged layers as the model runs them."""
    from deepinfer_model.config import load_preset
    from deepinfer_model.loading.catalogue import build_catalogue

    fp8: dict[tuple[int, int], str] = {}
    experts: dict[str, tuple[int, int]] = {}
    bf16: dict[tuple[int, int], str] = {}
    for entry in build_catalogue(load_preset("v41-flash-scaled")):
        name, shape = entry.name, tuple(entry.shape)
        if name.endswith(".weight") and entry.dtype == "F8_E4M3" and len(shape) == 2:
            if "engram.embed" in name or "wo_a" in name:  # a row table; grouped (kernels_fused.py)
                continue
            if name.endswith(("shared_experts.w3.weight",)):
                continue
            n, k = shape
            if name.endswith("shared_experts.w1.weight"):
                n *= 2  # merged [w1; w3]
            fp8.setdefault((n, k), re.sub(r"^(layers|mtp)\.\d+\.", "", name).removesuffix(".weight"))
        elif ".experts." in name and name.endswith((".w1.weight", ".w2.weight")) and entry.dtype == "I8":
            n, half_k = shape
            key = "experts.w13" if name.endswith("w1.weight") else "experts.w2"
            experts[key] = (2 * n if key == "experts.w13" else n, 2 * half_k)
        elif entry.dtype == "BF16" and len(shape) == 2 and name.endswith(_BF16_PRODUCTS):
            bf16.setdefault(shape, re.sub(r"^(layers|mtp)\.\d+\.", "", name).removesuffix(".weight"))
    return {
        "fp8_block_gemm": [(name, n, k) for (n, k), name in sorted(fp8.items(), key=lambda item: item[1])],
        "mxfp4_gemm": [(key, n, k) for key, (n, k) in sorted(experts.items())],
        "mxfp4_grouped_gemm": [(key, n, k) for key, (n, k) in sorted(experts.items())],
        "bf16_gemm": [(name, n, k) for (n, k), name in sorted(bf16.items(), key=lambda item: item[1])],
    }


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms, _ = cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeats=20)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def write_results(
    out: str | None, stem: str, label: str, repeats: int, copy_gbps: float, results: list, **extra: Any
) -> None:
    """Writes the run's JSON (``out``, default benchmarks/results/<stem>-<label>.json); prints the table's preamble."""
    path = pathlib.Path(out or pathlib.Path(__file__).parent / "results" / f"{stem}-{label}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": label, "torch": torch.__version__, "repeats": repeats, "copy_gbps": copy_gbps, **extra}
    path.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    print(f"wrote {path}")
    print(f"\ndevice {label}, torch {torch.__version__}; copy bandwidth {copy_gbps:.0f} GB/s (read + write)")


def routed_ids(tokens: int, experts: int) -> torch.Tensor:
    """Each token's TOP_K distinct uniformly random experts, flattened (one row per (token, expert))."""
    return torch.rand(tokens, experts, device="cuda").topk(TOP_K, dim=1).indices.reshape(-1)


def inputs_for(op: str, n: int, k: int, experts: int) -> tuple[torch.Tensor, ...]:
    if op == "fp8_block_gemm":
        return (random_bytes((n, k)) & 0xF7).view(torch.float8_e4m3fn), scales((-(-n // 32), k // 32))
    if op == "mxfp4_gemm":
        return random_bytes((n, k // 2)).view(torch.int8), scales((n, k // 32))
    if op == "mxfp4_grouped_gemm":
        return random_bytes((experts, n, k // 2)).view(torch.int8), scales((experts, n, k // 32))
    return (torch.randn(n, k, device="cuda").to(torch.bfloat16),)


def call(
    op: str,
    baseline: bool,
    x: torch.Tensor,
    ids: torch.Tensor | None,
    weights: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    config: Any = None,
    on_codes: bool = False,
) -> Callable[[], None]:
    if op == "bf16_gemm" and baseline:
        (w,) = weights
        if out.dtype == torch.float32:
            return lambda: torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        return lambda: out.copy_(torch.mm(x, w.t(), out_dtype=torch.float32))
    kwargs = {} if config is None else {"config": config}
    if on_codes and op == "fp8_block_gemm":
        codes = quantize_fp8_per_token_group(x)
        on_codes_impl = implementation("fp8_block_gemm_quantized", Backend.NVIDIA)
        return lambda: on_codes_impl(*codes, *weights, out, **kwargs)
    impl = implementation(op, Backend.NVIDIA)
    head = (x, ids) if ids is not None else (x,)
    return lambda: impl(*head, *weights, out, **kwargs)


def time_us(fns: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median µs per call: one CUDA graph runs every fn once (each on its own weight copy, so that the weights do not
    sit in L2 between calls and the graph launch is shared); the replay time is divided by the calls."""

    def run_all() -> None:
        for fn in fns:
            fn()

    ms, graphed = cuda_time_ms(run_all, warmup=3, repeats=repeats)
    if not graphed:
        raise RuntimeError("a timed call could not be captured in a CUDA graph")
    return ms * 1e3 / len(fns)


def weight_copies(weights: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """The weights and enough copies of them to fill 256 MiB (at most 32 in all): more than the 50 MB L2 holds."""
    size = sum(w.numel() * w.element_size() for w in weights)
    count = max(1, min(32, -(-(256 << 20) // size)))
    return [weights] + [tuple(w.clone() for w in weights) for _ in range(count - 1)]


def tune(
    op: str,
    n: int,
    x: torch.Tensor,
    ids: torch.Tensor | None,
    copies: list[tuple[torch.Tensor, ...]],
    rows: int,
    repeats: int,
    decodings: list[str] | None,
    max_candidates: int | None,
    on_codes: bool,
    out_dtype: torch.dtype,
) -> tuple[Any, list[dict[str, Any]], bool]:
    """Fastest candidate tiles (only those with one of ``decodings`` when given, the first ``max_candidates`` of
    them), every candidate's time, and whether candidates of the same decoding gave the same bits (the K-chunk order
    is the same for all tiles)."""
    from deepinfer_kernels.cuda.gemm_candidates import candidate_configs

    best, best_us, timed, same = None, float("inf"), [], True
    reference: dict[str, torch.Tensor] = {}
    candidates = [c for c in candidate_configs(op, rows) if c.gemv or not decodings or c.decoding in decodings]
    for cfg in candidates[:max_candidates]:
        out = torch.zeros(x.shape[0], n, dtype=out_dtype, device="cuda")
        us = time_us([call(op, False, x, ids, weights, out, cfg, on_codes) for weights in copies], repeats)
        timed.append({"config": repr(cfg), "us": us})
        print(f"  {cfg!r}: {us:.1f} us", flush=True)
        same &= torch.equal(out, reference.setdefault(cfg.decoding, out.clone()))
        if us < best_us:
            best, best_us = cfg, us
    return best, timed, same


def part_times(n: int, k: int, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Diagnostics: the activation quantizer alone, 16 calls per graph."""
    from deepinfer_kernels.cuda.gemm import quantized_activation

    return {"quantize_us": time_us([lambda: quantized_activation(x)] * 16, repeats)}


def table_times(ids: torch.Tensor, experts: int, repeats: int) -> dict[str, float]:
    """Diagnostics: the grouped GEMM's tile tables (16-row tiles) from the PyTorch ops and, up to their row limit, from
    the one Triton launch, 16 calls per graph."""
    from deepinfer_kernels.cuda.grouped_gemm import expert_tiles
    from deepinfer_kernels.cuda.grouped_tiles import MAX_ROWS, expert_tiles_one_launch

    times = {"tables_torch_us": time_us([lambda: expert_tiles(ids, experts, 16)] * 16, repeats)}
    if ids.numel() <= MAX_ROWS:
        times["tables_triton_us"] = time_us([lambda: expert_tiles_one_launch(ids, experts, 16)] * 16, repeats)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64", help="comma-separated token counts")
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--grouped-tokens", default="1,64,256", help="token counts of the grouped GEMM")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--ops", default=None, help="comma-separated ops to run (default: all)")
    parser.add_argument("--decodings", default=None, help="with --tune: only MMA candidates of these decodings")
    parser.add_argument("--max-candidates", type=int, default=None, help="with --tune: time only the first N")
    parser.add_argument("--parts", action="store_true", help="also time the quantizer alone (grouped: the tile tables)")
    parser.add_argument("--on-codes", action="store_true", help="fp8_block_gemm on the quantizer's codes")
    parser.add_argument("--compare", default=None, help="JSON of a --baseline run: adds old/new ratios")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_gemm-<device>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_gemm.py needs a CUDA device")
    torch.manual_seed(0)
    label = device_label()
    copy_gbps = copy_bandwidth_gbps()
    old = {}
    if args.compare:
        for p in json.loads(pathlib.Path(args.compare).read_text())["results"]:
            old[(p["op"], p["n"], p["k"], p["tokens"])] = p["median_us"]
    results: list[dict[str, Any]] = []
    measured: dict[str, Any] = {}
    for op, shapes in preset_shapes().items():
        if args.ops and op not in args.ops.split(","):
            continue
        for name, n, k in shapes:
            weights = inputs_for(op, n, k, args.experts)
            copies = weight_copies(weights)
            token_counts = [
                int(v) for v in (args.grouped_tokens if op == "mxfp4_grouped_gemm" else args.rows).split(",")
            ]
            first_row: torch.Tensor | None = None
            for tokens in token_counts:
                ids = routed_ids(tokens, args.experts) if op == "mxfp4_grouped_gemm" else None
                m = tokens * TOP_K if ids is not None else tokens
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                if ids is None and first_row is not None:
                    x[0] = first_row
                first_row = x[0].clone()
                out_dtype = torch.float32 if op == "bf16_gemm" and not name.startswith("attn.") else torch.bfloat16
                point: dict[str, Any] = {"op": op, "name": name, "n": n, "k": k, "tokens": tokens, "rows": m}
                point["on_codes"] = args.on_codes and op == "fp8_block_gemm"
                if args.tune and not args.baseline and (op != "bf16_gemm" or m <= 2):
                    from deepinfer_kernels.cuda.gemm_tiles import grouped_tile_rows, row_bucket

                    per_expert = grouped_tile_rows(m, args.experts) if ids is not None else m
                    key = f'("{op}", {row_bucket(per_expert)}, {n}, {k})'
                    if key in measured:  # tuned at the bucket's first (smallest) token count
                        cfg = measured[key]
                    else:
                        decodings = args.decodings.split(",") if args.decodings else None
                        cfg, point["candidates"], point["candidates_bitwise_equal"] = tune(
                            op,
                            n,
                            x,
                            ids,
                            copies,
                            per_expert,
                            args.repeats,
                            decodings,
                            args.max_candidates,
                            args.on_codes,
                            out_dtype,
                        )
                        measured[key] = cfg
                    point["config"] = repr(cfg)
                else:
                    cfg = None
                out = torch.zeros(m, n, dtype=out_dtype, device="cuda")
                fns = [call(op, args.baseline, x, ids, w, out, cfg, args.on_codes) for w in copies]
                point["median_us"] = time_us(fns, args.repeats)
                point["calls_per_graph"] = len(fns)
                if ids is None:
                    one = torch.zeros(1, n, dtype=out_dtype, device="cuda")
                    call(op, args.baseline, x[:1].contiguous(), None, weights, one, on_codes=args.on_codes)()
                    point["row0_equals_1_row_call"] = bool(torch.equal(one[0], out[0]))
                if args.parts and ids is None and op != "bf16_gemm" and not args.baseline:
                    point.update(part_times(n, k, x, args.repeats))
                if args.parts and ids is not None:
                    point.update(table_times(ids, args.experts, args.repeats))
                touched = int(torch.unique(ids).numel()) if ids is not None else 1
                point["weight_bytes"] = (
                    sum(w.numel() * w.element_size() for w in weights)
                    * touched
                    // (args.experts if ids is not None else 1)
                )
                point["weight_gbps"] = point["weight_bytes"] / point["median_us"] / 1e3
                point["copy_fraction"] = point["weight_gbps"] / copy_gbps
                point["tflops"] = 2 * m * n * k / point["median_us"] / 1e6  # every row routed (grouped: m = 6·tokens)
                if (op, n, k, tokens) in old:
                    point["old_us"] = old[(op, n, k, tokens)]
                    point["speedup"] = point["old_us"] / point["median_us"]
                results.append(point)
                print(f"{op} {name} {n}x{k} tokens={tokens}: {point['median_us']:.1f} us", flush=True)
                if "tables_torch_us" in point:
                    triton_us = point.get("tables_triton_us", float("nan"))
                    print(f"  tile tables: PyTorch ops {point['tables_torch_us']:.1f} us, Triton {triton_us:.1f} us")
    if measured:
        print("MEASURED = {")
        for key, cfg in measured.items():
            print(f"    {key}: {cfg!r},")
        print("}")
    write_results(args.out, "kernels_gemm", label, args.repeats, copy_gbps, results, baseline=args.baseline)
    header = f"{'op':<19} {'shape':<22} {'N':>6} {'K':>5} {'tok':>4} {'old us':>8} {'us':>8} {'x':>5}"
    print(f"{header} {'GB/s':>6} {'copy%':>6} {'TFLOP/s':>8}")
    for p in results:
        old_us = f"{p['old_us']:>8.1f}" if "old_us" in p else f"{'':>8}"
        ratio = f"{p['speedup']:>5.1f}" if "speedup" in p else f"{'':>5}"
        print(
            f"{p['op']:<19} {p['name'][:22]:<22} {p['n']:>6} {p['k']:>5} {p['tokens']:>4} {old_us} "
            f"{p['median_us']:>8.1f} {ratio} {p['weight_gbps']:>6.0f} {100 * p['copy_fraction']:>5.0f}% "
            f"{p['tflops']:>8.1f}"
        )


if __name__ == "__main__":
    main()
