"""One call of the grouped MXFP4 MoE GEMM at the scaled preset's ``w13`` shape, for Nsight Compute.

384 experts of ``[4608, 5120]`` MXFP4 weights (random codes, scale bytes 118 … 125), ``--tokens`` tokens routed to
6 distinct experts each, the nvidia backend's own tiles (``gemm_tiles.block_config``) or, with ``--tile``, a
``swap_bf16`` tile (``grouped_tails.py``'s spelling, ``128x128x8`` or ``128x128x8t32``). The op runs four times; profile
the third ``mxfp4_kernel`` launch (the first two compile and warm up):

    ncu --kernel-name regex:mxfp4_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \\
        python benchmarks/ncu_grouped_gemm.py --tokens 64

The reports of the H200 runs are ``benchmarks/results/ncu-mxfp4-grouped-w13-t*.txt`` (docs/design/kernels.md,
"GEMM tiles and split-K"). The prefill tile (``_swap_bf16_kernel``, one launch a call without tail tiles), with the
warp stall reasons (docs/design/kernels.md, "Tail tiles"):

    ncu --clock-control none --kernel-name regex:_swap_bf16_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \\
        python benchmarks/ncu_grouped_gemm.py --tokens 8192 --tile 128x128x8
"""

from __future__ import annotations

import argparse

import torch

from deepinfer_kernels._registry import Backend, implementation

EXPERTS, N, K, TOP_K = 384, 4608, 5120, 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tile", default=None, help="a swap_bf16 tile instead of the backend's (128x128x8[t32])")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_grouped_gemm.py needs a CUDA device")
    packed = torch.randint(-128, 128, (EXPERTS, N, K // 2), dtype=torch.int8, device="cuda")
    scale = torch.randint(118, 126, (EXPERTS, N, K // 32), dtype=torch.uint8, device="cuda")
    ids = torch.rand(args.tokens, EXPERTS, device="cuda").topk(TOP_K).indices.flatten()
    x = torch.randn(args.tokens * TOP_K, K, device="cuda").to(torch.bfloat16)
    config = None
    if args.tile:
        from grouped_tails import tile_config

        config = tile_config(args.tile)
    out = torch.empty(x.shape[0], N, dtype=torch.bfloat16, device="cuda")
    gemm = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    for _ in range(4):
        gemm(x, ids, packed, scale.view(torch.float8_e8m0fnu), out, config=config)
    torch.cuda.synchronize()
    print(f"ran the grouped GEMM 4 times at {args.tokens} tokens")


if __name__ == "__main__":
    main()
