"""Kernel launches per model step: a torch profile of eager decode (and prefill) steps of the engine's model.

For each batch in `--batches` the engine's loaded model (built-in checkpoint unless `--model DIR`) gets a fresh cache
with random valid rows of `--context` tokens for every request (`long_context.decode_step`, the same step a decode
step of the engine computes: one token per request); for each length in `--prefill-lens`, one request's whole prompt
from position 0 over a fresh cache (`long_context.prefill_step`). Each runs `--warmup` eager steps, then `--steps`
profiled eager steps (no CUDA graphs, so every kernel is seen; sampling excluded).

Counted per step:
- CUDA: the device kernels of the trace (memcpy / memset counted apart), and the top kernels by total device time
  with their calls per step. Also the device's span (first kernel start to last kernel end, over the back-to-back
  profiled steps, per step), how much of it no kernel ran ("idle": the span less the union of every stream's kernel
  intervals; the host falling behind, mostly after a host sync drains the queue), and the host syncs a step: device →
  host copies (the trace's `Memcpy DtoH`) and the runtime's synchronize calls, the one that ends the profile left out.
- CPU (the stand-in, labelled "aten ops"): the aten ops called directly by the model code (not those nested inside
  another aten op), without the view and metadata ops that compute nothing (`VIEW_OPS`) and without conversions that
  had nothing to do (`IF_NEEDED_OPS` calling no other op); each stands for about one kernel launch of a device run.
  Top ops by self CPU time.

With `--sequence` (CUDA), each point also records its first profiled step's device kernels in the order they started
(name, device µs, and the µs since the kernel before ended): the step's chain of kernels, from which a sub-layer's
critical path is read (which kernels wait on which, where the top table only sums by name).

With `--sites N`, one more pass of `--steps` steps lists the N source lines of the packages (`packages/*/src`) that
call the most aten ops a step, each op with its line: on a GPU the PyTorch launches beside the Triton kernels (an op
of a fused kernel's dispatch glue shows under deepinfer_kernels), on the CPU the stand-in's ops. An op counts where
it writes in place or returns new memory (not a view, not a conversion or reshape that had nothing to do); composite
ops count once under their own name (matmul, einsum). The same pass lists every line that makes the host wait for
the device ("host reads"): an op with device inputs that returns CPU data or a Python number (`.item()`, `bool()`, a
copy back), or whose output size depends on the data (`nonzero`, `unique`, ...). On CUDA it also lists the waits
that happened ("device waits", torch's sync debug mode): each line where the host blocked on the device,
those inside an op's own C++ (a vendor kernel's wrapper reading a count) included, which the prediction cannot see.

Prints a table last and writes JSON (default benchmarks/results/profile_step-<device>.json).

Usage:
    python benchmarks/profile_step.py [--model DIR] [--batches 1,64] [--context 128] [--prefill-lens 8192]
        [--device cuda] [--batch-invariant] [--no-flashmla] [--sites 40] [--sequence]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list
from long_context import decode_step, prefill_step
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Aten ops that only make views or read metadata: no kernel on a device.
VIEW_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "view",
        "_reshape_alias",
        "_unsafe_view",
        "slice",
        "select",
        "expand",
        "t",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "alias",
        "detach",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "narrow",
        "unflatten",
        "flatten",
        "result_type",
        "is_nonzero",
        "item",
        "_local_scalar_dense",
        "resolve_conj",
        "resolve_neg",
    )
)
# Aten ops that return their input unchanged when nothing is to be done: counted only when they call another op.
IF_NEEDED_OPS = frozenset(("aten::to", "aten::contiguous", "aten::reshape", "aten::type_as", "aten::clone"))
_COPY_PREFIXES = ("Memcpy", "Memset")
# The runtime calls that block the host until the device catches up (torch.cuda.synchronize is cudaDeviceSynchronize).
SYNC_CALLS = frozenset(("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize"))
# Aten ops whose output size depends on the data: on a device each reads a count back to the host.
DATA_SIZED_OPS = frozenset(
    f"aten::{name}"
    for name in (
        "nonzero",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "masked_select",
        "repeat_interleave",
    )
)


def _cuda_counts(events: list[Any]) -> tuple[dict[str, list[float]], int]:
    """{kernel name: [calls, device µs]} of the device kernels, and the memcpy/memset count."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    copies = 0
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.startswith(_COPY_PREFIXES):
            copies += 1
            continue
        entry = kernels[event.name]
        entry[0] += 1
        entry[1] += event.device_time
    return kernels, copies


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (kernels of every stream, overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _cuda_timeline(events: list[Any]) -> dict[str, float]:
    """The device span and busy time of the kernels (memcpy / memset included), in µs, and the host syncs: device →
    host copies and synchronize calls."""
    intervals = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
    if not intervals:
        return {"span_us": 0.0, "busy_us": 0.0, "dtoh_copies": 0.0, "sync_calls": 0.0}
    return {
        "span_us": max(end for _, end in intervals) - min(start for start, _ in intervals),
        "busy_us": busy_us(intervals),
        "dtoh_copies": sum(e.device_type == DeviceType.CUDA and e.name.startswith("Memcpy DtoH") for e in events),
        "sync_calls": sum(e.device_type == DeviceType.CPU and e.name in SYNC_CALLS for e in events),
    }


def kernel_sequence(events: list[Any], steps: int) -> list[dict[str, Any]]:
    """The first profiled step's device kernels (memcpy / memset included) in the order they started: name, device µs
    and the µs since the kernel before it ended (negative where two streams overlap). Every profiled step launches
    the same kernels, so the first ``1 / steps`` of the trace's kernels are the first step's."""
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    sequence, previous_end = [], None
    for event in kernels[: len(kernels) // max(steps, 1)]:
        start, end = event.time_range.start, event.time_range.end
        gap = 0.0 if previous_end is None else start - previous_end
        sequence.append({"name": event.name, "us": end - start, "gap_us": gap})
        previous_end = end
    return sequence


def cpu_op_counts(events: list[Any]) -> dict[str, list[float]]:
    """{aten op: [calls, self CPU µs]} of the aten ops the model code calls directly, views excluded."""
    ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.device_type != DeviceType.CPU or not event.name.startswith("aten::") or event.name in VIEW_OPS:
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name.startswith("aten::"):
            continue
        if event.name in IF_NEEDED_OPS and not any(c.name not in VIEW_OPS for c in event.cpu_children):
            continue
        entry = ops[event.name]
        entry[0] += 1
        entry[1] += event.self_cpu_time_total
    return ops


class _SiteCounter(TorchDispatchMode):
    """Counts the aten ops that compute something by (innermost line under a package's ``src``, op), the predicted
    host reads the same way, and (:meth:`record_wait`) the observed device waits by line."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.host_reads: Counter[tuple[str, str]] = Counter()
        self.device_waits: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name not in VIEW_OPS and _computes(name, (args, kwargs), out):
            self.counts[(_package_line(), name)] += 1
        if reads_device_on_host(name, (args, kwargs), out):
            self.host_reads[(_package_line(), name)] += 1
        return out

    def record_wait(self) -> None:
        """One device wait at the current package line. Torch raises the sync warning once the op has returned, so
        the line is known, not the op."""
        self.device_waits[(_package_line(), "wait")] += 1


@contextlib.contextmanager
def device_waits(counter: _SiteCounter) -> Iterator[None]:
    """Reports every synchronizing CUDA call to ``counter.record_wait`` (torch's sync debug mode, as warnings)."""

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchronizing" in str(message):
            counter.record_wait()

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def reads_device_on_host(name: str, inputs: Any, out: Any) -> bool:
    """Whether an op with device (non-CPU) inputs makes the host wait for the device: it returns CPU tensors or a
    Python number (a copy back, ``.item()``, ``bool()``), or its output size depends on the data."""
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if not any(t.device.type != "cpu" for t in tensors):
        return False
    outputs = tree_leaves(out)
    returns_host = any(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outputs)
    returns_number = any(isinstance(o, (bool, int, float)) for o in outputs)
    return returns_host or returns_number or (name in DATA_SIZED_OPS and not _size_given(name, inputs))


def _size_given(name: str, inputs: Any) -> bool:
    """A data-sized op whose output size the host already knows: ``repeat_interleave`` with integer repeats or an
    ``output_size``."""
    if name != "aten::repeat_interleave":
        return False
    args, kwargs = inputs
    repeats = args[1] if len(args) > 1 else args[0]  # (self, repeats, ...) or the repeats-only overload
    return not isinstance(repeats, torch.Tensor) or kwargs.get("output_size") is not None


def _computes(name: str, inputs: Any, out: Any) -> bool:
    """Whether an op launched work: it writes in place, or one of its non-empty outputs is new memory (a view, or a
    conversion or reshape with nothing to do, returns its input's)."""
    if name.endswith("_"):
        return True
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel()]
    storages = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return any(t.untyped_storage().data_ptr() not in storages for t in outputs)


def _package_line() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        marker = path.find("/src/deepinfer_")
        if marker >= 0:
            return f"{path[marker + len('/src/') :]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside the packages>"


def launch_sites(model: Any, step: Any, state: Any, steps: int, device: torch.device) -> dict[str, list[dict]]:
    """Per step, by (package source line, op), most first: the aten ops (``sites``, for ``--sites``), the predicted
    host reads of device data (``host_reads``) and, on CUDA, the observed device waits (``device_waits``)."""
    counter = _SiteCounter()
    waits = device_waits(counter) if device.type == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), counter, waits:
        for _ in range(steps):
            model(step, state)

    def rows(counts: Counter[tuple[str, str]]) -> list[dict]:
        return [{"site": site, "op": op, "calls_per_step": calls / steps} for (site, op), calls in counts.most_common()]

    found = {"sites": rows(counter.counts), "host_reads": rows(counter.host_reads)}
    return found | ({"device_waits": rows(counter.device_waits)} if device.type == "cuda" else {})


def profile_point(
    model: Any,
    kind: str,
    size: int,
    context: int,
    steps: int,
    warmup: int,
    device: torch.device,
    sites: int = 0,
    sequence: bool = False,
) -> dict:
    """One decode batch size (``kind`` "decode", ``size`` requests) or one prefill prompt length (``kind``
    "prefill", one request of ``size`` tokens from position 0): launches (kernels or aten ops) per step and the top
    entries by time; with ``sites`` the aten ops' ``sites`` busiest source lines (:func:`launch_sites`); with
    ``sequence`` (CUDA) one step's kernels in launch order (:func:`kernel_sequence`)."""
    with torch.inference_mode():
        if kind == "decode":
            state, step, _ = decode_step(model, size, context, context + 1, device, seed=size)
        else:
            state, step = prefill_step(model, size, device)
        for _ in range(warmup):
            model(step, state)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                model(step, state)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    events = list(prof.events())
    found = launch_sites(model, step, state, steps, device) if sites else {}
    if device.type == "cuda":
        table, copies = _cuda_counts(events)
        timeline = _cuda_timeline(events)
        timeline["sync_calls"] -= 1  # the synchronize that ends the profile
        unit = "kernels"
        extra = {"memcpy_memset_per_step": copies / steps, **{f"{k}_per_step": v / steps for k, v in timeline.items()}}
        if sequence:
            extra["sequence"] = kernel_sequence(events, steps)
    else:
        table, unit, extra = cpu_op_counts(events), "aten ops", {}
    top = sorted(table.items(), key=lambda item: -item[1][1])
    return {
        "kind": kind,
        **({"batch": size, "context": context} if kind == "decode" else {"batch": 1, "prompt": size}),
        "unit": unit,
        "launches_per_step": sum(calls for calls, _ in table.values()) / steps,
        "time_us_per_step": sum(us for _, us in table.values()) / steps,
        **extra,
        "top": [
            {"name": name, "calls_per_step": calls / steps, "us_per_step": us / steps} for name, (calls, us) in top
        ],
        **({**found, "sites": found["sites"][:sites]} if sites else {}),
    }


def print_table(points: list[dict], top: int) -> None:
    for point in points:
        if point.get("sites"):
            _print_site_rows(f"{_label(point)}: the source lines calling the most aten ops a step", point["sites"])
            for key, title in (("host_reads", "host reads of device data"), ("device_waits", "device waits")):
                if key in point:
                    _print_site_rows(f"{_label(point)}: {title} a step", point[key])
        print(f"\n{_label(point)}: top {top} {point['unit']} by total time per step")
        print(f"{'calls':>7} {'us':>10}  name")
        for entry in point["top"][:top]:
            print(f"{entry['calls_per_step']:>7.0f} {entry['us_per_step']:>10.1f}  {entry['name'][:100]}")
    columns = ("step", "unit", "per step", "us/step", "span us", "idle us", "DtoH", "syncs")
    widths = (14, 9, 9, 10, 10, 9, 5, 5)
    print("\n" + " ".join(f"{name:>{width}}" for name, width in zip(columns, widths, strict=True)))
    for point in points:
        row = [_label(point), point["unit"], f"{point['launches_per_step']:.0f}", f"{point['time_us_per_step']:.0f}"]
        if "span_us_per_step" in point:
            idle = point["span_us_per_step"] - point["busy_us_per_step"]
            row += [f"{point['span_us_per_step']:.0f}", f"{idle:.0f}"]
            row += [f"{point['dtoh_copies_per_step']:.1f}", f"{point['sync_calls_per_step']:.1f}"]
        print(" ".join(f"{cell:>{width}}" for cell, width in zip(row, widths, strict=False)))


def _print_site_rows(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'calls':>7}  {'op':<24} site")
    for entry in rows:
        print(f"{entry['calls_per_step']:>7.1f}  {entry['op'].removeprefix('aten::'):<24} {entry['site']}")


def _label(point: dict) -> str:
    return f"batch {point['batch']}" if point["kind"] == "decode" else f"prefill {point['prompt']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in checkpoint)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--batches", type=int_list, default=[1, 64], help="batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=128, help="tokens already in each request's cache")
    parser.add_argument("--prefill-lens", type=int_list, default=[], help="prompt lengths of prefill steps to profile")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps per batch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (Triton compiles here)")
    parser.add_argument("--top", type=int, default=15, help="rows of the top-kernels table")
    parser.add_argument("--sites", type=int, default=0, help="list this many busiest source lines (aten ops a step)")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="profile the model's batch-invariant mode (DEEPINFER_BATCH_INVARIANT)",
    )
    parser.add_argument(
        "--flashmla",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill steps on FlashMLA's sparse prefill (EngineArgs.flashmla) (--no-flashmla: off)",
    )
    parser.add_argument(
        "--sequence",
        action="store_true",
        help="record one step's device kernels in launch order (name, µs, gap) in the JSON (CUDA)",
    )
    parser.add_argument("--label", default=None, help="what was measured (e.g. a branch name), recorded in the JSON")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path")
    args = parser.parse_args()
    if any(size < 1 for size in (*args.batches, *args.prefill_lens)):
        # A zero-token step is no step: the model would fail deep inside (the MoE's reshape of an empty batch).
        parser.error('--batches and --prefill-lens take sizes of at least 1 (--batches "" profiles no decode step)')

    from deepinfer_engine import LLM
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    device = torch.device(args.device or ("cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"))
    # The steps run on their own cache (decode_step): the engine keeps a small one and a short profiling step.
    llm = LLM(
        args.model,
        device=str(device),
        enforce_eager=True,
        nextn=0,
        max_num_seqs=max([1, *args.batches]),
        max_model_len=max([args.context + 2, *args.prefill_lens]),
        max_num_batched_tokens=max([*args.batches, *args.prefill_lens]),
        cache_memory_bytes=1 << 30,
        flashmla=args.flashmla,
    )
    llm.model.batch_invariant = args.batch_invariant
    sizes = [("decode", b) for b in args.batches] + [("prefill", n) for n in args.prefill_lens]
    points = [
        profile_point(llm.model, kind, n, args.context, args.steps, args.warmup, device, args.sites, args.sequence)
        for kind, n in sizes
    ]
    llm.close()
    out = args.out or RESULTS / f"profile_step-{device_label(str(device))}.json"
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "checkpoint": args.model or "built-in",
        "label": args.label,
        "batch_invariant": args.batch_invariant,
        "flashmla": args.flashmla,
        "git_commit": git_commit(),
        "method": "eager decode steps (long_context.decode_step) and prefill steps (long_context.prefill_step) of the "
        "engine's model, torch.profiler; CUDA: device "
        "kernels per step; CPU: aten ops called by the model code, views excluded (a stand-in for launches)",
        "points": points,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(points, args.top)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
