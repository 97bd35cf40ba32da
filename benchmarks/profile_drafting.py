"""Where a decode step's host time goes with and without DSpark drafting.

Two measurements, on the built-in checkpoint unless `--model DIR`:

- `steps` (needs CUDA): for `nextn` 0 and 5, one warm-up call, then one profiled call of one greedy prompt generating
  `--max-tokens` tokens; prints the sampling steps, the kernel and CUDA-graph launches per step, and the profiler's
  table of the ops with the most host time.
- `sampling-ops` (any device): the ops of each `Speculator.sample` call (verification, history writes, logprobs and
  the drafter: everything after the target forward) while `--batches` prompts (greedy unless `--temperature`)
  generate `--max-tokens` tokens with `nextn` = 5 (after one warm-up call). The aten ops called directly by that
  code are counted as `profile_step.py` counts them (views and conversions that did nothing excluded), a stand-in
  for kernel launches that runs on the CPU; on CUDA the kernel launches under each call are counted too. The engine
  runs eagerly, and the ops of the model's `draft_forward` (a CUDA graph in a graph-capturing engine) and draft
  heads (`draft_logits`, `draft_heads`) are counted apart from the speculator's own. Reported per batch and part: the
  ops of a drafting step (every request verifies `nextn` drafts; the median over those calls), the mean over all
  calls, and the speculator's most called ops; JSON to benchmarks/results/profile_drafting_ops-<device>.json unless
  `--out`.

Usage:
    python benchmarks/profile_drafting.py steps [--model DIR] [--max-tokens 64] \
        > benchmarks/results/profile_drafting-h200.txt
    python benchmarks/profile_drafting.py sampling-ops [--device cpu] [--batches 1,16] [--label L] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list
from profile_step import cpu_op_counts
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from deepinfer_engine import LLM, SamplingParams

KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
SAMPLE_RANGE = "profile_drafting::Speculator.sample"
# Model calls inside `Speculator.sample`, counted apart: the draft forward is a CUDA graph on a GPU.
PART_RANGES = {"draft_forward": "profile_drafting::draft_forward", "draft_heads": "profile_drafting::draft_heads"}
# The model methods labelled, by the part they count in: the draft heads are the LM head of every slot plus each
# slot's Markov bias and confidence.
LABELLED_METHODS = {"draft_forward": "draft_forward", "draft_logits": "draft_heads", "draft_heads": "draft_heads"}
PART_KEYS = {None: "speculator", **{range_name: name for name, range_name in PART_RANGES.items()}}
NEXTN = 5


def profile_steps(model: str | None, max_tokens: int, prompt: str) -> None:
    """The `steps` measurement (module docstring)."""
    if not torch.cuda.is_available():
        raise SystemExit("the steps measurement needs a CUDA device")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for nextn in (0, NEXTN):
        # A fixed cache: sizing from free memory would count the previous engine, still bound while this one builds.
        llm = LLM(model, device="cuda", nextn=nextn, max_num_seqs=8, cache_memory_bytes=4 << 30)
        llm.generate([prompt], params, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            output = llm.generate([prompt], params, use_tqdm=False)[0]
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


def _label(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` run inside a profiler range called `name`."""

    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return function(*args, **kwargs)

    return labelled


def _ranges(event: Any) -> tuple[Any | None, str | None]:
    """The `SAMPLE_RANGE` event `event` runs under (or None) and the innermost of `PART_RANGES` on the way (or None)."""
    part = None
    parent = event.cpu_parent
    while parent is not None and parent.name != SAMPLE_RANGE:
        if part is None and parent.name in PART_KEYS:
            part = parent.name
        parent = parent.cpu_parent
    return parent, part


