"""Data + expert parallelism on several GPUs at real V4.1-Flash widths: correctness, throughput scaling, all-to-all
time and EPLB.

Parts (each runs in its own try/except: a failing part prints its traceback and the others still run; d and e run
first since they need only the config's sizes and take seconds, then a, then b and c):

a. checkpoint: writes the `v41-flash-scaled` preset's random checkpoint (real widths and formats, 8 layers + 1 DSpark
   block, about 65 GB) with the writer's fast path (`fast_experts`, parallel shards), or reuses one already in
   `--ckpt-dir` with the same config.json. Prints its size and parameter count and the write time.
b. correctness: `LLM` on 1 GPU (with CUDA graphs, the default, and with `enforce_eager`, as parallel ranks run) and
   with dp = ep = N on N GPUs (N from `--parallel`, default 2): the greedy tokens of a fixed set of prompts must be
   equal, printed PASS/FAIL per prompt with the top-2 log-prob gap at the first difference. GPU kernels are not
   batch-invariant, so the like-for-like check compares the N ranks with one GPU fed the same per-rank batches
   (prompt i → rank i mod N); the comparison with one batch of every prompt is printed too.
c. throughput, same engines: prefill (long prompts, max_tokens = 1; prompt tokens/s) and decode (short prompts, many
   output tokens; output tokens/s and the mean per-request decode rate), with the ratios N-GPU / 1-GPU (graphs and
   eager).
d. all-to-all time per step: N ranks (one GPU each, NCCL) run the model's expert-parallel MoE dispatch
   (`ExpertParallelMoE.dispatch`, real hidden size, experts, expert width and top-k, the rank's experts run as the
   engine runs them: grouped MXFP4 GEMMs; zero weights) for a decode step's and a prefill step's tokens per rank.
   Every `all_to_all_v` of deepinfer_parallel (count exchange, rows, ids, weights, combine) is timed with CUDA events
   by wrapping it in this process only; per step = per layer x MoE layers.
e. EPLB: a skewed routing trace (Zipf popularity, hot experts on low ids, so the start-up placement overloads EP rank
   0) is dispatched over the N ranks with the start-up placement, the window of measured per-expert loads
   (`ExpertLoadWindow`) goes to `rebalance_experts`, and the same trace is dispatched again with the new placement:
   max/mean routed choices per rank before/after (measured and as the policy predicts). Then the tiny checkpoint's
   model runs expert-parallel on the N GPUs and `ExpertParallelMoE.rebalance` installs a skewed-trace placement
   (weights move between GPUs): the logits of every rank's request before and after must agree.

Usage (the lead's x2 run; --quick halves the work):
    python benchmarks/multi_gpu.py [--quick] [--parallel 2[,4]] [--ckpt-dir /tmp/deepinfer-v41-flash-scaled]
    python benchmarks/multi_gpu.py --device cpu          # dry run: tiny preset, gloo ranks on the CPU
    # optional first command when one command's time is tight (part a then reuses the directory):
    python -m deepinfer_model write-checkpoint --config v41-flash-scaled --out /tmp/deepinfer-v41-flash-scaled
        --fast-experts --workers 16

Prints a table last and writes benchmarks/results/multi_gpu-<device>.json. NVLink multicast stays off: the script
never sets NCCL_NVLS_ENABLE other than to its default 0.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import torch
from bench_common import RESULTS, Deadline, device_label, random_prompts

# ---- sizes -------------------------------------------------------------------------------------------------------


def _sizes(device: str, quick: bool) -> dict[str, int]:
    """Workload sizes: small enough that the whole run stays well under 8 minutes on 2 H200s."""
    if device == "cpu":
        sizes = {
            "check_prompts": 3,
            "check_len": 12,
            "check_tokens": 3,
            "prefill_prompts": 2,
            "prefill_len": 32,
            "decode_prompts": 4,
            "decode_len": 4,
            "decode_tokens": 4,
            "a2a_iters": 3,
            "eplb_steps": 4,
            "eplb_tokens": 64,
        }
    else:
        sizes = {
            "check_prompts": 8,
            "check_len": 32,
            "check_tokens": 8,
            "prefill_prompts": 4,
            "prefill_len": 1024,
            "decode_prompts": 32,
            "decode_len": 16,
            "decode_tokens": 16,
            "a2a_iters": 10,
            "eplb_steps": 8,
            "eplb_tokens": 512,
        }
    if quick:
        sizes = {key: max(1, value // 2) for key, value in sizes.items()}
    return sizes


def _run_part(name: str, results: dict[str, Any], fn: Callable[[], Any]) -> Any:
    print(f"==== {name}", flush=True)
    start = time.perf_counter()
    try:
        value = fn()
    except Exception:
        text = traceback.format_exc()
        print(f"[FAILED] {name}:\n{text}", flush=True)
        results.setdefault("errors", {})[name] = text
        return None
    print(f"---- {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return value


# ---- a. checkpoint -----------------------------------------------------------------------------------------------


def write_or_reuse(config_name: str, out_dir: pathlib.Path, workers: int) -> dict[str, Any]:
    """Write the random checkpoint of `config_name` (fast path) unless `out_dir` already holds it."""
    from deepinfer_model.checkpoint.writer import write_checkpoint
    from deepinfer_model.cli import config_from_argument
    from deepinfer_model.loading.catalogue import build_catalogue, summarize

    config = config_from_argument(config_name)
    summary = summarize(build_catalogue(config))
    record: dict[str, Any] = {
        "config": config_name,
        "dir": str(out_dir),
        "bytes": summary.num_bytes,
        "gb": summary.num_bytes / 1e9,
        "parameters": sum(summary.parameters_by_format.values()),
        "num_tensors": summary.num_tensors,
    }
    existing = out_dir / "config.json"
    complete = existing.is_file() and (out_dir / "model.safetensors.index.json").is_file()
    if complete and json.loads(existing.read_text(encoding="utf-8")) == config.to_dict():
        print(f"reusing {out_dir} ({record['gb']:.2f} GB, {record['parameters']:,} parameters)")
        return {**record, "reused": True, "write_s": 0.0}
    start = time.perf_counter()
    write_checkpoint(config, out_dir, seed=0, fast_experts=True, num_workers=workers)
    seconds = time.perf_counter() - start
    print(
        f"wrote {out_dir}: {record['num_tensors']:,} tensors, {record['gb']:.2f} GB, {record['parameters']:,} "
        f"parameters in {seconds:.1f} s ({record['gb'] / seconds:.2f} GB/s, {workers} workers)"
    )
    return {**record, "reused": False, "write_s": seconds}


# ---- b/c. engines ------------------------------------------------------------------------------------------------


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_engine(
    model_dir: pathlib.Path,
    device: str,
    ranks: int,
    sizes: dict[str, int],
    enforce_eager: bool = False,
    share_counts: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Build one engine (1 rank, or dp = ep = `ranks`) and run the correctness, prefill and decode workloads.

    For each N in `share_counts` the check prompts are also generated as the N DP ranks would see them (one
    `generate` per rank's round-robin share), so a parallel run can be compared with one GPU at equal batches.
    """
    from deepinfer_engine import LLM, SamplingParams
    from deepinfer_engine.executor import assign_round_robin
    from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir

    vocab = open_checkpoint_dir(model_dir).config.text.vocab_size
    block_size = 128  # the engine default
    longest = max(
        sizes["check_len"] + sizes["check_tokens"],
        sizes["prefill_len"] + 1,
        sizes["decode_len"] + sizes["decode_tokens"],
    )
    per_request_blocks = -(-(longest + 1) // block_size)
    max_seqs = max(sizes["check_prompts"], sizes["prefill_prompts"], sizes["decode_prompts"])
    kwargs: dict[str, Any] = {
        "device": device,
        "block_size": block_size,
        "max_num_seqs": max_seqs,
        "num_cache_blocks": max_seqs * per_request_blocks + 2,
        "max_model_len": longest + 1,
        "enforce_eager": enforce_eager,
    }
    if ranks > 1:
        kwargs.update(data_parallel_size=ranks, expert_parallel_size=ranks)
    begin = start = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    record: dict[str, Any] = {"ranks": ranks, "load_s": time.perf_counter() - start}
    print(f"[{ranks} rank(s)] engine built in {record['load_s']:.1f} s", flush=True)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompt_token_ids=random_prompts(vocab, ranks, 8, seed=99), sampling_params=greedy, use_tqdm=False)

        check = random_prompts(vocab, sizes["check_prompts"], sizes["check_len"], seed=1)
        params = SamplingParams(temperature=0.0, max_tokens=sizes["check_tokens"], ignore_eos=True, top_logprobs=2)
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=check, sampling_params=params, use_tqdm=False)
        record["check_s"] = time.perf_counter() - start
        record["greedy_tokens"] = [list(o.token_ids) for o in outputs]
        # log-prob gap between the best and second-best token at every position: how close each greedy choice was
        record["greedy_margins"] = [[top[0][1] - top[1][1] for top in o.top_logprobs] for o in outputs]
        record["greedy_tokens_by_shares"], record["greedy_margins_by_shares"] = {}, {}
        for count in share_counts:
            tokens: list[list[int]] = [[] for _ in check]
            margins: list[list[float]] = [[] for _ in check]
            for share in assign_round_robin(len(check), count):
                shared = [check[i] for i in share]
                outputs = llm.generate(prompt_token_ids=shared, sampling_params=params, use_tqdm=False)
                for i, o in zip(share, outputs, strict=True):
                    tokens[i] = list(o.token_ids)
                    margins[i] = [top[0][1] - top[1][1] for top in o.top_logprobs]
            record["greedy_tokens_by_shares"][str(count)] = tokens
            record["greedy_margins_by_shares"][str(count)] = margins

        prefill = random_prompts(vocab, sizes["prefill_prompts"], sizes["prefill_len"], seed=2)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prefill, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - start
        record["prefill"] = {"wall_s": wall, "prompt_tokens_per_s": sum(map(len, prefill)) / wall}
        print(f"[{ranks} rank(s)] prefill {record['prefill']['prompt_tokens_per_s']:.1f} prompt tok/s", flush=True)

        decode = random_prompts(vocab, sizes["decode_prompts"], sizes["decode_len"], seed=3)
        params = SamplingParams(temperature=0.0, max_tokens=sizes["decode_tokens"], ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=decode, sampling_params=params, use_tqdm=False)
        wall = time.perf_counter() - start
        rates = [o.metrics.decode_tokens_per_s for o in outputs if o.metrics.decode_tokens_per_s is not None]
        generated = sum(len(o.token_ids) for o in outputs)
        record["decode"] = {
            "wall_s": wall,
            "output_tokens_per_s": generated / wall,
            "mean_request_decode_tokens_per_s": sum(rates) / len(rates) if rates else None,
            "step_s": wall / sizes["decode_tokens"],
        }
        print(f"[{ranks} rank(s)] decode {record['decode']['output_tokens_per_s']:.1f} output tok/s", flush=True)
    finally:
        llm.close()
        del llm
        _free_device_memory()
    record["total_s"] = time.perf_counter() - begin
    return record


