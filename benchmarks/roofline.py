"""Decode and prefill steps against their rooflines, with the machine's rates measured in the same run.

1. Rates (`machine_rates.py`): the copy bandwidth (one large copy, bytes read + written) and the FP8 GEMM rate
   (`torch._scaled_mm` on random e4m3 matrices; on a CPU an FP32 matmul stands in).
2. The engine loads the checkpoint (`--model`, default the built-in tiny one); its model runs every point.
3. Decode at each `--decode-batches` size (CUDA default 1, 64, 256, 16: the acceptance points first), context
   `--context` (long_context.py's "model-step" method: a fresh cache filled with random valid rows, one token per
   request; on CUDA the median CUDA-event time of CUDA-graph replays, on a CPU the median wall time of eager steps).
   An eager step first counts the distinct experts each layer's router chose. Bytes = `roofline_counts.decode_bytes`
   with those counts (with the uniform-routing expectation beside it); floor = bytes / copy bandwidth.
4. Prefill of one prompt of each `--prefill-lens` length (CUDA default 8192, then 1024) from position 0 as one model
   step (eager, median of `--prefill-repeats` after one untimed step); FLOPs = `roofline_counts.prefill_flops`;
   floor = FLOPs / GEMM rate.

5. With `--batch-invariant both` every decode point runs twice, with the model's batch-invariant mode off and on
   (DEEPINFER_BATCH_INVARIANT; docs/design/numerics.md, "Batch invariance"; graphs captured inside the mode); `on`
   runs only the mode. Each record has "batch_invariant"; the header's "batch_invariant_overhead" maps each batch
   to step_on / step_off − 1.
6. `--dependent-launch` does the same for the model's dependent-launch mode (`EngineArgs.dependent_launch`;
   docs/design/kernels.md, "Dependent launches"), for decode and prefill points: records have "dependent_launch",
   the header's "dependent_launch_change" maps each point (decode batch, or "prefill <prompt>") to step_on /
   step_off − 1; `auto` (the default) runs each point as the engine does (`dependent_launch=None`: on for decode
   batches of at most `DEPENDENT_LAUNCH_AUTO_TOKENS` requests, off beyond and for prefill). `--branch-streams`
   likewise for the branch-streams mode (`EngineArgs.branch_streams`; docs/design/kernels.md, "Branch streams"; on
   by default, as in the engine; "branch_streams",
   "branch_streams_change"), and `--flashmla` for FlashMLA's sparse prefill (`EngineArgs.flashmla`;
   docs/design/kernels.md, "FlashMLA sparse prefill"; on by default, as in the engine; prefill points only, decode
   never takes it; "flashmla", "flashmla_change"). Each mode's change compares points with the other modes the
   same, and names the other modes that were on ("64 +branch_streams").

Points run in that order. Each point's ratio is step / floor; the records are sorted at the end. A point that would
end past `--deadline-s` is skipped; the JSON is rewritten after every point, so a run that is stopped keeps what it
measured.

Usage (the H200 run, about 6 minutes with the checkpoint write):
    python3 -m deepinfer_model write-checkpoint --config v41-flash-scaled --out $CKPT --fast-experts --workers 16
    python3 benchmarks/roofline.py --model $CKPT --deadline-s 300 --out $OUT/roofline-h200.json
    python3 benchmarks/roofline.py --model $CKPT --decode-batches 1,64 --prefill-lens 1024 --batch-invariant both
    python benchmarks/roofline.py                   # CPU: the built-in tiny checkpoint, small points

Writes benchmarks/results/roofline-<device>.json: {"header": {device, checkpoint, git_commit, bandwidth, gemm, ...},
"records": [{"kind", "batch", "prompt", "step_ms", "floor_ms", "ratio", ...}], "skipped": [...], "errors": [...]}; for
a decode record "prompt" is the context. Prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import pathlib
import platform
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import long_context
import machine_rates
import roofline_counts
import torch
from bench_common import RESULTS, Deadline, device_label, git_commit, int_list, median_wall_s

if TYPE_CHECKING:
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM


@contextlib.contextmanager
def distinct_expert_counts(model: DeepseekV41ForCausalLM) -> Iterator[dict[int, int]]:
    """Within the block, the first eager forward fills {backbone layer: distinct experts its router chose}. The
    hooks do nothing while a CUDA graph is being captured (their count would synchronize with the host)."""
    counts: dict[int, int] = {}
    handles = []
    for layer, moe in enumerate(model.moe_layers()):

        def hook(_module: Any, _inputs: Any, output: tuple[torch.Tensor, torch.Tensor], layer: int = layer) -> None:
            if layer in counts or (output[0].is_cuda and torch.cuda.is_current_stream_capturing()):
                return
            counts[layer] = int(torch.unique(output[0]).numel())

        handles.append(moe.gate.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def run_decode(
    model: DeepseekV41ForCausalLM, batch: int, context: int, bound: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    """One decode point (module docstring, 3.) through long_context's model step."""
    point = long_context.Point("decode", context, batch, "model-step")
    with distinct_expert_counts(model) as counts:
        record = long_context.measure(
            point,
            lambda: long_context.run_model_step(model, point, bound, device.type == "cuda", repeats, device),
            device,
        )
    layers = model.config.text.num_hidden_layers
    measured = [counts[layer] for layer in range(layers)] if len(counts) == layers else None
    record["distinct_experts"] = measured
    return record