def sampling_ops_point(model: str | None, device: str, batch: int, max_tokens: int, temperature: float) -> dict:
    """The `sampling-ops` measurement of one batch size."""
    llm = LLM(model, device=device, nextn=NEXTN, max_num_seqs=max(batch, 8), enforce_eager=True)
    speculator = llm.engine.runner.speculator
    assert speculator is not None
    drafting_calls: list[bool] = []  # per call: every request verifies nextn drafts
    sample = _label(SAMPLE_RANGE, speculator.sample)

    def counted_sample(logits: torch.Tensor, sampling: Any, bitmask: Any, requests: Any) -> Any:
        drafting_calls.append(all(r.num_drafts == NEXTN for r in requests))
        return sample(logits, sampling, bitmask, requests)

    # Instance attributes: only this engine's speculator and model are labelled.
    speculator.sample = counted_sample  # type: ignore[method-assign]
    for method, part in LABELLED_METHODS.items():
        setattr(speculator.model, method, _label(PART_RANGES[part], getattr(speculator.model, method)))
    prompts = [f"{i % 90 + 10}+{i % 7 + 2}=" for i in range(batch)]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seq_seed=0)
    llm.generate(prompts, params, use_tqdm=False)
    drafting_calls.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    calls: dict[int, dict[str | None, list[Any]]] = {}
    for event in prof.events():
        if event.name == SAMPLE_RANGE and event.device_type == DeviceType.CPU:
            calls.setdefault(event.id, {})
            continue
        call, part = _ranges(event)
        if call is not None:
            calls.setdefault(call.id, {}).setdefault(part, []).append(event)
    ordered = [calls[key] for key in sorted(calls)]
    if len(ordered) != len(drafting_calls):
        raise RuntimeError(f"{len(ordered)} profiled sample ranges for {len(drafting_calls)} calls")
    drafting = [i for i, is_drafting in enumerate(drafting_calls) if is_drafting]
    if not drafting:
        raise RuntimeError("no call verified nextn drafts for every request: raise --max-tokens")
    point: dict[str, Any] = {"batch": batch, "calls": len(ordered), "drafting_calls": len(drafting)}
    for part in (None, *PART_RANGES.values()):
        tables = [cpu_op_counts(parts.get(part, [])) for parts in ordered]
        totals = [int(sum(count for count, _ in table.values())) for table in tables]
        median = sorted(drafting, key=lambda i: totals[i])[len(drafting) // 2]
        key = PART_KEYS[part]
        point[key] = {
            "ops_per_drafting_call": totals[median],
            "ops_per_call_mean": statistics.mean(totals),
            "top": Counter({name: int(count) for name, (count, _) in tables[median].items()}).most_common(),
        }
        if device.startswith("cuda"):
            launches = sum(e.name in KERNEL_LAUNCHES for events in ordered[median].values() for e in events)
            point[key]["kernel_launches_per_drafting_call"] = launches
    return point


def profile_sampling_ops(args: argparse.Namespace, device: str, out: pathlib.Path) -> None:
    """The `sampling-ops` measurement (module docstring): prints the most called ops and a table, writes JSON."""
    points = [
        sampling_ops_point(args.model, device, batch, args.max_tokens, args.temperature) for batch in args.batches
    ]
    top = args.top
    for point in points:
        print(f"\nbatch {point['batch']}: top {top} aten ops of a drafting step's Speculator.sample outside the model")
        for name, count in point["speculator"]["top"][:top]:
            print(f"{count:>6}  {name}")
    print(f"\naten ops per drafting step (mean over all {'/'.join(str(p['calls']) for p in points)} calls in brackets)")
    print(f"{'batch':>6} " + " ".join(f"{key:>16}" for key in PART_KEYS.values()))
    for point in points:
        parts = [point[key] for key in PART_KEYS.values()]
        cells = [f"{part['ops_per_drafting_call']} ({part['ops_per_call_mean']:.0f})" for part in parts]
        print(f"{point['batch']:>6} " + " ".join(f"{cell:>16}" for cell in cells))
        if device.startswith("cuda"):
            launches = [str(part["kernel_launches_per_drafting_call"]) for part in parts]
            print(f"{'kernels':>6} " + " ".join(f"{cell:>16}" for cell in launches))
    result = {
        "device": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu",
        "checkpoint": args.model or "built-in",
        "label": args.label,
        "git_commit": git_commit(),
        "nextn": NEXTN,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "method": "aten ops called directly under Speculator.sample (views and no-op conversions excluded, as "
        "profile_step.py counts), split into the model's draft_forward, draft_heads and the rest; eager engine",
        "points": points,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measurement", choices=("steps", "sampling-ops"))
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the built-in checkpoint)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (steps: 64, sampling-ops: 24)")
    parser.add_argument("--prompt", default="12+7=", help="the steps measurement's prompt")
    parser.add_argument("--device", default=None, help="sampling-ops: cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--batches", type=int_list, default=[1, 16], help="sampling-ops: batch sizes")
    parser.add_argument("--top", type=int, default=12, help="sampling-ops: rows of the most-called-ops list")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling-ops: of every prompt (0: greedy)")
    parser.add_argument("--label", default=None, help="sampling-ops: what was measured, recorded in the JSON")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="sampling-ops: JSON path")
    args = parser.parse_args()
    if args.measurement == "steps":
        profile_steps(args.model, args.max_tokens or 64, args.prompt)
        return
    torch.set_num_threads(1)  # the counts do not depend on threads; the CPU may be shared
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or RESULTS / f"profile_drafting_ops-{device_label(device)}.json"
    args.max_tokens = args.max_tokens or 24
    profile_sampling_ops(args, device, out)


if __name__ == "__main__":
    main()