def compare_greedy(reference: dict[str, Any], other: dict[str, Any]) -> list[bool]:
    """PASS/FAIL per prompt: `other`'s greedy tokens equal `reference`'s; a FAIL prints both runs' top-2 log-prob gap
    at the first differing token (a gap near zero means two tokens were almost tied there)."""
    verdicts = []
    pairs = zip(reference["greedy_tokens"], other["greedy_tokens"], strict=True)
    for index, (want, got) in enumerate(pairs):
        same = want == got
        verdicts.append(same)
        if same:
            print(f"  prompt {index}: PASS")
            continue
        first = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        gaps = [
            run["greedy_margins"][index][first]
            for run in (reference, other)
            if first < len(run["greedy_margins"][index])
        ]
        print(
            f"  prompt {index}: FAIL (first difference at output token {first}; top-2 log-prob gap there: "
            f"{', '.join(f'{g:.2e}' for g in gaps)})"
        )
    return verdicts


# ---- d/e. rank world ---------------------------------------------------------------------------------------------


class _A2ATimer:
    """Wraps deepinfer_parallel's `all_to_all_v` (in this process only) and times every call."""

    def __init__(self, device: torch.device) -> None:
        import deepinfer_parallel.comm as comm
        import deepinfer_parallel.expert_parallel as expert_parallel

        self._modules = (comm, expert_parallel)
        self._original = comm.all_to_all_v
        self._cuda = device.type == "cuda"
        self._events: list[tuple[Any, Any]] = []
        self._host: list[float] = []
        original = self._original

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            if self._cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                out = original(*args, **kwargs)
                end.record()
                self._events.append((begin, end))
                return out
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self._host.append((time.perf_counter() - start) * 1e3)
            return out

        for module in self._modules:
            module.all_to_all_v = timed  # type: ignore[attr-defined]

    def take_ms(self) -> tuple[float, int]:
        """Milliseconds spent in all-to-all calls since the last take, and their number (synchronises)."""
        if self._cuda:
            torch.cuda.synchronize()
            total = sum(begin.elapsed_time(end) for begin, end in self._events)
            count = len(self._events)
        else:
            total, count = sum(self._host), len(self._host)
        self._events, self._host = [], []
        return total, count

    def restore(self) -> None:
        for module in self._modules:
            module.all_to_all_v = self._original  # type: ignore[attr-defined]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _routing(
    n: int, num_experts: int, top_k: int, gen: torch.Generator, popularity: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, top_k] int64 distinct logical experts per token (uniform, or drawn by `popularity`)."""
    if n == 0:
        return torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.ones(num_experts) if popularity is None else popularity
    return torch.multinomial(weights.expand(n, num_experts), top_k, replacement=False, generator=gen)


def _time_all_to_all(
    groups: Any, text: dict[str, int], tokens: dict[str, int], iters: int, device: torch.device
) -> dict[str, Any]:
    from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
    from deepinfer_model.deepseek_v41.moe import RoutedExperts
    from deepinfer_model.layers.mode import ComputeMode

    hidden, experts, top_k = text["hidden_size"], text["n_routed_experts"], text["num_experts_per_tok"]
    ep = ExpertParallelMoE.create(groups, experts, 1, device=device)
    rank = groups.rank
    gen = torch.Generator().manual_seed(100 + rank)
    # This rank's real-width MXFP4 experts (grouped GEMMs, as the engine runs them); their values do not matter here.
    with torch.device(device):
        routed = RoutedExperts(
            experts, hidden, text["moe_intermediate_size"], None, ComputeMode.EXACT, ep.local_experts(0)
        )
    for param in routed.parameters():
        param.data.view(torch.uint8).zero_()

    timer = _A2ATimer(device)
    results: dict[str, Any] = {}
    try:
        for label, n in tokens.items():
            x = torch.randn(n, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
            ids = _routing(n, experts, top_k, gen).to(device)
            weights = torch.rand(n, top_k, generator=gen).to(device)
            bias = torch.zeros(n, hidden, dtype=torch.float32, device=device)
            totals, a2a, calls = [], [], 0
            for it in range(iters + 2):
                torch.distributed.barrier()
                _sync(device)
                timer.take_ms()
                start = time.perf_counter()
                ep.dispatch(0, x, ids, weights, routed, bias)
                _sync(device)
                elapsed = (time.perf_counter() - start) * 1e3
                spent, calls = timer.take_ms()
                if it >= 2:  # two warm-up iterations
                    totals.append(elapsed)
                    a2a.append(spent)
            results[label] = {
                "tokens_per_rank": n,
                "a2a_ms_per_layer": sum(a2a) / len(a2a),
                "dispatch_ms_per_layer": sum(totals) / len(totals),
                "a2a_calls_per_layer": calls,
                "a2a_ms_per_step": sum(a2a) / len(a2a) * text["num_hidden_layers"],
            }
    finally:
        timer.restore()
    return results


def _rank_load(counts: list[torch.Tensor]) -> torch.Tensor:
    """Routing choices received by this rank per layer: [num_layers] int64 on CPU."""
    return torch.stack([c.sum() for c in counts]).cpu()


def _measure_placement(
    groups: Any, placement: Any, traces: list[list[torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch every step's routing with `placement`; returns (rank loads [S, L, ep], logical load [S, L, E])."""
    from deepinfer_parallel.comm import all_gather_into
    from deepinfer_parallel.config import EplbConfig
    from deepinfer_parallel.eplb.stats import ExpertLoadWindow
    from deepinfer_parallel.expert_parallel import AllToAllDispatcher, map_to_physical

    layout = placement.layout
    group = groups.expert_parallel
    dispatcher = AllToAllDispatcher(group, layout.num_local_experts)
    window = ExpertLoadWindow(layout, placement.num_layers, EplbConfig(window_size=len(traces)), device)
    hidden = 128  # the rows' width does not change the counts
    rank_loads = []
    for step in traces:
        per_layer = []
        for layer, ids in enumerate(step):
            ids = ids.to(device)
            physical = map_to_physical(ids, placement, layer, token_offset=group.rank)
            x = torch.zeros(ids.shape[0], hidden, dtype=torch.bfloat16, device=device)
            weights = torch.ones(ids.shape, dtype=torch.float32, device=device)
            received = dispatcher.dispatch(x, physical, weights)
            window.record(layer, group.rank, received.num_tokens_per_local_expert)
            per_layer.append(received.num_tokens_per_local_expert)
        window.end_step(placement.physical_to_logical)
        mine = _rank_load(per_layer).to(device)
        gathered = torch.empty(group.size * mine.numel(), dtype=mine.dtype, device=device)
        all_gather_into(gathered, mine, group)
        rank_loads.append(gathered.view(group.size, -1).t().cpu())
    logical = window.sum_over_ranks(group).cpu()
    return torch.stack(rank_loads), logical


