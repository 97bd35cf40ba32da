"""The grouped MXFP4 MoE GEMM's ``swap_bf16`` tiles at prefill sizes, with and without tail tiles, on random and on
balanced routing (docs/design/kernels.md, "Tail tiles").

Per expert shape of the ``v41-flash-scaled`` preset (``w13``, ``w2``), routing and tile it reports the median time
per call (CUDA-graph replays, ``kernels_gemm.time_us``; the call includes the sorted BF16 copy and, with tails, the
second launch), the tiles that get rows, how full they are, and two rates: useful (``2·rows·N·K`` over the time) and
executed (the MMA rows the tiles run, full tiles counted whole). ``random``: each token's 6 distinct experts drawn
uniformly (about 128 ± 11 rows an expert at 8,192 tokens); ``balanced``: token t takes experts ``6t … 6t+5`` mod 384,
exactly 128 rows each, so a 128-row tile has no padding: the gap between the two is what partial tiles cost.

Tiles are ``BLOCK_MxBLOCK_NxWARPS`` with an optional ``tTAIL_M`` (``128x128x8t32``). Prints the table last and writes
JSON (default benchmarks/results/grouped_tails-<device>.json).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
from kernels_gemm import (
    TOP_K,
    copy_bandwidth_gbps,
    device_label,
    inputs_for,
    preset_shapes,
    routed_ids,
    time_us,
    write_results,
)

EXPERTS = 384


def tile_config(spec: str) -> Any:
    from deepinfer_kernels.cuda.gemm_tiles import swap_bf16_tile

    tile, _, tail = spec.partition("t")
    block_m, block_n, warps = (int(v) for v in tile.split("x"))
    return swap_bf16_tile(block_m, block_n, warps, tail_m=int(tail or 0))


def balanced_ids(tokens: int) -> torch.Tensor:
    t = torch.arange(tokens, device="cuda")[:, None]
    return ((t * TOP_K + torch.arange(TOP_K, device="cuda")) % EXPERTS).reshape(-1)


def executed_rows(ids: torch.Tensor, cfg: Any) -> tuple[int, int, int]:
    """(whole tiles with rows, tail tiles with rows, MMA rows they run)."""
    from deepinfer_kernels.cuda.grouped_gemm import expert_tiles, tail_tiles

    tiles = int((expert_tiles(ids, EXPERTS, cfg.block_m, cfg.tail_m)[1] < EXPERTS).sum())
    tails = int((tail_tiles(ids, EXPERTS, cfg.block_m, cfg.tail_m)[0] < EXPERTS).sum()) if cfg.tail_m else 0
    return tiles, tails, tiles * cfg.block_m + tails * cfg.tail_m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--tiles", default="128x128x8,128x128x8t16,128x128x8t32,64x128x8")
    parser.add_argument("--routings", default="random,balanced")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/grouped_tails-<device>.json)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("grouped_tails.py needs a CUDA device")
    from deepinfer_kernels.cuda.grouped_gemm import mxfp4_grouped_gemm

    torch.manual_seed(0)
    label = device_label()
    copy_gbps = copy_bandwidth_gbps()
    m = args.tokens * TOP_K
    results: list[dict[str, Any]] = []
    for name, n, k in preset_shapes()["mxfp4_grouped_gemm"]:
        packed, scale = inputs_for("mxfp4_grouped_gemm", n, k, EXPERTS)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        for routing in args.routings.split(","):
            ids = routed_ids(args.tokens, EXPERTS) if routing == "random" else balanced_ids(args.tokens)
            for spec in args.tiles.split(","):
                cfg = tile_config(spec)
                us = time_us(
                    [functools.partial(mxfp4_grouped_gemm, x, ids, packed, scale, out, config=cfg)], args.repeats
                )
                tiles, tails, rows = executed_rows(ids, cfg)
                point = {"name": name, "n": n, "k": k, "tokens": args.tokens, "routing": routing, "tile": spec,
                         "config": repr(cfg), "median_us": us, "tiles": tiles, "tail_tiles": tails,
                         "fill": m / rows, "useful_tflops": 2 * m * n * k / us / 1e6,
                         "executed_tflops": 2 * rows * n * k / us / 1e6}  # fmt: skip
                results.append(point)
                print(f"{name} {routing} {spec}: {us:.1f} us", flush=True)
    write_results(args.out, "grouped_tails", label, args.repeats, copy_gbps, results)
    header = f"{'shape':<12} {'routing':<9} {'tile':<13} {'us':>9} {'tiles':>6} {'tails':>6}"
    print(f"{header} {'fill':>6} {'useful':>7} {'exec':>7}")
    for p in results:
        print(
            f"{p['name']:<12} {p['routing']:<9} {p['tile']:<13} {p['median_us']:>9.1f} {p['tiles']:>6} "
            f"{p['tail_tiles']:>6} {p['fill']:>6.3f} {p['useful_tflops']:>7.1f} {p['executed_tflops']:>7.1f}"
        )
    print("(useful / exec: TFLOP/s over the routed rows / over the rows the tiles run)")


if __name__ == "__main__":
    main()