def run_prefill(model: DeepseekV41ForCausalLM, prompt: int, repeats: int, device: torch.device) -> dict[str, Any]:
    """One prefill step of a random `prompt`-token request over a fresh cache (`long_context.prefill_step`)."""
    with torch.inference_mode():
        state, step = long_context.prefill_step(model, prompt, device)

        def forward() -> None:
            model(step, state)

        if device.type == "cuda":
            from deepinfer_kernels.benchmarking import cuda_time_ms

            seconds = cuda_time_ms(forward, warmup=0, repeats=repeats, capture=False)[0] / 1e3
        else:
            seconds = median_wall_s(forward, device, warmup=1, repeats=repeats)
    return {"seconds": seconds, "tokens_per_s": prompt / seconds, "cuda_graph": False}


MODES = ("batch_invariant", "dependent_launch", "branch_streams", "flashmla")


def mode_point(
    model: DeepseekV41ForCausalLM, modes: dict[str, bool], run: Callable[..., dict[str, Any]], *args: Any
) -> dict[str, Any]:
    """``run(*args)`` with the model's kernel modes (``MODES``: its attributes) set as ``modes`` says (restored
    after); the record carries them."""
    before = {name: getattr(model, name) for name in MODES}
    for name, value in modes.items():
        setattr(model, name, value)
    try:
        return {**run(*args), **modes}
    finally:
        for name, value in before.items():
            setattr(model, name, value)


def mode_change(records: list[dict[str, Any]], mode: str, kinds: tuple[str, ...]) -> dict[str, float]:
    """Per point of ``kinds`` measured with ``mode`` off and on, the other modes the same in both: step_on / step_off
    − 1, keyed by the decode batch or "prefill <prompt>", followed by the other modes that were on (``"64
    +branch_streams"``)."""
    others = [name for name in MODES if name != mode]
    steps = {
        (r["kind"], r["batch"] if r["kind"] == "decode" else r["prompt"], tuple(r[n] for n in others), r[mode]): r[
            "step_ms"
        ]
        for r in records
        if r["kind"] in kinds
    }

    def label(kind: str, size: int, setting: tuple[bool, ...]) -> str:
        point = str(size) if kind == "decode" else f"{kind} {size}"
        return " ".join([point, *(f"+{name}" for name, on in zip(others, setting, strict=True) if on)])

    return {
        label(kind, size, setting): steps[(kind, size, setting, True)] / steps[(kind, size, setting, False)] - 1
        for kind, size, setting, on in steps
        if on and (kind, size, setting, False) in steps
    }


