"""Benchmark sweep: `LLM.generate` over batch sizes and prompt/output lengths on a checkpoint directory, each point's
decode step against its memory floor.

Every (prompt length, output length, batch size) point is offline_throughput.py's point: `batch` random-token prompts
of that length, greedy, `ignore_eos`, `max_tokens = output length` (every request generates exactly that many
tokens), an untimed warm-up call of the same shape, then one timed call: output tokens/s, total tokens/s, mean time
to first token, mean per-request decode tokens/s. One engine serves the whole sweep (max_num_seqs = the largest
batch, max_model_len = the longest prompt + output + 1).

Beside them: the decode step (1 / the mean per-request decode tokens/s: host, scheduling and sampling included) and
its floor, the bytes a decode step of `batch` requests at the mean context `prompt + output / 2` must read under
uniform routing (`roofline_counts.decode_bytes`) over the copy bandwidth measured at the start of the same run
(`machine_rates.copy_bandwidth`). A point expected to end past `--deadline-s` (twice the previous point's generate
time, for its warm-up and timed call) is skipped and listed; the JSON is rewritten after every point.

Usage:
    python benchmarks/sweep.py                                  # built-in tiny checkpoint on the device present
    python benchmarks/sweep.py --model /path/to/checkpoint --prompt-lens 128,1024 --output-lens 128 \\
        --batch-sizes 1,8,32,128,256 --deadline-s 420

Prints a table last. Writes benchmarks/results/sweep-<device>.json ({"header", "results", "skipped"}) and, when
matplotlib is installed, a PNG beside it: output tokens/s and decode step / floor against batch size (without
matplotlib it says so and writes only the JSON).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
from typing import Any

import machine_rates
import roofline_counts
import torch
from bench_common import RESULTS, Deadline, device_label, git_commit, int_list
from offline_throughput import plot_throughput, print_table, pyplot, run_point


def with_floor(point: dict[str, Any], config: Any, bytes_per_s: float) -> dict[str, Any]:
    """`point` with its decode step, the step's floor and their ratio (module docstring)."""
    context = point["prompt_len"] + point["output_len"] // 2
    floor_ms = roofline_counts.decode_bytes(config, point["batch_size"], context).total / bytes_per_s * 1e3
    rate = point["mean_decode_tokens_per_s"]
    step_ms = 1e3 / rate if rate else None
    ratio = step_ms / floor_ms if step_ms is not None else None
    return {**point, "decode_context": context, "decode_step_ms": step_ms, "floor_ms": floor_ms, "ratio": ratio}


def print_floors(results: list[dict[str, Any]]) -> None:
    print(f"\n{'prompt':>7} {'output':>7} {'batch':>6} {'step ms':>9} {'floor ms':>9} {'step/floor':>11}")
    for r in results:
        step = f"{r['decode_step_ms']:>9.3f}" if r["decode_step_ms"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:>11.1f}" if r["ratio"] is not None else f"{'-':>11}"
        print(f"{r['prompt_len']:>7} {r['output_len']:>7} {r['batch_size']:>6} {step} {r['floor_ms']:>9.3f} {ratio}")


def plot(results: list[dict[str, Any]], path: pathlib.Path, title: str) -> bool:
    """Two panels: output tokens/s, and decode step / floor, against batch size. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    plot_throughput(left, results, title)
    series: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for r in results:
        if r["ratio"] is not None:
            series.setdefault((r["prompt_len"], r["output_len"]), []).append((r["batch_size"], r["ratio"]))
    for (prompt_len, output_len), points in sorted(series.items()):
        points.sort()
        right.plot(
            [p[0] for p in points], [p[1] for p in points], marker="o", label=f"in {prompt_len} / out {output_len}"
        )
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size (requests)")
    right.set_ylabel("decode step / memory floor")
    right.set_title("decode step over its floor (bytes / copy bandwidth)")
    right.grid(True, alpha=0.3)
    if series:
        right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny checkpoint)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--prompt-lens", type=int_list, default=None, help="comma-separated prompt lengths")
    parser.add_argument("--output-lens", type=int_list, default=None, help="comma-separated output lengths")
    parser.add_argument("--batch-sizes", type=int_list, default=None, help="comma-separated batch sizes")
    parser.add_argument("--precision", choices=("exact", "fp32"), default="exact")
    parser.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy-bandwidth buffer (CUDA 4096, CPU 64)")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip points that would end after this")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args()

    from deepinfer_engine import LLM
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    deadline = Deadline(args.deadline_s)
    device = torch.device(args.device or ("cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"))
    on_cuda = device.type == "cuda"
    prompt_lens = args.prompt_lens or ([128, 1024] if on_cuda else [16, 64])
    output_lens = args.output_lens or ([128] if on_cuda else [8])
    batch_sizes = args.batch_sizes or ([1, 8, 32, 128, 256] if on_cuda else [1, 4])
    label = device_label(str(device))
    out = args.out or RESULTS / f"sweep-{label}.json"
    bandwidth = machine_rates.copy_bandwidth(device, args.copy_mib or (4096 if on_cuda else 64))
    if on_cuda:
        torch.cuda.empty_cache()  # the copy's buffers, before the engine takes its memory
    print(f"copy bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s", flush=True)
    engine_kwargs: dict[str, Any] = {"enforce_eager": True} if args.enforce_eager else {}
    llm = LLM(
        args.model,
        **engine_kwargs,
        device=str(device),
        max_num_seqs=max(batch_sizes),
        precision=args.precision,
        max_model_len=max(prompt_lens) + max(output_lens) + 1,
    )
    record: dict[str, Any] = {
        "header": {
            "model": args.model or "built-in tiny",
            "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
            "git_commit": args.git_commit or git_commit(),
            "precision": args.precision,
            "enforce_eager": llm.config.enforce_eager,
            "async_scheduling": llm.config.async_scheduling,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "bandwidth": bandwidth,
            "floor": "decode bytes at the mean context (prompt + output/2), uniform routing, / copy bandwidth",
        },
        "results": [],
        "skipped": [],
    }
    results: list[dict[str, Any]] = record["results"]

    def save() -> None:
        record["header"]["elapsed_s"] = deadline.elapsed()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    try:
        for prompt_len in prompt_lens:
            for output_len in output_lens:
                for batch_size in batch_sizes:
                    name = f"in {prompt_len} out {output_len} batch {batch_size}"
                    if not deadline.allows(name, 2 * results[-1]["wall_s"] if results else 0.0):
                        record["skipped"].append(name)
                        continue
                    point = run_point(llm, prompt_len, output_len, batch_size, seed=len(results))
                    results.append(with_floor(point, llm.model.config, bandwidth["bytes_per_s"]))
                    print(f"{name}: {point['output_tokens_per_s']:.1f} out tok/s", flush=True)
                    save()
    finally:
        llm.close()
    save()
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(results, png, f"LLM.generate throughput ({label}, {args.precision})"):
        print(f"wrote {png}")
    else:
        print("matplotlib is not installed: no plot written (the JSON has every number)")
    if record["skipped"]:
        print(f"skipped past --deadline-s: {', '.join(record['skipped'])}")
    print_floors(results)
    print_table(results)


if __name__ == "__main__":
    main()
