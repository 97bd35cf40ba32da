"""Long context: prefill time and decode step time against context length, with the peak memory of each point.

Sweep (CUDA by default; on CPU only with `--parts sweep`), one engine for every point, cheap points first:

- prefill, batch 1, contexts `--prefill-contexts` (CUDA default 8K, 32K, 128K): one `LLM.generate` of a random-token
  prompt with max_tokens=1, greedy; seconds = wall time of the call, tokens/s = prompt tokens / seconds. An untimed
  warm-up generate (one prompt of min(8192, longest context) tokens) compiles the kernels first.
- decode, method "model-step", every (batch `--decode-batches`, context `--decode-contexts`) point (CUDA default
  batches 1 and 32, contexts 1K, 32K, 128K): filling 32 caches by real prefill of 32 x 128K tokens would take far
  longer than the device allows, so the step is built at the model level instead. The engine's loaded model gets a
  fresh cache (`allocate_state`, 128-token pages) in which every request owns its own pages and state slot, and every
  row the step can read (compressed rows, index-K rows, SWA and compressor rings, of every layer) is written with
  random values through the cache's row codecs, so the rows are valid FP8/FP4 encodings. The step is the one a
  decode step of the engine computes: one token per request at position C (context C + 1 after it), the block table
  padded to the engine's graph bound, `max_context_len` = that bound (max_model_len + 2, as the engine's decode graphs
  are captured; `--context-bound exact` passes C + 1 instead, as an eager step would), so attention and the indexer
  read as many rows as a real step does. On CUDA the step is captured in a CUDA graph (as the engine replays decode
  steps unless `--enforce-eager`) and timed by `deepinfer_kernels.benchmarking.cuda_time_ms`: median of CUDA-event
  timings of graph replays after warm-up. Sampling is not included. On CPU: median wall time of eager steps.
- decode, method "generate", the points whose batch x context is at most `--max-prefill-tokens` (default 128K: batch
  1 up to 128K, batch 32 at 1K): `LLM.generate` of `batch` random prompts of `context` tokens, greedy,
  max_tokens = `--decode-steps` + 1 (CUDA default 64), after a real prefill; seconds = 1 / decode tokens/s
  (`GenerateMetrics`) of the request that started decoding last: host wall time per step, sampling and scheduling
  included, CUDA graphs as the engine uses them. Every step of that request is a pure decode step (earlier requests'
  first steps can share a step with a later prompt's prefill chunk); with batch > 1 its last few steps run with fewer
  requests, as the earlier ones finish first.

Every point resets the peak memory statistics first; peak_gib = torch.cuda.max_memory_allocated (weights, the
engine's cache and the point's own allocations included). An out-of-memory or other error is recorded in the point's
"error" and the sweep goes on; a point whose estimated time would end past `--deadline-s` is recorded as "skipped".
The JSON is rewritten after every point, so a run that is killed keeps what it measured.

Memory (`--parts memory`, the CPU default): a fresh process builds `LLM` with default arguments on the CPU (the
built-in tiny checkpoint unless `--model`) and prefills one random prompt of `--memory-context` tokens (default
4,000); it reports the prefill time and its peak resident memory (`resource.getrusage` max RSS) after building the
engine and after the prompt, against the checkpoint's size on disk. The parent stops the process if its resident
memory passes `--memory-limit-gib` or it is still running at `--deadline-s`, and reports that, and reports a crash
with its exit status and last output.

Usage (the H200 run; the checkpoint is written first, about a minute with 16 workers, then about 6 minutes):
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 -m deepinfer_model write-checkpoint \\
        --config v41-flash-scaled --out /tmp/deepinfer-v41-flash-scaled --fast-experts --workers 16
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 benchmarks/long_context.py \\
        --model /tmp/deepinfer-v41-flash-scaled --deadline-s 420
    python benchmarks/long_context.py                     # on CPU: the tiny checkpoint's 4,000-token memory test
    python benchmarks/long_context.py --device cpu --parts sweep,memory --prefill-contexts 256,512 \\
        --decode-contexts 256,512 --decode-batches 1,4 --memory-context 512      # a quick CPU dry run of everything

Prints a table last (with each decode step's ratio to the step at the smallest context, same batch and method) and
writes benchmarks/results/long_context-<device>.json: a header (device, checkpoint, git commit, engine settings,
method notes) and one record per point {"kind", "context", "batch", "method", "seconds", "tokens_per_s", "peak_gib",
...}, with "error" or "skipped" instead of figures where a point did not run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import pathlib
import platform
import resource
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from bench_common import (
    MIN_TOKEN_ID,
    RESULTS,
    Deadline,
    device_label,
    git_commit,
    int_list,
    median_wall_s,
    random_prompts,
)

if TYPE_CHECKING:
    from deepinfer_engine import LLM
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_model.state import ModelState

BLOCK_SIZE = 128  # the engine's default page size; the model-step caches use the same pages
GIB = 2**30
_FILL_CHUNK_ROWS = 1 << 16  # rows encoded per write while filling a cache (bounds the fill's own memory)


# ---- engine internals: the only place that reaches past LLM(...), generate and close -------------------------------


def _engine_model(llm: LLM) -> DeepseekV41ForCausalLM:
    """The model `llm` loaded (an engine attribute; adapt here when the engine package moves it)."""
    return llm.model


def _vocab_size(llm: LLM) -> int:
    return _engine_model(llm).config.text.vocab_size


def _checkpoint_dir(llm: LLM) -> pathlib.Path:
    """The checkpoint directory `llm` resolved (the built-in tiny one when it was built without a model)."""
    return pathlib.Path(llm.config.model_dir)


# ---- points -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    kind: Literal["prefill", "decode"]
    context: int
    batch: int
    method: Literal["generate", "model-step"]

    def label(self) -> str:
        return f"{self.kind} {self.method} batch {self.batch} context {self.context}"


@dataclass
class Estimates:
    """Running guesses of how long a point takes, updated from the points measured so far."""

    prefill_tokens_per_s: float = 2000.0  # the slowest prefill rate seen (longer prompts are not faster)
    model_step_overhead_s: float = 15.0  # cache allocation, capture, warm-up and timing of one model-step point
    fill_rows_per_s: float = 5e6
    step_s: dict[tuple[int, int], float] = field(default_factory=dict)  # model-step seconds by (batch, context)
    prefill_measured: bool = False

    def seconds(self, point: Point, decode_steps: int) -> float:
        tokens = point.batch * point.context
        if point.method == "model-step":
            return self.model_step_overhead_s + tokens * 2 / self.fill_rows_per_s  # C1 groups hold a row per token
        # An engine step adds host work to the model's: twice the model-step time, 0.1 s before one is known.
        step = 2 * self.step_s.get((point.batch, point.context), 0.05)
        return tokens / self.prefill_tokens_per_s + (decode_steps * step if point.kind == "decode" else 0.0)

    def update(self, point: Point, record: dict[str, Any]) -> None:
        if record.get("seconds") is None:
            return
        if point.method == "generate" and point.kind == "prefill":
            rate = record["tokens_per_s"]
            self.prefill_tokens_per_s = min(rate, self.prefill_tokens_per_s) if self.prefill_measured else rate
            self.prefill_measured = True
        elif point.method == "model-step":
            self.step_s[(point.batch, point.context)] = record["seconds"]
            self.fill_rows_per_s = max(record["fill_rows"] / max(record["fill_s"], 1e-3), 1e5)
            self.model_step_overhead_s = max(record["wall_s"] - record["fill_s"], 1.0)


def plan(
    prefill_contexts: list[int],
    decode_contexts: list[int],
    batches: list[int],
    max_prefill_tokens: int,
    decode_steps: int,
) -> list[Point]:
    """Every point of the sweep, cheapest (by the initial estimates) first."""
    points = [Point("prefill", c, 1, "generate") for c in prefill_contexts]
    points += [Point("decode", c, b, "model-step") for c in decode_contexts for b in batches]
    points += [
        Point("decode", c, b, "generate") for c in decode_contexts for b in batches if b * c <= max_prefill_tokens
    ]
    estimates = Estimates()
    return sorted(points, key=lambda p: (estimates.seconds(p, decode_steps), p.kind, p.batch, p.context))


# ---- measuring ----------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _outputs_error(outputs: list[Any]) -> str | None:
    failed = [o for o in outputs if not o.ok]
    if not failed:
        return None
    return f"{len(failed)}/{len(outputs)} requests failed: {failed[0].finish_reason.value}: {failed[0].error_message}"


def run_generate(llm: LLM, point: Point, decode_steps: int, device: torch.device) -> dict[str, Any]:
    """A prefill point (max_tokens=1, wall time) or a decode point through `LLM.generate` (module docstring)."""
    from deepinfer_engine import SamplingParams

    prompts = random_prompts(_vocab_size(llm), point.batch, point.context, seed=point.context + point.batch)
    max_tokens = 1 if point.kind == "prefill" else decode_steps + 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    _sync(device)
    wall = time.perf_counter() - start
    error = _outputs_error(outputs)
    if error is not None:
        return {"error": error, "wall_s": wall}
    if point.kind == "prefill":
        return {"seconds": wall, "tokens_per_s": point.context / wall, "wall_s": wall}
    # The request that started decoding last: every one of its steps is a pure decode step, after every prompt's
    # prefill chunks (earlier requests' first steps can share a step with a later prompt's chunk).
    last = max(outputs, key=lambda o: o.metrics.time_to_first_token_s or 0.0)
    if not last.metrics.decode_tokens_per_s:
        return {"error": "the last request reported no decode rate", "wall_s": wall}
    seconds = 1.0 / last.metrics.decode_tokens_per_s
    return {"seconds": seconds, "tokens_per_s": point.batch / seconds, "wall_s": wall}


def fill_random_rows(state: ModelState, num_blocks: int, num_slots: int, generator: torch.Generator) -> int:
    """Write random values through the row codecs into every row of pages 1 … num_blocks − 1 of every PAGED group
    and every row of slots 0 … num_slots − 1 of every per-request group, in every layer; returns the rows written."""
    from deepinfer_model.cache_spec import CacheGroupKind

    written = 0
    device = generator.device
    for group in state.spec.groups:
        width = state.codec(group.name).width
        if group.kind is CacheGroupKind.PAGED:
            per = group.rows_per_block(state.block_size)
            rows = torch.arange(per, per * num_blocks, device=device)  # page 0 stays the engine's null page
        else:
            rows = torch.arange(num_slots * group.rows_per_request(), device=device)
        for layer in group.layer_ids:
            for part in rows.split(_FILL_CHUNK_ROWS):
                values = torch.randn(part.numel(), width, generator=generator, device=device)
                state.write(group.name, layer, part, values)
            written += rows.numel()
    return written


def decode_step(
    model: DeepseekV41ForCausalLM, batch: int, context: int, bound: int, device: torch.device, seed: int
) -> tuple[ModelState, ForwardBatch, int]:
    """A decode step of `batch` requests at context `context` over a fresh randomly filled cache (module docstring);
    returns the cache, the step and the rows written."""
    from deepinfer_model.forward_batch import ForwardBatch

    pages = -(-(context + 1) // BLOCK_SIZE)
    state = model.allocate_state(BLOCK_SIZE, 1 + batch * pages, batch, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = fill_random_rows(state, 1 + batch * pages, batch, generator)
    table = torch.zeros(batch, -(-bound // BLOCK_SIZE), dtype=torch.int32, device=device)
    table[:, :pages] = torch.arange(1, 1 + batch * pages, dtype=torch.int32, device=device).view(batch, pages)
    text = model.config.text
    engram = None
    if text.engram_enabled:
        engram = torch.randint(MIN_TOKEN_ID, text.vocab_size, (batch, (text.engram_max_ngram_size or 1) - 1))
    step = ForwardBatch(
        input_ids=torch.randint(MIN_TOKEN_ID, text.vocab_size, (batch,)).to(device),
        positions=torch.full((batch,), context, dtype=torch.int64, device=device),
        cu_query_lens=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        block_table=table,
        state_slots=torch.arange(batch, dtype=torch.int32, device=device),
        engram_prefix_ids=None if engram is None else engram.to(device),
        logits_indices=torch.arange(batch, dtype=torch.int64, device=device),
        max_query_len=1,
        max_context_len=bound,
    )
    return state, step, rows


def prefill_step(model: DeepseekV41ForCausalLM, prompt: int, device: torch.device) -> tuple[ModelState, ForwardBatch]:
    """One request's whole `prompt` of random tokens from position 0 over a fresh cache, logits of its last token;
    returns the cache and the step."""
    from deepinfer_model.forward_batch import ForwardBatch

    pages = -(-(prompt + 1) // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(prompt)
    ids = torch.randint(MIN_TOKEN_ID, model.config.text.vocab_size, (prompt,), generator=generator)
    state = model.allocate_state(BLOCK_SIZE, 1 + pages, 1, device)
    step = ForwardBatch(
        input_ids=ids.to(device),
        positions=torch.arange(prompt, device=device),
        cu_query_lens=torch.tensor([0, prompt], dtype=torch.int32, device=device),
        context_lens=torch.tensor([prompt], dtype=torch.int32, device=device),
        block_table=torch.arange(1, 1 + pages, dtype=torch.int32, device=device).view(1, pages),
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),
        logits_indices=torch.tensor([prompt - 1], device=device),
        max_query_len=prompt,
        max_context_len=prompt,
    )
    return state, step


def run_model_step(
    model: DeepseekV41ForCausalLM, point: Point, bound: int, graphs: bool, repeats: int, device: torch.device
) -> dict[str, Any]:
    """A model-step decode point (module docstring)."""
    start = time.perf_counter()
    with torch.inference_mode():
        state, step, rows = decode_step(model, point.batch, point.context, bound, device, seed=point.context)
        _sync(device)
        fill_s = time.perf_counter() - start

        def forward() -> None:
            model(step, state)

        if device.type == "cuda":
            from deepinfer_kernels.benchmarking import cuda_time_ms

            ms, captured = cuda_time_ms(forward, warmup=3, repeats=repeats, capture=graphs)
            seconds = ms / 1e3
        else:
            seconds, captured = median_wall_s(forward, device, warmup=1, repeats=repeats), False
    return {
        "seconds": seconds,
        "tokens_per_s": point.batch / seconds,
        "cuda_graph": captured,
        "max_context_len": bound,
        "fill_rows": rows,
        "fill_s": fill_s,
        "wall_s": time.perf_counter() - start,
    }


def measure(point: Point, run: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Run one point with fresh peak statistics; an error becomes the record's "error"."""
    record: dict[str, Any] = {**vars(point), "seconds": None, "tokens_per_s": None, "peak_gib": None}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        record.update(run())
    except torch.cuda.OutOfMemoryError as exc:
        record["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    except Exception as exc:
        traceback.print_exc()
        record["error"] = f"{type(exc).__name__}: {exc}"
    if device.type == "cuda":
        record["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


# ---- CPU memory ---------------------------------------------------------------------------------------------------


def _max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # kilobytes on Linux


def memory_child(model: str | None, context: int, max_num_batched_tokens: int | None) -> None:
    """In a fresh process: build the engine on the CPU, prefill one prompt, print one JSON line of figures."""
    from deepinfer_engine import LLM, SamplingParams

    record: dict[str, Any] = {"rss_after_import_gib": _max_rss_gib()}
    kwargs: dict[str, Any] = {"device": "cpu"}
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    llm = LLM(model, **kwargs)
    record["rss_after_load_gib"] = _max_rss_gib()
    ckpt = _checkpoint_dir(llm)
    files = [f for f in ckpt.rglob("*") if f.is_file()]
    record["checkpoint"] = str(ckpt)
    record["checkpoint_gib"] = sum(f.stat().st_size for f in files) / GIB
    record["checkpoint_weights_gib"] = sum(f.stat().st_size for f in files if f.suffix == ".safetensors") / GIB
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    warm = random_prompts(_vocab_size(llm), 1, 16, seed=0)
    llm.generate(prompt_token_ids=warm, sampling_params=params, use_tqdm=False)
    record["rss_after_warmup_gib"] = _max_rss_gib()  # first-call costs (lazy initialization) are not the prompt's
    print(json.dumps(record), flush=True)  # what is known so far, in case the prompt kills the process
    prompt = random_prompts(_vocab_size(llm), 1, context, seed=context)
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    record.update(peak_gib=_max_rss_gib(), wall_s=seconds)
    error = _outputs_error(outputs)
    if error is None:
        record.update(seconds=seconds, tokens_per_s=context / seconds)
    else:
        record["error"] = error
    print(json.dumps(record), flush=True)


def _rss_gib(pid: int) -> float | None:
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return int(line.split()[1]) * 1024 / GIB if line else None


def run_memory(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    """The CPU memory point in a fresh process, watched so that it can take neither the machine's memory nor more
    than the time left before the deadline."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--memory-child", "--device", "cpu"]
    command += ["--memory-context", str(args.memory_context)]
    command += ["--model", args.model] if args.model else []
    if args.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    record: dict[str, Any] = {"kind": "prefill", "context": args.memory_context, "batch": 1, "method": "memory"}
    record.update(seconds=None, tokens_per_s=None, peak_gib=None)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr, watched = "", "", 0.0
    while True:
        try:
            stdout, stderr = process.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            rss = _rss_gib(process.pid)
            watched = max(watched, rss or 0.0)
            if rss is not None and rss > args.memory_limit_gib:
                process.kill()
                record["error"] = f"stopped: resident memory {rss:.2f} GiB passed --memory-limit-gib"
            elif deadline.elapsed() > deadline.seconds:
                process.kill()
                record["error"] = f"stopped: still running at --deadline-s ({deadline.seconds:.0f} s)"
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        record.update(json.loads(lines[-1]))
    record["watched_rss_gib"] = watched
    if process.returncode != 0 and "error" not in record:
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        record["error"] = f"process exited with status {process.returncode}: {tail[0]}"
    if record.get("peak_gib") is not None and record.get("checkpoint_gib"):
        record["peak_over_checkpoint"] = record["peak_gib"] / record["checkpoint_gib"]
    return record


# ---- report -------------------------------------------------------------------------------------------------------


def print_table(points: list[dict[str, Any]]) -> None:
    smallest: dict[tuple[int, str], float] = {}
    for r in sorted(points, key=lambda r: r["context"]):
        if r["kind"] == "decode" and r["seconds"] is not None:
            smallest.setdefault((r["batch"], r["method"]), r["seconds"])
    print(f"\n{'kind':<8}{'method':<12}{'batch':>6}{'context':>9}{'seconds':>11}{'tokens/s':>11}{'peak GiB':>10}  note")
    for r in sorted(points, key=lambda r: (r["kind"] != "prefill", r["method"], r["batch"], r["context"])):
        if r["seconds"] is None:
            note = r.get("error") or f"skipped: {r.get('skipped')}"
            print(f"{r['kind']:<8}{r['method']:<12}{r['batch']:>6}{r['context']:>9}{'-':>11}{'-':>11}{'-':>10}  {note}")
            continue
        note = ""
        if r["kind"] == "decode":
            note = f"x{r['seconds'] / smallest[(r['batch'], r['method'])]:.2f} of the smallest context"
            note += ", CUDA graph" if r.get("cuda_graph") else ""
        if r["method"] == "memory":
            note = f"RSS after load {r['rss_after_load_gib']:.2f} GiB, checkpoint {r['checkpoint_gib']:.3f} GiB"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(
            f"{r['kind']:<8}{r['method']:<12}{r['batch']:>6}{r['context']:>9}{r['seconds']:>11.4f}"
            f"{r['tokens_per_s']:>11.1f}{peak:>10}  {note}"
        )


# ---- main ---------------------------------------------------------------------------------------------------------


def run_sweep(
    args: argparse.Namespace,
    device: torch.device,
    results: dict[str, Any],
    deadline: Deadline,
    save: Callable[[], None],
) -> None:
    """Build the engine and measure every point of the sweep (module docstring) into `results["points"]`."""
    from deepinfer_engine import LLM, SamplingParams

    on_cuda = device.type == "cuda"
    # An empty list ("") means no points of that kind; an absent one, the defaults.
    prefill = [8192, 32768, 131072] if on_cuda else [256, 512]
    prefill = prefill if args.prefill_contexts is None else args.prefill_contexts
    contexts = [1024, 32768, 131072] if on_cuda else [256, 512]
    contexts = contexts if args.decode_contexts is None else args.decode_contexts
    batches = args.decode_batches or ([1, 32] if on_cuda else [1, 4])
    steps = args.decode_steps or (64 if on_cuda else 4)
    points = plan(prefill, contexts, batches, args.max_prefill_tokens, steps)
    engine_points = [p for p in points if p.method == "generate"]
    max_model_len = max([c + 1 for c in prefill] + [c + steps + 1 for c in contexts])
    # Pages the largest generate call holds at once, the null page and one spare.
    pages = max([p.batch * -(-(p.context + steps + 2) // BLOCK_SIZE) for p in engine_points], default=0)
    engine = {
        "max_model_len": max_model_len,
        "num_cache_blocks": max(pages, -(-(max_model_len + 1) // BLOCK_SIZE)) + 2,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": max([p.batch for p in engine_points], default=1),
        "enforce_eager": args.enforce_eager,
        "precision": "exact",
        "flashmla": args.flashmla,
    }
    if args.max_num_batched_tokens is not None:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    results["engine"] = engine
    start = time.perf_counter()
    llm = LLM(args.model, device=str(device), **engine)
    results["load_s"] = time.perf_counter() - start
    results["checkpoint"] = str(_checkpoint_dir(llm)) if args.model else "built-in tiny"
    print(f"engine built in {results['load_s']:.1f} s: {engine}", flush=True)
    bound = max_model_len + 2 if args.context_bound == "engine" else None
    graphs = on_cuda and not args.enforce_eager
    try:
        # One prompt as long as a full prefill chunk of the default token budget (or the longest point, if shorter).
        warm = random_prompts(_vocab_size(llm), 1, min(8192, max(prefill + contexts)), seed=0)
        start = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompt_token_ids=warm, sampling_params=params, use_tqdm=False)
        results["warmup_s"] = time.perf_counter() - start
        print(f"warm-up generate ({len(warm[0])} tokens) in {results['warmup_s']:.1f} s", flush=True)
        estimates = Estimates()
        model = _engine_model(llm)
        for point in points:
            expected = estimates.seconds(point, steps)
            if not deadline.allows(point.label(), expected):
                skipped = f"{deadline.elapsed():.0f} s elapsed + {expected:.0f} s expected is past --deadline-s"
                results["points"].append({**vars(point), "seconds": None, "tokens_per_s": None, "peak_gib": None})
                results["points"][-1]["skipped"] = skipped
                continue
            print(f"==== {point.label()} (expected {expected:.0f} s)", flush=True)
            if point.method == "generate":
                run = functools.partial(run_generate, llm, point, steps, device)
            else:
                run = functools.partial(run_model_step, model, point, bound or point.context + 1, graphs, 20, device)
            record = measure(point, run, device)
            estimates.update(point, record)
            results["points"].append(record)
            print({k: v for k, v in record.items() if k not in vars(point)}, flush=True)
            save()
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny checkpoint)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--parts", default=None, help="sweep and/or memory, comma-separated (CUDA: sweep; CPU: memory)")
    parser.add_argument("--prefill-contexts", type=int_list, default=None, help="prompt lengths of prefill points")
    parser.add_argument("--decode-contexts", type=int_list, default=None, help="contexts of decode points")
    parser.add_argument("--decode-batches", type=int_list, default=None, help="batch sizes of decode points")
    parser.add_argument("--decode-steps", type=int, default=None, help="decode steps per generate point")
    parser.add_argument(
        "--max-prefill-tokens", type=int, default=131072, help="decode points with batch x context up to this also run "
    )
    parser.add_argument("--context-bound", choices=("engine", "exact"), default="engine", help="model-step bound")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs, in the engine or model steps")
    parser.add_argument(
        "--flashmla",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="FlashMLA's sparse prefill for prompt chunks (EngineArgs.flashmla) (--no-flashmla: off)",
    )
    parser.add_argument("--memory-context", type=int, default=4000, help="prompt tokens of the CPU memory point")
    parser.add_argument("--memory-limit-gib", type=float, default=8.0, help="stop the memory point past this RSS")
    parser.add_argument("--deadline-s", type=float, default=420.0, help="skip points that would end after this")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.model, args.memory_context, args.max_num_batched_tokens)
        return

    from deepinfer_kernels.platform import Accelerator, current_accelerator

    device = torch.device(args.device or ("cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"))
    parts = set((args.parts or ("sweep" if device.type == "cuda" else "memory")).split(","))
    if not parts or parts - {"sweep", "memory"}:
        parser.error(f"--parts takes sweep and/or memory, got {args.parts!r}")
    label = device_label(str(device))
    out = args.out or RESULTS / f"long_context-{label}.json"
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "checkpoint": args.model or "built-in tiny",
        "git_commit": args.git_commit or git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "deadline_s": args.deadline_s,
        "methods": {
            "prefill/generate": "LLM.generate of one random prompt, max_tokens=1; wall time of the call",
            "decode/model-step": "the engine's model, fresh cache with random valid rows of context C for every "
            f"request, one decode token each, max_context_len = {args.context_bound} bound, median CUDA-event time "
            "of CUDA-graph replays (eager without graphs; wall time on CPU), sampling excluded",
            "decode/generate": "LLM.generate after a real prefill; 1 / decode tokens/s (GenerateMetrics) of the "
            "request that started decoding last, host included",
            "memory": "fresh CPU process: LLM with default arguments, one prompt; getrusage max RSS",
            "peak_gib": "CUDA: torch.cuda.max_memory_allocated, reset per point (weights and caches included)",
        },
        "points": [],
    }
    deadline = Deadline(args.deadline_s)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**results, "elapsed_s": deadline.elapsed()}, indent=2) + "\n", encoding="utf-8")

    if "memory" in parts:
        print(f"==== memory: {args.memory_context}-token prompt in a fresh CPU process", flush=True)
        results["points"].append(run_memory(args, deadline))
        save()
    if "sweep" in parts:
        try:
            run_sweep(args, device, results, deadline, save)
        except Exception as exc:
            traceback.print_exc()
            results["error"] = f"{type(exc).__name__}: {exc}"
    save()
    print(f"wrote {out} ({deadline.elapsed():.0f} s in all)")
    print_table(results["points"])
    if results.get("error"):
        print(f"sweep stopped: {results['error']}")


if __name__ == "__main__":
    main()