def _imbalance(rank_loads: torch.Tensor) -> float:
    """sum over steps of max_r / sum of mean_r, averaged over layers ([S, L, ep] loads)."""
    loads = rank_loads.double()
    per_layer = loads.max(dim=2).values.sum(dim=0) / loads.mean(dim=2).sum(dim=0).clamp(min=1e-9)
    return float(per_layer.mean())


def _eplb_trace(
    groups: Any, text: dict[str, int], sizes: dict[str, int], redundant: list[int], device: torch.device
) -> dict[str, Any]:
    from deepinfer_parallel.config import ExpertLayoutConfig
    from deepinfer_parallel.eplb.policy import max_to_mean_rank_load, rebalance_experts
    from deepinfer_parallel.expert_parallel import ExpertPlacement

    experts, top_k, layers = text["n_routed_experts"], text["num_experts_per_tok"], text["num_hidden_layers"]
    ep = groups.config.expert_parallel_size
    popularity = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.1  # hot experts on low ids
    gen = torch.Generator().manual_seed(7 + groups.rank)
    traces = [
        [_routing(sizes["eplb_tokens"], experts, top_k, gen, popularity) for _ in range(layers)]
        for _ in range(sizes["eplb_steps"])
    ]
    start_layout = ExpertLayoutConfig(experts, 0, ep)
    before = ExpertPlacement.initial(start_layout, layers, device)
    rank_before, logical = _measure_placement(groups, before, traces, device)

    def predicted(p2l: torch.Tensor) -> float:
        return sum(max_to_mean_rank_load(logical[:, layer], p2l[layer], ep) for layer in range(layers)) / layers

    result: dict[str, Any] = {
        "experts": experts,
        "top_k": top_k,
        "layers": layers,
        "steps": sizes["eplb_steps"],
        "tokens_per_rank_per_step": sizes["eplb_tokens"],
        "before": {
            "measured_max_over_mean": _imbalance(rank_before),
            "predicted": predicted(before.physical_to_logical.cpu()),
        },
        "after": {},
    }
    for num_redundant in redundant:
        if (experts + num_redundant) % ep:
            continue
        start = time.perf_counter()
        new_p2l = rebalance_experts(logical, num_redundant, ep)
        policy_s = time.perf_counter() - start
        layout = ExpertLayoutConfig(experts, num_redundant, ep)
        after = ExpertPlacement.from_physical_to_logical(new_p2l.to(device), layout)
        rank_after, _ = _measure_placement(groups, after, traces, device)
        result["after"][str(num_redundant)] = {
            "measured_max_over_mean": _imbalance(rank_after),
            "predicted": predicted(new_p2l),
            "policy_s": policy_s,
        }
    return result


