"""The lightning indexer's selection (``indexer_select``) on one CUDA device at the ``v41-flash-scaled`` preset's shape,
for a causal prefill of one request (docs/design/kernels.md, "indexer_select").

Inputs: ``T`` queries of one request (each of --prompts) over a paged index-K pool of ``T`` rows (FP4_UE8M0, the
index-K row format; 128 rows a page, pages shuffled), query ``t`` seeing rows ``0 … t`` (a compress ratio of 1),
``index_n_heads`` × ``index_head_dim`` queries (32 × 128) read through the row format as the model reads them, random
weights, ``index_topk`` (512) rows selected, exact mode (logits rounded to BF16). Three calls as a prefill makes them:

- ``source``: the candidate-source layer, unrestricted, which also returns ``candidate_topk_blocks`` (2048) blocks of
  ``candidate_block_size`` (8) rows per query;
- ``plain``: an unrestricted index source without candidate blocks;
- ``restricted``: a later index source scanning only the source's candidate blocks.

Each is timed by ``cuda_time_ms`` (median of CUDA-graph replays of one call). Run it once per kernel version (e.g. with
an earlier commit's ``deepinfer-kernels/src`` first on PYTHONPATH) in one device call and compare the JSONs; the
output records a checksum of the selected rows, equal between versions that select the same rows.

Usage (PYTHONPATH holding the packages' src directories):
    python3 benchmarks/kernels_indexer.py [--prompts 2048,8192] [--label new] [--out PATH]

Prints the table last and writes JSON (default benchmarks/results/kernels_indexer-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable
from typing import Any

import torch
from bench_common import RESULTS, device_label, git_commit, int_list

import deepinfer_kernels as dk
from deepinfer_kernels.benchmarking import cuda_time_ms

ROWS_PER_PAGE = 128
FORMAT = dk.RowFormat.FP4_UE8M0


def preset_shape() -> dict[str, int]:
    from deepinfer_model.config import load_preset

    text = load_preset("v41-flash-scaled").text
    return {
        "heads": text.index_n_heads,
        "dim": text.index_head_dim,
        "topk": text.index_topk,
        "block_size": text.candidate_block_size,
        "blocks": text.candidate_topk_blocks,
    }


def build_case(shape: dict[str, int], tokens: int) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    pages = -(-tokens // ROWS_PER_PAGE)
    pool = dk.encode_rows(
        torch.randn((pages * ROWS_PER_PAGE, shape["dim"]), generator=generator, device="cuda"), FORMAT
    )
    q = torch.randn((tokens, shape["heads"], shape["dim"]), generator=generator, device="cuda")
    return {
        "q": dk.decode_rows(dk.encode_rows(q, FORMAT), FORMAT),
        "weights": torch.randn((tokens, shape["heads"]), generator=generator, device="cuda"),
        "key_pool": pool,
        "block_table": torch.randperm(pages, generator=generator, device="cuda").view(1, pages),
        "token_request": torch.zeros(tokens, dtype=torch.int64, device="cuda"),
        "num_rows": torch.arange(1, tokens + 1, device="cuda"),
        "max_rows": tokens,
    }


def select(case: dict[str, Any], topk: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return dk.indexer_select(
        case["q"], case["weights"], case["key_pool"], FORMAT, case["block_table"], ROWS_PER_PAGE,
        case["token_request"], case["num_rows"], case["max_rows"], topk, True, **kwargs,
    )  # fmt: skip


def timed(case: dict[str, Any], topk: int, **kwargs: Any) -> Callable[[], None]:
    def call() -> None:
        select(case, topk, **kwargs)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int_list, default=[2048, 8192])
    parser.add_argument("--label", default="new")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--compare", type=pathlib.Path, default=None, help="JSON of another version: adds its ms")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_indexer.py needs a CUDA device")
    shape = preset_shape()
    records = []
    for tokens in args.prompts:
        case = build_case(shape, tokens)
        blocks_kwargs = {"candidate_block_size": shape["block_size"], "num_candidate_blocks": shape["blocks"]}
        _, blocks = select(case, shape["topk"], **blocks_kwargs)
        assert blocks is not None
        calls: dict[str, dict[str, Any]] = {
            "source": blocks_kwargs,
            "plain": {},
            "restricted": {"candidates": blocks, "candidate_block_size": shape["block_size"]},
        }
        for name, kwargs in calls.items():
            selected = select(case, shape["topk"], **kwargs)[0]
            ms, _ = cuda_time_ms(timed(case, shape["topk"], **kwargs))
            checksum = int((selected.clamp(min=0) * torch.arange(1, shape["topk"] + 1, device="cuda")).sum())
            records.append({"prompt": tokens, "call": name, "ms": ms, "rows_checksum": checksum})
            print(f"{args.label} prompt {tokens} {name}: {ms:.3f} ms", flush=True)
    out = args.out or RESULTS / f"kernels_indexer-{device_label('cuda')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "label": args.label, "git_commit": git_commit(), "shape": shape}
    out.write_text(json.dumps({**meta, "records": records}, indent=1) + "\n")
    other = {}
    if args.compare:
        other = {(r["prompt"], r["call"]): r for r in json.loads(args.compare.read_text())["records"]}
    print(f"\n{'prompt':>7} {'call':<11} {args.label + ' ms':>10} {'other ms':>9} {'ratio':>6} {'same rows':>9}")
    for r in records:
        o = other.get((r["prompt"], r["call"]))
        versus = (
            f"{o['ms']:>9.3f} {r['ms'] / o['ms']:>6.2f} {o['rows_checksum'] == r['rows_checksum']!s:>9}" if o else ""
        )
        print(f"{r['prompt']:>7} {r['call']:<11} {r['ms']:>10.3f} {versus}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
