"""Tiles of the mHC mix-GEMM kernel (``cuda.hyper_connection._mix_logits_kernel``) at a prompt's trunk, on one CUDA
device (docs/design/kernels.md, "mHC ops").

The kernel runs beyond 16 tokens outside the batch-invariant mode: per (64 tokens, 512-column chunk of the flattened
``[n, m·H]`` trunk) it forms the TF32 products with ``fn`` and ``Σz²`` as FP32 partials. Each tile (tokens a
program, K step, warps, pipeline stages) is launched directly on the ``v41-flash-scaled`` shape (m = 4 streams of
H = 5,120, 24 ``fn`` rows) at --tokens and timed by ``cuda_time_ms`` (median of CUDA-graph replays). ``same`` says
whether its partials have the bits of the first tile of the same K step (tokens, warps and stages do not change a
row's sums; the K step changes the order of ``Σz²``). The bandwidth counts the trunk's BF16 bytes once.

Usage (PYTHONPATH holding the packages' src directories):
    python3 benchmarks/tune_mix_logits.py [--tokens 8192] [--out PATH]

Prints the table last and writes JSON (default benchmarks/results/tune_mix_logits-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable

import torch
import triton
from bench_common import RESULTS, device_label, git_commit

from deepinfer_kernels.benchmarking import cuda_time_ms
from deepinfer_kernels.cuda import hyper_connection as hc

# (tokens a program, K step, warps, stages); the first is the tile before the thirtieth session.
TILES = [
    (64, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 64, 4, 4),
    (64, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),
    (256, 64, 8, 3),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (64, 32, 4, 4),
    (128, 32, 8, 4),
    (128, 32, 4, 4),
]


def preset_shape() -> tuple[int, int, int]:
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    return text.hc_mult, text.hidden_size, (2 + text.hc_mult) * text.hc_mult


def launcher(
    trunk: torch.Tensor, fn: torch.Tensor, rows: int, tile: tuple[int, int, int, int]
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A launch of the kernel on ``tile`` (tokens a program, K step, warps, stages) and the partials it writes."""
    block_m, block_k, warps, stages = tile
    n, width = trunk.shape[0], trunk.shape[1] * trunk.shape[2]
    splits = triton.cdiv(width, hc._CHUNK)
    block_r = max(16, triton.next_power_of_2(rows))
    part = torch.empty((splits, n, block_r), dtype=torch.float32, device=trunk.device)
    sum_sq = torch.empty((splits, n), dtype=torch.float32, device=trunk.device)

    def launch() -> None:
        hc._mix_logits_kernel[(triton.cdiv(n, block_m), splits)](
            trunk, fn, part, sum_sq, n, width, rows, CHUNK=hc._CHUNK, BLOCK_M=block_m, BLOCK_R=block_r,
            BLOCK_K=block_k, TF32=True, enable_fp_fusion=False, PDL=False, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    return launch, part, sum_sq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_mix_logits.py needs a CUDA device")
    m, hidden, rows = preset_shape()
    n, width = args.tokens, m * hidden
    generator = torch.Generator(device="cuda").manual_seed(0)
    trunk = torch.randn((n, m, hidden), generator=generator, device="cuda").to(torch.bfloat16)
    fn = torch.randn((rows, width), generator=generator, device="cuda") * 0.01
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    records = []
    for block_m, block_k, warps, stages in TILES:
        launch, part, sum_sq = launcher(trunk, fn, rows, (block_m, block_k, warps, stages))
        launch()
        torch.cuda.synchronize()
        reference = first.setdefault(block_k, (part.clone(), sum_sq.clone()))
        same = torch.equal(part[..., :rows], reference[0][..., :rows]) and torch.equal(sum_sq, reference[1])
        ms, _ = cuda_time_ms(launch)
        records.append(
            {"block_m": block_m, "block_k": block_k, "num_warps": warps, "num_stages": stages, "us": ms * 1e3,
             "trunk_bytes_per_s": trunk.numel() * 2 / (ms * 1e-3), "same_bits_as_first_of_its_k_step": same}
        )  # fmt: skip
        print(f"{block_m} {block_k} {warps} {stages}: {ms * 1e3:.1f} us", flush=True)
    out = args.out or RESULTS / f"tune_mix_logits-{device_label('cuda')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "git_commit": git_commit(), "tokens": n, "m": m, "hidden": hidden}
    out.write_text(json.dumps({**meta, "records": records}, indent=1) + "\n")
    print(f"\n{'BM':>4} {'BK':>4} {'w':>2} {'st':>2} {'us':>8} {'TB/s':>6} same")
    for r in records:
        print(
            f"{r['block_m']:>4} {r['block_k']:>4} {r['num_warps']:>2} {r['num_stages']:>2} {r['us']:>8.1f} "
            f"{r['trunk_bytes_per_s'] / 1e12:>6.2f} {r['same_bits_as_first_of_its_k_step']}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
