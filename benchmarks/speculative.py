"""Speculative decoding speed: tokens/s and acceptance without drafting, with fixed-length and with confidence-scheduled
verification, on one checkpoint, in one process.

Prompts are the held-out task prompts of `benchmarks/data/tiny_heldout.jsonl` (round-robin over the tasks), each
generated greedily for `--max-tokens` tokens without a stop string (`ignore_eos`), so every mode emits the same number
of tokens and, greedy being exact under drafting, the same tokens (the script counts any request that differs). Modes:

    plain    nextn = 0
    fixed    nextn = `--nextn`, every draft held is verified
    varlen   nextn = `--nextn`, DEEPINFER_ENABLE_MTP_VARLEN: each step verifies what the decode cost curve says pays off
             (the curve is measured at start-up, or read from its cache)

Each mode builds one engine; per batch size it runs one untimed warm-up call, then `--repeats` timed calls of
`batch size` prompts each, the modes taking turns call by call so a busy machine slows them alike. tokens/s = generated
tokens / wall time of the `generate` calls (prefill included); acceptance length = tokens per sampling step
(generated / (generated − accepted drafts)). Ratios are against `plain` in the same run.

Usage:
    uv run python benchmarks/speculative.py [--model DIR] [--batch-sizes 1,16] [--max-tokens 128] [--nextn 5]

Prints a table last and writes benchmarks/results/speculative-<device>.json (or `--out`):

    {"settings": {...}, "points": [{"mode", "batch_size", "calls", "generated_tokens", "wall_s", "tokens_per_s",
     "speedup", "acceptance_length", "accepted_drafts", "verified_drafts", "differing_outputs"}, ...],
     "torch", "git_commit"}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list

from deepinfer_engine import LLM, SamplingParams

DATA = pathlib.Path(__file__).resolve().parent / "data"
MODES = ("plain", "fixed", "varlen")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in checkpoint)")
    parser.add_argument("--tasks", type=pathlib.Path, default=DATA / "tiny_heldout.jsonl", help="prompts (JSONL)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16], help="comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--nextn", type=int, default=5, help="drafts per step of the drafting modes")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per mode and batch size")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="engine limit (bounds CUDA-graph captures)")
    parser.add_argument("--cache-gib", type=float, default=4.0, help="cache per engine on CUDA (three share one GPU)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    return parser


def _prompts(path: pathlib.Path, count: int) -> list[str]:
    """`count` prompts taken round-robin over the tasks of the JSONL file."""
    by_task: dict[str, list[str]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    item = json.loads(line)
                    by_task.setdefault(item["task"], []).append(item["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise SystemExit(f"{path}:{number}: not a {{'task', 'prompt', ...}} object ({error})") from None
    if not by_task:
        raise SystemExit(f"{path}: no prompts")
    tasks = sorted(by_task)
    return [
        by_task[tasks[i % len(tasks)]][(i // len(tasks)) % len(by_task[tasks[i % len(tasks)]])] for i in range(count)
    ]


def _engine(mode: str, args: argparse.Namespace, device: str) -> LLM:
    nextn = 0 if mode == "plain" else args.nextn
    return LLM(
        args.model,
        device=device,
        nextn=nextn,
        mtp_varlen=mode == "varlen",
        max_num_seqs=args.max_num_seqs,
        cache_memory_bytes=int(args.cache_gib * 2**30) if device.startswith("cuda") else None,
    )


def _timed(llm: LLM, prompts: Sequence[str], params: SamplingParams, device: str) -> tuple[list[Any], float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {mode: _engine(mode, args, device) for mode in MODES}
    points = []
    for batch in args.batch_sizes:
        calls = [
            _prompts(args.tasks, batch * (args.repeats + 1))[i * batch : (i + 1) * batch]
            for i in range(args.repeats + 1)
        ]
        totals = {mode: {"tokens": 0, "wall": 0.0, "accepted": 0, "verified": 0, "differ": 0} for mode in MODES}
        for index, prompts in enumerate(calls):
            reference = None
            for mode in MODES:
                outputs, wall = _timed(engines[mode], prompts, params, device)
                tokens = [tuple(o.token_ids) for o in outputs]
                reference = tokens if reference is None else reference
                if index == 0:
                    continue  # the warm-up call
                total = totals[mode]
                total["tokens"] += sum(len(t) for t in tokens)
                total["wall"] += wall
                total["accepted"] += sum(o.metrics.num_accepted_draft_tokens for o in outputs)
                total["verified"] += sum(o.metrics.num_verified_draft_tokens for o in outputs)
                total["differ"] += sum(a != b for a, b in zip(tokens, reference, strict=True))
        plain_rate = totals["plain"]["tokens"] / totals["plain"]["wall"]
        for mode in MODES:
            total = totals[mode]
            rate = total["tokens"] / total["wall"]
            steps = total["tokens"] - total["accepted"]
            points.append(
                {
                    "mode": mode,
                    "batch_size": batch,
                    "calls": args.repeats,
                    "generated_tokens": total["tokens"],
                    "wall_s": round(total["wall"], 4),
                    "tokens_per_s": round(rate, 2),
                    "speedup": round(rate / plain_rate, 3),
                    "acceptance_length": round(total["tokens"] / steps, 3) if steps else None,
                    "accepted_drafts": total["accepted"],
                    "verified_drafts": total["verified"],
                    "differing_outputs": total["differ"],
                }
            )
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k != "out"}
    settings["device"] = device
    return {"settings": settings, "points": points, "torch": torch.__version__, "git_commit": git_commit()}


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    record = run(args)
    out = args.out or RESULTS / f"speculative-{device_label(record['settings']['device'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    header = ("mode", "batch", "tokens/s", "vs plain", "accept len", "accepted/verified", "differ")
    print("{:8} {:>5} {:>10} {:>9} {:>10} {:>18} {:>6}".format(*header))
    for p in record["points"]:
        length = "-" if p["acceptance_length"] is None else f"{p['acceptance_length']:.2f}"
        print(
            f"{p['mode']:8} {p['batch_size']:5d} {p['tokens_per_s']:10.1f} {p['speedup']:8.2f}x {length:>10} "
            f"{p['accepted_drafts']:>8}/{p['verified_drafts']:<9} {p['differing_outputs']:6d}"
        )


if __name__ == "__main__":
    main()