def roofline_record(kind: str, record: dict[str, Any], config: Any, rates: dict[str, Any]) -> dict[str, Any]:
    """The JSON record of a measured point: step_ms, floor_ms, ratio and what they came from."""
    step_ms = record["seconds"] * 1e3
    out: dict[str, Any] = {"kind": kind, "batch": record["batch"], "prompt": record["context"], "step_ms": step_ms}
    if kind == "decode":
        bytes_ = roofline_counts.decode_bytes(config, record["batch"], record["context"], record["distinct_experts"])
        expected = roofline_counts.decode_bytes(config, record["batch"], record["context"])
        floor_ms = bytes_.total / rates["bandwidth"]["bytes_per_s"] * 1e3
        out.update(
            floor_ms=floor_ms, ratio=step_ms / floor_ms, bytes=bytes_.total, bytes_uniform_routing=expected.total
        )
        out["bytes_parts"] = {
            "step_dense": bytes_.step_dense,
            "routed_experts": bytes_.routed_experts,
            "embed_rows": bytes_.embed_rows,
            "engram_rows": bytes_.engram_rows,
            **bytes_.cache,
        }
        out["distinct_experts"] = record["distinct_experts"]
        out["distinct_experts_uniform"] = expected.distinct_experts[0]
        out["achieved_bytes_per_s"] = bytes_.total / (step_ms / 1e3)
        out.update(context=record["context"], max_context_len=record["max_context_len"])
    else:
        flops = roofline_counts.prefill_flops(config, record["context"])
        rate = rates["gemm"]["flop_per_s"]
        floor_ms = sum(flops.values()) / rate * 1e3 if rate else None
        out.update(floor_ms=floor_ms, ratio=step_ms / floor_ms if floor_ms else None, flops=sum(flops.values()))
        out["flops_parts"] = flops
        out["achieved_flop_per_s"] = sum(flops.values()) / (step_ms / 1e3)
    out.update(cuda_graph=record.get("cuda_graph"), peak_gib=record.get("peak_gib"))
    return out


def print_table(result: dict[str, Any]) -> None:
    header = result["header"]
    bandwidth, gemm = header["bandwidth"], header["gemm"]
    print(f"\ncopy bandwidth {bandwidth['bytes_per_s'] / 1e12:.3f} TB/s ({bandwidth['method']})")
    rate = gemm.get("flop_per_s")
    print(f"GEMM rate {rate / 1e12:.1f} TFLOP/s ({gemm['method']})" if rate else f"GEMM rate: {gemm.get('error')}")
    modes = "".join(f"{name:>5}" for name in ("inv", "pdl", "br", "fmla"))
    print(f"{'kind':<8}{'batch':>6}{'prompt':>8}{modes}{'step ms':>11}{'floor ms':>11}{'ratio':>8}  basis")
    for r in result["records"]:
        basis = f"{r['bytes'] / 1e9:.3f} GB" if r["kind"] == "decode" else f"{r['flops'] / 1e12:.3f} TFLOP"
        floor = f"{r['floor_ms']:>11.3f}{r['ratio']:>8.2f}" if r["floor_ms"] else f"{'-':>11}{'-':>8}"
        modes = "".join(f"{'on' if r[name] else 'off':>5}" for name in MODES)
        print(f"{r['kind']:<8}{r['batch']:>6}{r['prompt']:>8}{modes}{r['step_ms']:>11.3f}{floor}  {basis}")
    for batch, overhead in header.get("batch_invariant_overhead", {}).items():
        print(f"batch-invariant overhead at decode batch {batch}: {overhead * 100:+.1f} %")
    for point, change in header.get("dependent_launch_change", {}).items():
        print(f"dependent launches at {point}: {change * 100:+.1f} % step time")
    for point, change in header.get("branch_streams_change", {}).items():
        print(f"branch streams at {point}: {change * 100:+.1f} % step time")
    for point, change in header.get("flashmla_change", {}).items():
        print(f"FlashMLA at {point}: {change * 100:+.1f} % step time")
    for line in result["skipped"] + result["errors"]:
        print(line)


