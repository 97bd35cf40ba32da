"""Time the paged-cache ops (Triton against the reference) at DeepSeek-V4.1-Flash widths on one CUDA device.

Usage (needs a CUDA device; prints a table, and writes it as JSON when given a path):

    python packages/deepinfer-kernels/benchmarks/bench_sparse.py [--sweep] [--json PATH]

Widths: 64 heads × 512 (attention), window 128, index top-k 512, index 32 heads × 128, candidate blocks 2048 × 8.
Decode steps use batch 1 and 32; context lengths 8K, 32K and 128K (ratio-1 layers: one index row per token). Each
op is a CUDA-graph replay where it can be captured (``benchmarking.cuda_time_ms``). Random inputs come from
CPU generators: a failed capture (the reference store synchronizes) leaves the CUDA generator unusable.
``--sweep`` first times the tile configurations of the two Triton kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.benchmarking import cuda_time_ms
from deepinfer_kernels.cuda import attention as cuda_attention
from deepinfer_kernels.cuda import indexer as cuda_indexer
from deepinfer_kernels.testing import random_normal

F = dk.RowFormat
HEADS, DIM, WINDOW, TOPK, INDEX_HEADS, INDEX_DIM = 64, 512, 128, 512, 32, 128


def _pool(rows: int, width: int, fmt: dk.RowFormat, seed: int) -> torch.Tensor:
    return dk.encode_rows(random_normal((rows, width), seed=seed, device="cuda"), fmt)


def _attention_args(tokens: int, context: int, seed: int) -> tuple:
    ring = _pool(max(tokens, 32) * WINDOW, DIM, F.FP8, seed)
    compressed = _pool(context, DIM, F.FP4_E4M3, seed + 1)
    gen = torch.Generator().manual_seed(seed)
    ring_rows = torch.randint(0, ring.shape[0], (tokens, WINDOW), generator=gen).cuda()
    chosen = torch.randint(0, context, (tokens, TOPK), generator=gen).cuda()
    sources = [dk.KeySource(ring, ring_rows, F.FP8), dk.KeySource(compressed, chosen, F.FP4_E4M3)]
    q = random_normal((tokens, HEADS, DIM), seed=seed + 2, dtype=torch.bfloat16, device="cuda")
    sink = random_normal((HEADS,), seed=seed + 3, device="cuda")
    return q, sources, sink, DIM**-0.5, True, torch.empty((tokens, HEADS, DIM), device="cuda")


def _index_args(tokens: int, context: int, seed: int, *, blocks: bool = False, restricted: bool = False) -> tuple:
    per_block = 64
    requests = min(tokens, 32)
    pages = -(-context // per_block)
    pool = _pool(requests * pages * per_block, INDEX_DIM, F.FP4_UE8M0, seed)
    fp4 = F.FP4_UE8M0
    q = dk.decode_rows(
        dk.encode_rows(random_normal((tokens, INDEX_HEADS, INDEX_DIM), seed=seed + 1, device="cuda"), fp4), fp4
    )
    weights = random_normal((tokens, INDEX_HEADS), seed=seed + 2, device="cuda")
    table = torch.randperm(requests * pages, generator=torch.Generator().manual_seed(seed)).view(requests, pages).cuda()
    token_request = torch.arange(tokens, device="cuda") % requests
    num_rows = torch.full((tokens,), context, device="cuda")
    candidates = None
    if restricted:
        candidates = torch.sort(torch.randperm(context // 8)[:2048].cuda()).values.expand(tokens, -1).contiguous()
    out_rows = torch.empty((tokens, TOPK), dtype=torch.int64, device="cuda")
    out_blocks = torch.empty((tokens, 2048), dtype=torch.int64, device="cuda") if blocks else None
    return (
        q, weights, pool, F.FP4_UE8M0, table, per_block, token_request, num_rows, context, TOPK, True,
        candidates, 8 if blocks or restricted else 0, 2048 if blocks else 0, out_rows, out_blocks,
    )  # fmt: skip


def _store_args(rows: int, fmt: dk.RowFormat, width: int) -> tuple:
    pool = torch.zeros((4 * rows, dk.bytes_per_row(fmt, width)), dtype=torch.uint8, device="cuda")
    slots = torch.randperm(4 * rows)[:rows].cuda()
    return pool, slots, random_normal((rows, width), seed=5, dtype=torch.bfloat16, device="cuda"), fmt


def _time(op: str, backend: Backend, args: tuple, repeats: int) -> float:
    ms, _ = cuda_time_ms(functools.partial(implementation(op, backend), *args), warmup=2, repeats=repeats)
    return ms * 1e3


def _cases() -> list[tuple[str, str, Callable[[], tuple], bool]]:
    cases: list[tuple[str, str, Callable[[], tuple], bool]] = []
    for batch in (1, 32):
        for context in (8192, 32768, 131072):
            label = f"decode b={batch} ctx={context // 1024}K"
            cases.append(("sparse_attention", label, functools.partial(_attention_args, batch, context, 1), True))
            cases.append(("indexer_select", label, functools.partial(_index_args, batch, context, 2), True))
    cases.append(
        (
            "indexer_select",
            "decode b=32 ctx=128K +blocks",
            functools.partial(_index_args, 32, 131072, 3, blocks=True),
            True,
        )
    )
    cases.append(
        (
            "indexer_select",
            "decode b=32 ctx=128K restricted",
            functools.partial(_index_args, 32, 131072, 4, restricted=True),
            True,
        )
    )
    for tokens, context in ((8192, 8192), (2048, 32768), (1024, 131072)):
        label = f"prefill chunk {tokens} ctx={context // 1024}K"
        cases.append(
            ("sparse_attention", label, functools.partial(_attention_args, tokens, context, 5), tokens <= 2048)
        )
        cases.append(
            ("indexer_select", label, functools.partial(_index_args, tokens, context, 6), tokens * context <= 2**27)
        )
    for fmt, width in ((F.FP8, 512), (F.FP4_E4M3, 512), (F.FP4_UE8M0, 128)):
        cases.append(("store_rows", f"8192 rows {fmt.name}", functools.partial(_store_args, 8192, fmt, width), True))
    return cases


def _sweep() -> None:
    print("sweep: sparse_attention decode b=1 and b=32 / prefill 2048 tokens, indexer decode b=32 ctx=32K (us)")
    args = {
        "b1": _attention_args(1, 32768, 7),
        "b32": _attention_args(32, 32768, 7),
        "p2048": _attention_args(2048, 32768, 8),
    }
    default = dict(cuda_attention.TILES)
    for block_h, block_n, warps, stages in (
        (64, 16, 8, 1), (64, 32, 8, 1), (64, 16, 8, 2), (32, 16, 8, 1), (32, 32, 8, 2), (16, 16, 4, 2), (64, 16, 16, 1)
    ):  # fmt: skip
        cuda_attention.TILES.update(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            times = {
                name: _time("sparse_attention", Backend.NVIDIA, a, 5 if name == "p2048" else 20)
                for name, a in args.items()
            }
        except Exception as error:  # a tile that does not fit is reported and skipped
            print(f"  attention h={block_h} n={block_n} warps={warps} stages={stages}: {type(error).__name__}")
            continue
        cells = "  ".join(f"{name} {value:9.1f}" for name, value in times.items())
        print(f"  attention h={block_h} n={block_n} warps={warps} stages={stages}: {cells}")
    cuda_attention.TILES.update(default)
    index_args = _index_args(32, 32768, 9)
    default = dict(cuda_indexer.CONFIG)
    for block_r, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
        cuda_indexer.CONFIG.update(block_r=block_r, num_warps=warps)
        elapsed = _time("indexer_select", Backend.NVIDIA, index_args, 20)
        print(f"  indexer block_r={block_r} warps={warps}: {elapsed:9.1f}")
    cuda_indexer.CONFIG.update(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sparse.py needs a CUDA device")
    if options.sweep:
        _sweep()
    records = []
    print(f"{'op':18s} {'case':34s} {'triton us':>12s} {'reference us':>14s} {'speed-up':>9s}")
    for op, label, make, with_reference in _cases():
        args = make()
        fast = _time(op, Backend.NVIDIA, args, 20)
        ref = _time(op, Backend.REFERENCE, args, 3) if with_reference else float("nan")
        records.append({"op": op, "case": label, "triton_us": fast, "reference_us": ref})
        print(f"{op:18s} {label:34s} {fast:12.1f} {ref:14.1f} {ref / fast:9.1f}")
        del args
        torch.cuda.empty_cache()
    if options.json:
        with open(options.json, "w") as handle:
            json.dump(records, handle, indent=1)


if __name__ == "__main__":
    main()
