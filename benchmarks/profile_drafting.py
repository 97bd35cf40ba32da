"""Where a decode step's host time goes with and without DSpark drafting: a torch profile of one greedy request.

For `nextn` 0 and 5 (on the built-in checkpoint by default) one warm-up call, then one profiled call of one prompt
generating `--max-tokens` tokens; prints the sampling steps, the kernel and CUDA-graph launches per step, and the
profiler's table of the ops with the most host time. Needs a CUDA device.

Usage:
    python benchmarks/profile_drafting.py [--model DIR] [--max-tokens 64] > benchmarks/results/profile_drafting-h200.txt
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer_engine import LLM, SamplingParams

KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in checkpoint)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="12+7=")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_drafting.py needs a CUDA device")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for nextn in (0, 5):
        llm = LLM(args.model, device="cuda", nextn=nextn, max_num_seqs=8)
        llm.generate([args.prompt], params, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            output = llm.generate([args.prompt], params, use_tqdm=False)[0]
        steps = output.metrics.num_sampling_steps
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.key in KERNEL_LAUNCHES)
        graphs = sum(e.count for e in events if e.key in GRAPH_LAUNCHES)
        print(
            f"nextn={nextn}: {len(output.token_ids)} tokens in {steps} sampling steps; kernel launches {kernels} "
            f"({kernels / steps:.0f}/step), graph launches {graphs}"
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=18))
        llm.close()


if __name__ == "__main__":
    main()
