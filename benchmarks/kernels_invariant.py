"""The batch-invariant mode's BF16 products against cuBLAS on one CUDA device, at the ``v41-flash-scaled`` preset's
shapes (docs/design/kernels.md, "Batch-invariant products").

In the invariant mode every ``torch.mm(x, w.t(), out_dtype=float32)`` of the model (the LM head, the routers, the
compressors' and the indexers' BF16 projections) runs ``deepinfer_kernels``' nvidia ``invariant_matmul`` instead of
cuBLAS. Per weight shape and row count (--rows) this times, as medians of CUDA-graph replays on enough weight copies
to exceed L2 (``kernels_gemm.time_us``): cuBLAS, the invariant kernel on its own tile choice, and with --tune every
candidate tile of --tiles (``block_m x block_n x warps x stages``), each checked to give the default tile's bits. It
also checks that row 0 of the product equals the one-row product. Prints a table last and writes JSON (default
benchmarks/results/kernels_invariant-<device>.json).

Usage:
    python benchmarks/kernels_invariant.py [--rows 1,64,256] [--tune] [--tiles 128x128x8x3,128x256x8x3]
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list
from kernels_gemm import copy_bandwidth_gbps, time_us, weight_copies

from deepinfer_kernels._registry import Backend, implementation

_DEFAULT_TILES = "64x128x4x3,128x128x8x3,128x128x8x4,128x256x8x3,256x128x8x3,128x128x4x3"


def preset_products() -> list[tuple[str, int, int]]:
    """(name, N, K) of the BF16 products a decode step runs, one per weight shape, from the preset's catalogue."""
    from deepinfer_model.config import load_preset
    from deepinfer_model.loading.catalogue import build_catalogue

    shapes: dict[tuple[int, int], str] = {}
    for entry in build_catalogue(load_preset("v41-flash-scaled")):
        name = re.sub(r"^(layers|mtp)\.\d+\.", "", entry.name).removesuffix(".weight")
        # The embedding is a row table and the draft heads run only when drafting.
        if entry.dtype != "BF16" or len(entry.shape) != 2 or name.startswith(("embed", "markov", "confidence")):
            continue
        if name.startswith("engram.") and name.endswith(("q_weight", "k_weight")):
            continue  # Engram's gate vectors: a fused kernel's operands, not products
        n, k = entry.shape
        shapes.setdefault((n, k), name)
    return [(name, n, k) for (n, k), name in shapes.items()]


def tile_text(tile: Any) -> str:
    return f"{tile.block_m}x{tile.block_n}x{tile.num_warps}x{tile.num_stages}"


def parse_tile(text: str) -> Any:
    from deepinfer_kernels.cuda.invariant_matmul import RowTile

    block_m, block_n, warps, stages = (int(part) for part in text.split("x"))
    return RowTile(block_m, block_n, warps, stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int_list, default=[1, 64, 256], help="comma-separated row counts")
    parser.add_argument("--tune", action="store_true", help="also time every tile of --tiles")
    parser.add_argument("--tiles", default=_DEFAULT_TILES, help="block_m x block_n x warps x stages, comma-separated")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--git-commit", default=None, help="the commit measured (default: this checkout's)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_invariant.py needs a CUDA device")
    torch.manual_seed(0)
    matmul = implementation("invariant_matmul", Backend.NVIDIA)
    copy_gbps = copy_bandwidth_gbps()
    tiles = [parse_tile(text) for text in args.tiles.split(",")] if args.tune else []
    results: list[dict[str, Any]] = []
    for name, n, k in preset_products():
        copies = weight_copies((torch.randn(n, k, device="cuda").to(torch.bfloat16),))
        for rows in args.rows:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(1, rows, n, dtype=torch.float32, device="cuda")

            def invariant(w: torch.Tensor, tile: Any = None, x: torch.Tensor = x, out: torch.Tensor = out) -> None:
                # Without a tile, the kernel's own choice (and the call an older kernel module takes).
                matmul(x[None], w.t()[None], out, *([tile] if tile else []))

            def cublas(w: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out) -> None:
                torch.mm(x, w.t(), out_dtype=torch.float32, out=out[0])

            point: dict[str, Any] = {"name": name, "n": n, "k": k, "rows": rows}
            point["cublas_us"] = time_us([lambda w=w: cublas(w) for (w,) in copies], args.repeats)
            point["invariant_us"] = time_us([lambda w=w: invariant(w) for (w,) in copies], args.repeats)
            default = out.clone()
            one = torch.empty(1, 1, n, dtype=torch.float32, device="cuda")
            matmul(x[None, :1], copies[0][0].t()[None], one)
            point["row0_equals_1_row_call"] = bool(torch.equal(one[0, 0], default[0, 0]))
            point["tiles"] = []
            for tile in tiles:
                us = time_us([lambda w=w, tile=tile: invariant(w, tile) for (w,) in copies], args.repeats)
                same = bool(torch.equal(out, default))
                point["tiles"].append({"tile": tile_text(tile), "us": us, "bitwise_equal": same})
                print(f"  {tile_text(tile)}: {us:.1f} us{'' if same else '  BITS DIFFER'}", flush=True)
            point["gflop"] = 2 * rows * n * k / 1e9
            point["weight_gbps"] = n * k * 2 / point["invariant_us"] / 1e3
            results.append(point)
            print(
                f"{name} {n}x{k} rows={rows}: cuBLAS {point['cublas_us']:.1f}, invariant {point['invariant_us']:.1f} us"
            )
    label = device_label("cuda")
    path = args.out or RESULTS / f"kernels_invariant-{label}.json"
    meta = {"device": label, "torch": torch.__version__, "git_commit": args.git_commit or git_commit()}
    payload = {**meta, "copy_gbps": copy_gbps, "repeats": args.repeats, "results": results}
    RESULTS.mkdir(exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(payload, indent=2) + "\n")
    print(f"\ndevice {label}, copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    print(
        f"{'product':<32} {'N':>7} {'K':>5} {'rows':>5} {'cuBLAS us':>10} {'inv. us':>9} {'x':>5} {'best tile, us':>20}"
    )
    for p in results:
        best = min(p["tiles"], key=lambda t: t["us"], default=None)
        best_text = f"{best['tile']} {best['us']:.1f}" if best else ""
        print(
            f"{p['name'][:32]:<32} {p['n']:>7} {p['k']:>5} {p['rows']:>5} {p['cublas_us']:>10.1f} "
            f"{p['invariant_us']:>9.1f} {p['invariant_us'] / p['cublas_us']:>5.2f} {best_text:>20}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
