"""Offline throughput of `LLM.generate`: a sweep over prompt length, output length and batch size.

For every (prompt length, output length, batch size) point the script generates for `batch size` random-token
prompts of that length with greedy sampling, `ignore_eos` and `max_tokens = output length`, so every request
produces exactly that many tokens, and reports:

- output tokens/s: generated tokens over the wall time of the `generate` call;
- total tokens/s: prompt + generated tokens over the same time;
- mean time to first token and mean per-request decode tokens/s (from `GenerateOutput.metrics`).

One engine (max_num_seqs = the largest batch size) serves the whole sweep; each point is preceded by an untimed
warm-up call of the same shape. Defaults are small on CPU (the built-in tiny checkpoint) and larger on CUDA.

Usage:
    python benchmarks/offline_throughput.py                               # built-in tiny checkpoint, device present
    python benchmarks/offline_throughput.py --model /path/to/V4.1-Flash --prompt-lens 128,1024 --batch-sizes 1,64

Prints a table last. Writes benchmarks/results/offline_throughput-<device>[-eager].json and, when matplotlib is
installed, a PNG plot of output tokens/s against batch size next to it (without matplotlib only the JSON is written).
`--enforce-eager` gives the eager baseline on CUDA (its files get the `-eager` suffix).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time
from typing import Any

import torch
from bench_common import RESULTS, device_label, int_list, random_prompts


def run_point(llm: Any, prompt_len: int, output_len: int, batch_size: int, seed: int) -> dict[str, Any]:
    from deepinfer_engine import SamplingParams

    prompts = random_prompts(llm.model.config.text.vocab_size, batch_size, prompt_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if llm.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token_s for o in outputs if o.metrics.time_to_first_token_s is not None]
    decode = [o.metrics.decode_tokens_per_s for o in outputs if o.metrics.decode_tokens_per_s is not None]
    return {
        "prompt_len": prompt_len,
        "output_len": output_len,
        "batch_size": batch_size,
        "wall_s": wall,
        "generated_tokens": generated,
        "output_tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + prompt_len * batch_size) / wall,
        "mean_time_to_first_token_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "mean_decode_tokens_per_s": sum(decode) / len(decode) if decode else None,
        "all_finished_ok": all(o.ok for o in outputs),
    }


def print_table(results: list[dict[str, Any]]) -> None:
    header = ("prompt", 7), ("output", 7), ("batch", 6), ("out tok/s", 11), ("total tok/s", 12), ("TTFT s", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'decode tok/s':>13}")
    for r in results:
        ttft = r["mean_time_to_first_token_s"]
        decode = r["mean_decode_tokens_per_s"]
        print(
            f"{r['prompt_len']:>7} {r['output_len']:>7} {r['batch_size']:>6} {r['output_tokens_per_s']:>11.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {ttft if ttft is not None else float('nan'):>8.3f} "
            f"{decode if decode is not None else float('nan'):>13.1f}"
        )


def plot_throughput(axis: Any, results: list[dict[str, Any]], title: str) -> None:
    """Output tokens/s against batch size, one line per (prompt, output) length, on a matplotlib axis."""
    series: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for r in results:
        series.setdefault((r["prompt_len"], r["output_len"]), []).append((r["batch_size"], r["output_tokens_per_s"]))
    for (prompt_len, output_len), points in sorted(series.items()):
        points.sort()
        axis.plot(
            [p[0] for p in points], [p[1] for p in points], marker="o", label=f"in {prompt_len} / out {output_len}"
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("batch size (requests)")
    axis.set_ylabel("output tokens/s")
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend()


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plot(results: list[dict[str, Any]], path: pathlib.Path, title: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(7, 4.5))
    plot_throughput(axis, results, title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir or HF repo id (default: built-in tiny)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--prompt-lens", type=int_list, default=None, help="comma-separated prompt lengths")
    parser.add_argument("--output-lens", type=int_list, default=None, help="comma-separated output lengths")
    parser.add_argument("--batch-sizes", type=int_list, default=None, help="comma-separated batch sizes")
    parser.add_argument("--precision", choices=("exact", "fp32"), default="exact")
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch intra-op threads on CPU")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="never capture CUDA graphs (the eager baseline on CUDA)"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args()

    from deepinfer_engine import LLM

    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
    llm_probe_device = args.device
    if llm_probe_device is None:
        from deepinfer_kernels.platform import Accelerator, current_accelerator

        llm_probe_device = "cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"
    on_cuda = llm_probe_device.startswith("cuda")
    prompt_lens = args.prompt_lens or ([128, 1024] if on_cuda else [16, 64])
    output_lens = args.output_lens or ([128] if on_cuda else [8, 32])
    batch_sizes = args.batch_sizes or ([1, 8, 32, 128, 256] if on_cuda else [1, 4, 16])
    engine_kwargs: dict[str, Any] = {"enforce_eager": True} if args.enforce_eager else {}
    llm = LLM(
        args.model,
        **engine_kwargs,
        device=llm_probe_device,
        max_num_seqs=max(batch_sizes),
        precision=args.precision,
        max_model_len=max(prompt_lens) + max(output_lens) + 1,
    )
    label = device_label(llm.config.device)
    results: list[dict[str, Any]] = []
    for prompt_len in prompt_lens:
        for output_len in output_lens:
            for batch_size in batch_sizes:
                point = run_point(llm, prompt_len, output_len, batch_size, seed=len(results))
                results.append(point)
                print(
                    f"in {prompt_len:>6} out {output_len:>5} batch {batch_size:>4}: "
                    f"{point['output_tokens_per_s']:10.1f} out tok/s {point['total_tokens_per_s']:10.1f} total tok/s "
                    f"ttft {point['mean_time_to_first_token_s'] or 0:.3f} s",
                    flush=True,
                )
    print_table(results)
    suffix = "-eager" if args.enforce_eager and on_cuda else ""
    out = args.out or RESULTS / f"offline_throughput-{label}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": str(llm.config.model_dir) if args.model is not None else "built-in tiny",
        "device": label,
        "precision": args.precision,
        "enforce_eager": llm.config.enforce_eager,
        "async_scheduling": llm.config.async_scheduling,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "results": results,
    }
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if _plot(results, png, f"LLM.generate throughput ({label}, {args.precision})"):
        print(f"wrote {png}")
    else:
        print("matplotlib is not installed: no plot written (the JSON has every number)")
    llm.close()


if __name__ == "__main__":
    main()