def _estimate_s(kind: str, size: int, on_cuda: bool) -> float:
    """A generous guess of a point's seconds (for the deadline): the scaled checkpoint on an H200 takes about 0.2 s
    per decode step at batch 256 and about 3 s per 8K-token prefill."""
    if not on_cuda:
        return 2.0
    return 5.0 + size * 0.05 if kind == "decode" else 5.0 + size * 4 * 3.0 / 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny checkpoint)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    parser.add_argument("--decode-batches", type=int_list, default=None, help="decode batch sizes ('' for none)")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per request before a decode step")
    parser.add_argument(
        "--prefill-lens", type=int_list, default=None, help="prompt lengths of the prefill points ('' for none)"
    )
    parser.add_argument("--decode-repeats", type=int, default=20, help="timed decode steps per point")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="timed prefill steps per point")
    parser.add_argument("--copy-mib", type=int, default=None, help="copy buffer size (CUDA 4096, CPU 64)")
    parser.add_argument("--gemm-size", type=int, default=None, help="GEMM edge (CUDA 8192, CPU 512)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="skip points that would end after this")
    parser.add_argument("--git-commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: benchmarks/results/)")
    parser.add_argument(
        "--batch-invariant",
        choices=("off", "on", "both"),
        default="off",
        help="decode points with the batch-invariant mode off, on, or both (overhead in the header)",
    )
    parser.add_argument(
        "--dependent-launch",
        choices=("off", "on", "both", "auto"),
        default="auto",
        help="decode and prefill points with the dependent-launch mode off, on, both (change in the header), or as the"
        " engine's default chooses for each point (auto)",
    )
    parser.add_argument(
        "--branch-streams",
        choices=("off", "on", "both"),
        default="on",
        help="decode and prefill points with the branch-streams mode off, on (the engine's default), or both (change "
        "in the header)",
    )
    parser.add_argument(
        "--flashmla",
        choices=("off", "on", "both"),
        default="on",
        help="prefill points with FlashMLA's sparse prefill (EngineArgs.flashmla) off, on (the engine's default), or "
        "both (change in the header; it needs the flash_mla module)",
    )
    args = parser.parse_args()

    from deepinfer_engine import LLM
    from deepinfer_engine.engine_args import DEPENDENT_LAUNCH_AUTO_TOKENS
    from deepinfer_kernels.platform import Accelerator, current_accelerator

    deadline = Deadline(args.deadline_s)
    device = torch.device(args.device or ("cuda" if current_accelerator() is Accelerator.NVIDIA else "cpu"))
    on_cuda = device.type == "cuda"
    # Points run in list order, decode first; the CUDA defaults put issue 13's acceptance points (decode at 1, 64 and
    # 256, the 8K prefill) ahead of the others, so that a tight --deadline-s drops the others first.
    batches = [1, 64, 256, 16] if on_cuda else [1, 4]
    batches = batches if args.decode_batches is None else args.decode_batches
    prefill = [8192, 1024] if on_cuda else [64, 256]
    prefill = prefill if args.prefill_lens is None else args.prefill_lens
    out = args.out or RESULTS / f"roofline-{device_label(str(device))}.json"
    result: dict[str, Any] = {"header": {}, "records": [], "skipped": [], "errors": []}
    header = result["header"]
    header.update(device=torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu")
    header.update(checkpoint=args.model or "built-in tiny", git_commit=args.git_commit or git_commit())
    header.update(torch=torch.__version__, python=platform.python_version(), context=args.context)

    def save() -> None:
        header["elapsed_s"] = deadline.elapsed()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    header["bandwidth"] = machine_rates.copy_bandwidth(device, args.copy_mib or (4096 if on_cuda else 64))
    if on_cuda:
        torch.cuda.empty_cache()  # the copy's buffers, before the engine takes its memory
    header["gemm"] = machine_rates.gemm_rate(device, args.gemm_size or (8192 if on_cuda else 512))
    print(f"rates: {header['bandwidth']} {header['gemm']}", flush=True)
    header["methods"] = {
        "decode": f"model step at context {args.context} over a fresh random cache, max_context_len = context + 1; "
        "CUDA: median CUDA-event time of CUDA-graph replays (CPU: eager wall time); floor = bytes / bandwidth with "
        "the distinct experts measured by an eager step",
        "prefill": "one eager model step of the whole prompt from position 0, last-token logits; floor = FLOPs / "
        "GEMM rate",
    }
    save()
    max_model_len = max([*prefill, args.context + 2]) + 1
    start = time.perf_counter()
    llm = LLM(
        args.model,
        device=str(device),
        max_model_len=max_model_len,
        max_num_seqs=1,
        enforce_eager=True,
        num_cache_blocks=-(-(max_model_len + 1) // long_context.BLOCK_SIZE) + 2,
        precision="exact",
    )
    header["load_s"] = time.perf_counter() - start
    save()
    model = llm.model
    # The records' dependent_launch says what ran; `auto` chooses it per point below, as the engine would.
    model.dependent_launch_max_tokens = 0
    config = model.config
    # Decode steps pass the exact bound C + 1 as max_context_len, as an eager engine step does.
    settings = {"off": (False,), "on": (True,), "both": (False, True)}
    invariant_modes = settings[args.batch_invariant]

    def dependent_modes(tokens: int) -> tuple[bool, ...]:
        if args.dependent_launch == "auto":
            return (tokens <= DEPENDENT_LAUNCH_AUTO_TOKENS,)
        return settings[args.dependent_launch]

    branch_modes, flashmla_modes = settings[args.branch_streams], settings[args.flashmla]
    plan: list[tuple[str, int, Callable[[], dict[str, Any]]]] = [
        (
            "decode",
            b,
            functools.partial(
                mode_point, model,
                {"batch_invariant": invariant, "dependent_launch": dependent, "branch_streams": branch,
                 "flashmla": False},
                run_decode, model, b, args.context, args.context + 1, args.decode_repeats, device,
            ),
        )
        for b in batches
        for invariant in invariant_modes
        for dependent in dependent_modes(b)
        for branch in branch_modes
    ]  # fmt: skip
    for prompt in prefill:
        point = long_context.Point("prefill", prompt, 1, "model-step")
        step = functools.partial(run_prefill, model, prompt, args.prefill_repeats, device)
        for dependent, branch, flashmla in itertools.product(dependent_modes(prompt), branch_modes, flashmla_modes):
            modes = {
                "batch_invariant": False,
                "dependent_launch": dependent,
                "branch_streams": branch,
                "flashmla": flashmla,
            }
            measure = functools.partial(long_context.measure, point, step, device)
            plan.append(("prefill", prompt, functools.partial(mode_point, model, modes, measure)))
    try:
        for kind, size, run in plan:
            label = f"{kind} {'batch' if kind == 'decode' else 'prompt'} {size}"
            if not deadline.allows(label, _estimate_s(kind, size, on_cuda)):
                result["skipped"].append(f"skipped {label}: past --deadline-s after {deadline.elapsed():.0f} s")
                continue
            print(f"==== {label}", flush=True)
            record = run()
            if record.get("seconds") is None:
                result["errors"].append(f"{label}: {record.get('error')}")
            else:
                result["records"].append(roofline_record(kind, record, config, header))
                result["records"][-1].update({name: bool(record.get(name)) for name in MODES})
                header["batch_invariant_overhead"] = mode_change(result["records"], "batch_invariant", ("decode",))
                for mode in ("dependent_launch", "branch_streams", "flashmla"):
                    header[f"{mode}_change"] = mode_change(result["records"], mode, ("decode", "prefill"))
                print(result["records"][-1], flush=True)
            save()
    finally:
        llm.close()
    result["records"].sort(key=lambda r: (r["kind"] != "decode", r["batch"], r["prompt"]))
    save()
    print(f"wrote {out} ({deadline.elapsed():.0f} s in all)")
    print_table(result)


if __name__ == "__main__":
    main()