def _eplb_outputs(groups: Any, tiny_dir: str, device: torch.device) -> dict[str, Any]:
    """Tiny model expert-parallel on the ranks' devices: logits before and after an EPLB rebalance."""
    from deepinfer_engine.envs import read_env
    from deepinfer_engine.model_loading import load_model
    from deepinfer_engine.tokenizer import Tokenizer
    from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
    from deepinfer_model.deepseek_v41.moe import MoE
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_parallel.eplb.policy import rebalance_experts

    model_dir = pathlib.Path(tiny_dir)
    tokenizer = Tokenizer(model_dir)
    from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir

    text = open_checkpoint_dir(model_dir).config.text
    ep = ExpertParallelMoE.create(groups, text.n_routed_experts, text.num_hidden_layers, device=device)
    model = load_model(model_dir, tokenizer, "exact", device, read_env()["DEEPINFER_ENGRAM_PAD_TOKEN"], ep)
    rank = groups.rank
    prompt = random_prompts(text.vocab_size, 1, 20 + 7 * rank, seed=50 + rank)[0]

    def forward() -> torch.Tensor:
        state = model.allocate_state(block_size=16, num_blocks=8, num_state_slots=2, device=device)
        table = torch.arange(1, 8, dtype=torch.int32)[None, :]
        batch = ForwardBatch.for_requests([prompt], [0], table, [1])
        moved = {
            name: getattr(batch, name).to(device)
            for name in ("input_ids", "positions", "cu_query_lens", "context_lens", "block_table", "state_slots")
        }
        batch = ForwardBatch(
            **moved, engram_prefix_ids=None, max_query_len=batch.max_query_len, max_context_len=batch.max_context_len
        )
        with torch.inference_mode():
            return model(batch, state).float().cpu()

    before = forward()
    ranks = groups.config.expert_parallel_size
    popularity = 1.0 / torch.arange(1, text.n_routed_experts + 1, dtype=torch.float64) ** 1.5
    load = (popularity * 1000).round().expand(4, text.num_hidden_layers, text.n_routed_experts).contiguous()
    new_p2l = rebalance_experts(load, 0, ranks)
    changed = not torch.equal(new_p2l, ep.placement.physical_to_logical.cpu())
    ep.rebalance([cast(MoE, block.ffn) for block in model.layers], new_p2l.to(device))
    after = forward()
    scale = float(before.abs().max())
    return {
        "placement_changed": changed,
        "max_abs_logit_diff_over_max": float((after - before).abs().max()) / scale if scale else 0.0,
        "argmax_equal": bool(torch.equal(before.argmax(-1), after.argmax(-1))),
    }


