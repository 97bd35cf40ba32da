"""One call of the grouped MXFP4 MoE GEMM at the scaled preset's ``w13`` shape, for Nsight Compute.

384 experts of ``[4608, 5120]`` MXFP4 weights (random codes, scale bytes 118 … 125), ``--tokens`` tokens routed to
6 distinct experts each, the nvidia backend's own tiles (``gemm_tiles.block_config``). The op runs four times; profile
the third ``mxfp4_kernel`` launch (the first two compile and warm up):

    ncu --kernel-name regex:mxfp4_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_grouped_gemm.py --tokens 64

The reports of the H200 runs are ``benchmarks/results/ncu-mxfp4-grouped-w13-t*.txt`` (docs/design/kernels.md,
"GEMM tiles and split-K").
"""

from __future__ import annotations

import argparse

import torch

import deepinfer_kernels as dk

EXPERTS, N, K, TOP_K = 384, 4608, 5120, 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_grouped_gemm.py needs a CUDA device")
    packed = torch.randint(-128, 128, (EXPERTS, N, K // 2), dtype=torch.int8, device="cuda")
    scale = torch.randint(118, 126, (EXPERTS, N, K // 32), dtype=torch.uint8, device="cuda")
    ids = torch.rand(args.tokens, EXPERTS, device="cuda").topk(TOP_K).indices.flatten()
    x = torch.randn(args.tokens * TOP_K, K, device="cuda").to(torch.bfloat16)
    for _ in range(4):
        dk.mxfp4_grouped_gemm(x, ids, packed, scale.view(torch.float8_e8m0fnu))
    torch.cuda.synchronize()
    print(f"ran the grouped GEMM 4 times at {args.tokens} tokens")


if __name__ == "__main__":
    main()
