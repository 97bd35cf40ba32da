"""The model's branch streams site by site (docs/design/kernels.md, "Branch streams").

Decode steps of a checkpoint (long_context.py's "model-step" method: a fresh cache of random rows at context
`--context`, CUDA-graph replays, median CUDA-event time) with the branch-streams mode off, with every branch, with
one kind of branch alone (the shared expert `moe`, the window keys `window`, the next block's Engram projection
`engram`), and with every kind but one (`no-<kind>`). A branch kind left out runs where it is called, on the calling
stream. The variants of one batch run in `--rounds` rounds, in the same order each round; a variant's time is its
fastest round's median. Prints the table last and writes JSON (default benchmarks/results/branch_sites-<device>.json).

Usage (on a GPU):
    python3 -m deepinfer_model write-checkpoint --config v41-flash-scaled --out $CKPT --fast-experts --workers 16
    python3 benchmarks/branch_sites.py --model $CKPT --batches 1,64,256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
from collections.abc import Callable, Iterator
from typing import Any

import long_context
import torch
from bench_common import RESULTS, device_label, git_commit, int_list

# Branch kind -> (module, name) of the branch-starting function the model calls there.
SITES = {
    "moe": ("deepinfer_model.deepseek_v41.moe", "fork"),
    "window": ("deepinfer_model.deepseek_v41.attention", "fork"),
    "engram": ("deepinfer_model.deepseek_v41.block", "prefetch"),
}
# Off, every site, each site alone, and every site but one ("no-<kind>": what that site adds to the others).
VARIANTS: dict[str, tuple[str, ...]] = {
    "off": (),
    "all": tuple(SITES),
    **{kind: (kind,) for kind in SITES},
    **{f"no-{kind}": tuple(other for other in SITES if other != kind) for kind in SITES},
}


def _in_place(device: torch.device, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from deepinfer_kernels.branch_streams import branch_streams, fork

    with branch_streams(False):
        return fork(device, fn, *args, **kwargs)


@contextlib.contextmanager
def only_sites(kinds: tuple[str, ...]) -> Iterator[None]:
    """Within the block the branch kinds not in ``kinds`` run in place."""
    import importlib

    saved = []
    for kind, (module_name, name) in SITES.items():
        if kind not in kinds:
            module = importlib.import_module(module_name)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _in_place)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--batches", type=int_list, default=[1, 64, 256], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per request")
    parser.add_argument("--repeats", type=int, default=20, help="timed replays per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the variants per batch")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)"
    )
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    names = [name for name in args.variants.split(",") if name]
    if "off" not in names or not set(names) <= set(VARIANTS):
        parser.error(f"--variants must name known variants, 'off' among them (the baseline); known: {list(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in names}

    from deepinfer_engine import LLM

    device = torch.device("cuda")
    bound = args.context + 1
    llm = LLM(
        args.model,
        device="cuda",
        max_model_len=args.context + 3,
        max_num_seqs=1,
        enforce_eager=True,
        num_cache_blocks=-(-(args.context + 4) // long_context.BLOCK_SIZE) + 2,
        precision="exact",
    )
    model = llm.model
    results: list[dict[str, Any]] = []
    try:
        for batch in args.batches:
            point = long_context.Point("decode", args.context, batch, "model-step")
            best: dict[str, float] = {}
            for _ in range(args.rounds):
                for variant, kinds in variants.items():
                    model.branch_streams = variant != "off"
                    with only_sites(kinds):
                        record = long_context.run_model_step(model, point, bound, True, args.repeats, device)
                    assert record["cuda_graph"], "the decode step was not captured"
                    best[variant] = min(best.get(variant, float("inf")), record["seconds"] * 1e3)
            for variant, ms in best.items():
                results.append({"batch": batch, "variant": variant, "step_ms": ms, "change": ms / best["off"] - 1})
                print(results[-1], flush=True)
    finally:
        llm.close()
    label = device_label("cuda")
    out = args.out or RESULTS / f"branch_sites-{label}.json"
    header = {"device": torch.cuda.get_device_name(device), "git_commit": git_commit(), "torch": torch.__version__}
    header.update(python=platform.python_version(), checkpoint=args.model, context=args.context, rounds=args.rounds)
    with open(out, "w", encoding="utf-8") as file:
        json.dump({"header": header, "results": results}, file, indent=2)
        file.write("\n")
    print(f"wrote {out}\n\n{'batch':>6}{'variant':>11}{'step ms':>10}{'change':>9}")
    for r in results:
        print(f"{r['batch']:>6}{r['variant']:>11}{r['step_ms']:>10.3f}{r['change'] * 100:>8.1f}%")


if __name__ == "__main__":
    main()