def _world_main(
    rank: int,
    world_size: int,
    device_type: str,
    text: dict[str, int],
    tokens: dict[str, int],
    sizes: dict[str, int],
    redundant: list[int],
    tiny_dir: str,
    out_dir: str,
) -> None:
    from deepinfer_parallel.config import ParallelConfig
    from deepinfer_parallel.groups import ParallelGroups

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    groups.warm_up(device)
    record: dict[str, Any] = {"rank": rank}
    for name, fn in (
        ("all_to_all", lambda: _time_all_to_all(groups, text, tokens, sizes["a2a_iters"], device)),
        ("eplb_trace", lambda: _eplb_trace(groups, text, sizes, redundant, device)),
        ("eplb_outputs", lambda: _eplb_outputs(groups, tiny_dir, device)),
    ):
        try:
            record[name] = fn()
        except Exception:
            record[f"{name}_error"] = traceback.format_exc()
            print(f"[rank {rank}] {name} failed:\n{record[f'{name}_error']}", flush=True)
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")


def run_world(config_name: str, device: str, ranks: int, sizes: dict[str, int], redundant: list[int]) -> dict[str, Any]:
    """Parts d and e in a world of `ranks` processes (NCCL on CUDA, gloo on CPU); needs only the config's sizes."""
    from deepinfer_model.checkpoint.writer import write_checkpoint
    from deepinfer_model.cli import config_from_argument
    from deepinfer_model.config import load_preset
    from deepinfer_parallel.launcher import spawn

    config = config_from_argument(config_name).text
    text = {
        "hidden_size": config.hidden_size,
        "n_routed_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "num_hidden_layers": config.num_hidden_layers,
        "moe_intermediate_size": config.moe_intermediate_size,
    }
    tokens = {
        "decode": max(1, sizes["decode_prompts"] // ranks),
        # The engine prefills the long prompts in chunks of about one prompt per rank and step.
        "prefill": sizes["prefill_len"],
    }
    with tempfile.TemporaryDirectory() as scratch:
        tiny_dir = write_checkpoint(load_preset("tiny"), pathlib.Path(scratch, "tiny"), seed=3)
        backend = "nccl" if device == "cuda" else "gloo"
        args = (device, text, tokens, sizes, redundant, str(tiny_dir), scratch)
        spawn(_world_main, ranks, args=args, backend=backend, timeout_s=300.0)
        records = [json.loads(pathlib.Path(scratch, f"rank{r}.json").read_text()) for r in range(ranks)]
    out: dict[str, Any] = {"ranks": ranks, "per_rank": records}
    errors = {f"rank{r['rank']}.{k}": v for r in records for k, v in r.items() if k.endswith("_error")}
    if errors:
        out["errors"] = errors
    if all("all_to_all" in r for r in records):
        out["all_to_all"] = {
            label: {
                key: max(r["all_to_all"][label][key] for r in records)
                for key in ("tokens_per_rank", "a2a_ms_per_layer", "dispatch_ms_per_layer", "a2a_ms_per_step")
            }
            for label in tokens
        }
    if "eplb_trace" in records[0]:
        out["eplb_trace"] = records[0]["eplb_trace"]
    if all("eplb_outputs" in r for r in records):
        out["eplb_outputs"] = {
            "placement_changed": records[0]["eplb_outputs"]["placement_changed"],
            "max_abs_logit_diff_over_max": max(r["eplb_outputs"]["max_abs_logit_diff_over_max"] for r in records),
            "argmax_equal": all(r["eplb_outputs"]["argmax_equal"] for r in records),
        }
    return out


# ---- report -------------------------------------------------------------------------------------------------------


def _engine_label(key: str) -> str:
    labels = {"1": "1 GPU (graphs)", "1-eager": "1 GPU eager", "1-eager-shares": "1 GPU eager, ranks' batches"}
    return labels.get(key, f"dp=ep={key}")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def print_table(results: dict[str, Any]) -> None:
    print("\n================ multi-GPU summary ================")
    ckpt = results.get("checkpoint")
    if ckpt:
        print(
            f"checkpoint  {ckpt['config']}: {ckpt['gb']:.2f} GB, {ckpt['parameters']:,} parameters, "
            f"write {ckpt['write_s']:.1f} s{' (reused)' if ckpt['reused'] else ''}"
        )
    engines = results.get("engines", {})
    single, eager = engines.get("1"), engines.get("1-eager")

    def rate(run: dict[str, Any] | None, part: str, name: str) -> float | None:
        return run.get(part, {}).get(name) if run else None

    print(
        f"{'engine':<16}{'load s':>8}{'prefill tok/s':>15}{'x 1 GPU':>9}{'decode tok/s':>14}{'x 1 GPU':>9}"
        f"{'x 1 GPU eager':>15}"
    )
    for key, run in engines.items():
        prefill = rate(run, "prefill", "prompt_tokens_per_s")
        decode = rate(run, "decode", "output_tokens_per_s")
        print(
            f"{_engine_label(key):<16}{run.get('load_s', float('nan')):>8.1f}{prefill or float('nan'):>15.1f}"
            f"{_ratio(prefill, rate(single, 'prefill', 'prompt_tokens_per_s')):>9}{decode or float('nan'):>14.1f}"
            f"{_ratio(decode, rate(single, 'decode', 'output_tokens_per_s')):>9}"
            f"{_ratio(decode, rate(eager, 'decode', 'output_tokens_per_s')):>15}"
        )
    for pair, verdicts in results.get("greedy_equal", {}).items():
        key, base = pair.split(" vs ")
        print(f"greedy {_engine_label(key)} vs {_engine_label(base)}: {sum(verdicts)}/{len(verdicts)} prompts equal")
    for key, world in results.get("worlds", {}).items():
        for label, a2a in world.get("all_to_all", {}).items():
            step = engines.get(key, {}).get("decode", {}).get("step_s") if label == "decode" else None
            share = f", {a2a['a2a_ms_per_step'] / (step * 1e3):.0%} of a measured decode step" if step else ""
            print(
                f"all-to-all ep={key} {label:<8} {a2a['tokens_per_rank']:>6} tok/rank: {a2a['a2a_ms_per_layer']:.3f} "
                f"ms/layer, {a2a['a2a_ms_per_step']:.2f} ms/step (dispatch+combine {a2a['dispatch_ms_per_layer']:.3f} "
                f"ms/layer){share}"
            )
        trace = world.get("eplb_trace")
        if trace:
            after = ", ".join(
                f"{v['measured_max_over_mean']:.3f} (R={k}, predicted {v['predicted']:.3f})"
                for k, v in trace["after"].items()
            )
            print(
                f"EPLB ep={key} skewed trace, max/mean routed choices per rank: before "
                f"{trace['before']['measured_max_over_mean']:.3f} (predicted {trace['before']['predicted']:.3f}); "
                f"after {after}"
            )
        outputs = world.get("eplb_outputs")
        if outputs:
            verdict = "PASS" if outputs["argmax_equal"] and outputs["max_abs_logit_diff_over_max"] <= 1e-3 else "FAIL"
            print(
                f"EPLB ep={key} rebalance on the tiny model: placement changed {outputs['placement_changed']}, "
                f"max |dlogit|/max {outputs['max_abs_logit_diff_over_max']:.2e}, argmax equal "
                f"{outputs['argmax_equal']}: {verdict}"
            )
    if results.get("errors"):
        print(f"FAILED parts: {', '.join(results['errors'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu (dry run)")
    parser.add_argument("--parallel", default="2", help="comma-separated dp = ep sizes to run (default 2)")
    parser.add_argument("--config", default=None, help="preset or config.json (default v41-flash-scaled; cpu: tiny)")
    parser.add_argument("--ckpt-dir", type=pathlib.Path, default=None, help="checkpoint directory (written if absent)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="checkpoint writer threads")
    parser.add_argument("--redundant", default="0,16", help="EPLB redundant experts to try (comma-separated)")
    parser.add_argument("--quick", action="store_true", help="half-size workloads")
    parser.add_argument(
        "--parts", default="abcde", help="parts to run (default abcde; b and c run together, d and e too)"
    )
    parser.add_argument(
        "--deadline-s", type=float, default=450.0, help="skip parts that would not end within this many seconds"
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (it can take the host's GPUs down)
    deadline = Deadline(args.deadline_s)
    device = args.device
    config_name = args.config or ("v41-flash-scaled" if device == "cuda" else "tiny")
    ckpt_dir = args.ckpt_dir or pathlib.Path(tempfile.gettempdir(), f"deepinfer-{config_name}")
    parallel = [int(part) for part in args.parallel.split(",") if part.strip()]
    redundant = [int(part) for part in args.redundant.split(",") if part.strip()]
    if device == "cuda":
        visible = torch.cuda.device_count()
        skipped = [n for n in parallel if n > visible]
        if skipped:
            print(f"[skip] dp = ep = {skipped}: only {visible} GPU(s) visible")
        parallel = [n for n in parallel if n <= visible]
    sizes = _sizes(device, args.quick)
    results: dict[str, Any] = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": args.quick,
        "sizes": sizes,
        "engines": {},
        "greedy_equal": {},
        "worlds": {},
    }
    print(f"sizes: {sizes}", flush=True)

    # d/e first: they need only the config's sizes and the tiny checkpoint, and take seconds.
    for ranks in parallel if {"d", "e"} & set(args.parts) else []:
        world = _run_part(
            f"d/e. all-to-all and EPLB, {ranks} ranks",
            results,
            functools.partial(run_world, config_name, device, ranks, sizes, redundant),
        )
        if world is not None:
            results["worlds"][str(ranks)] = world
            for name, text in world.get("errors", {}).items():
                results.setdefault("errors", {})[f"d/e.{ranks}.{name}"] = text
    # (key, ranks, enforce_eager): one GPU with CUDA graphs (the default) and eagerly (as the parallel ranks run)
    engine_runs = [("1", 1, False), ("1-eager", 1, True), *((str(n), n, False) for n in parallel)]
    engine_runs = engine_runs if {"b", "c"} & set(args.parts) else []
    checkpoint = None
    if engine_runs or "a" in args.parts:
        checkpoint = _run_part("a. checkpoint", results, lambda: write_or_reuse(config_name, ckpt_dir, args.workers))
    if checkpoint is not None:
        results["checkpoint"] = checkpoint
        model_dir = pathlib.Path(checkpoint["dir"])
        for key, ranks, eager in engine_runs:
            single = results["engines"].get("1")
            # Every engine loads and runs about as long as the single one did: do not start one that cannot end.
            expected = 0.0 if single is None else single["total_s"]
            if not deadline.allows(f"b/c. engine {_engine_label(key)}", expected):
                continue
            shares = tuple(parallel) if key == "1-eager" else ()
            run = _run_part(
                f"b/c. engine {_engine_label(key)}",
                results,
                functools.partial(run_engine, model_dir, device, ranks, sizes, eager, shares),
            )
            if run is not None:
                results["engines"][key] = run
        comparisons = [("1-eager", "1"), *((str(n), "1") for n in parallel), *((str(n), "1-eager") for n in parallel)]
        for key, base in comparisons:
            run, reference = results["engines"].get(key), results["engines"].get(base)
            if reference is not None and run is not None:
                print(f"greedy outputs, {_engine_label(key)} vs {_engine_label(base)}:")
                results["greedy_equal"][f"{key} vs {base}"] = compare_greedy(reference, run)
        eager = results["engines"].get("1-eager")
        for n in parallel:
            run = results["engines"].get(str(n))
            if eager is not None and run is not None and str(n) in eager.get("greedy_tokens_by_shares", {}):
                # GPU kernels are not batch-invariant: one GPU fed each rank's batch is the like-for-like reference.
                reference = {
                    "greedy_tokens": eager["greedy_tokens_by_shares"][str(n)],
                    "greedy_margins": eager["greedy_margins_by_shares"][str(n)],
                }
                print(f"greedy outputs, dp=ep={n} vs 1 GPU eager fed the {n} ranks' batches:")
                results["greedy_equal"][f"{n} vs 1-eager-shares"] = compare_greedy(reference, run)
    results["elapsed_s"] = deadline.elapsed()
    label = device_label(device)
    out = args.out or RESULTS / f"multi_gpu-{label}{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out} ({results['elapsed_s']:.0f} s in all)")
    print_table(results)


if __name__ == "__main__":
    main()
