"""Balanced context-parallel prefill of the layered model on real gloo worlds of 2 and 4 CPU ranks against the
single-process forward of the same steps.

Three requests run two prefill steps (lengths 37 / 6 / 2, then 43 more tokens of request 0 continuing from its
cached history past the 64-token window, one decode token of request 1 and 11 more of request 2: chunks that do not
divide by 2·cp and chunks shorter than 2·cp) and then three greedy decode steps. The tiny preset has C2 and C1
compressed layers, YOCO consumers, Engram layers and a DSpark block, so every cache-writing path is split. Every CP
rank must return the logits of one process for every token, pick the same greedy tokens and hold the cache contents
of one process after the prefill steps.

Tolerances (relative to the largest reference logit): FP32 mode 1e-5 (measured: at most 1.1e-6; a rank's GEMMs see
other row batches than one process's); exact mode 1e-2, a few BF16 ulps in case a GEMM rounds differently in another
row batch (measured: bitwise equal on CPU).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from _context_parallel_support import PREFILL, Schedule, run_schedule
from _ep_world import run_world
from _layered_model_support import tiny_config, tiny_model, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM, ExpertParallelMoE
from deepinfer_model.deepseek_v41.context_parallel import context_parallel_split, splits_step
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.context_parallel import balanced_split
from deepinfer_parallel.groups import ParallelGroups

TOLERANCE = {"FP32": 1e-5, "EXACT": 1e-2}


def _rank(rank: int, world_size: int, mode_name: str, dp: int, ep: int) -> Schedule:
    config = ParallelConfig(
        world_size=world_size, data_parallel_size=dp, context_parallel_size=world_size // dp, expert_parallel_size=ep
    )
    groups = ParallelGroups.build(config, rank)
    text = tiny_config().text
    expert_parallel = None
    if ep > 1:
        expert_parallel = ExpertParallelMoE.create(groups, text.n_routed_experts, text.num_hidden_layers)
    model = DeepseekV41ForCausalLM(
        tiny_config(),
        ComputeMode[mode_name],
        tiny_vocab(),
        expert_parallel=expert_parallel,
        context_parallel=groups.context_parallel,
    )
    model.load_weights(tiny_weights().items())
    return run_schedule(model, seed=5 + groups.dp_rank)


@cache
def _reference(mode_name: str, seed: int) -> Schedule:
    return run_schedule(tiny_model(ComputeMode[mode_name]), seed)


def _check(world_size: int, mode_name: str, dp: int = 1, ep: int = 1) -> None:
    cp = world_size // dp
    results = run_world(world_size, _rank, mode_name, dp, ep)
    references = [_reference(mode_name, seed=5 + d) for d in range(dp)]
    expected_rows = [
        context_parallel_split([end - start for _, start, end in step], cp).num_local_tokens for step in PREFILL
    ]
    for rank, (logits, greedy, rows, contents) in enumerate(results):
        ref_logits, ref_greedy, ref_rows, ref_contents = references[rank // cp]
        # Every rank holds the full cache of one process: SWA and DSpark rings, compressed and index-K rows, C2 state.
        assert contents.keys() == ref_contents.keys()
        for key, want in ref_contents.items():
            error = float((contents[key] - want).abs().max() / want.abs().max().clamp(min=1e-30))
            assert error <= TOLERANCE[mode_name], f"rank {rank}: cache {key} relative error {error:.3g}"
        assert rows == expected_rows + ref_rows[len(PREFILL) :], f"rank {rank}: attention rows per step {rows}"
        assert greedy == ref_greedy, f"rank {rank}: greedy tokens {greedy} != one process {ref_greedy}"
        for step, (got, want) in enumerate(zip(logits, ref_logits, strict=True)):
            assert got.shape == want.shape
            error = float((got - want).abs().max() / want.abs().max())
            assert error <= TOLERANCE[mode_name], f"rank {rank} step {step}: relative error {error:.3g}"


@pytest.mark.parametrize(("world_size", "mode_name"), [(2, "FP32"), (2, "EXACT"), (4, "EXACT")])
def test_context_parallel_prefill_matches_single_process(world_size: int, mode_name: str) -> None:
    _check(world_size, mode_name)


def test_data_parallel_times_context_parallel_with_expert_parallel() -> None:
    # Ranks 0-1 and 2-3 are two CP groups (DP ranks 0 and 1) with their own requests; experts sharded over all 4.
    _check(4, "EXACT", dp=2, ep=4)


def test_which_steps_split() -> None:
    table = torch.zeros((2, 1), dtype=torch.int32)
    prefill = ForwardBatch.for_requests([[1, 2, 3, 4], [5]], [0, 9], table, [0, 1])
    decode = ForwardBatch.for_requests([[1], [5]], [4, 9], table, [0, 1])
    short = ForwardBatch.for_requests([[1, 2, 3], [5]], [0, 9], table, [0, 1])
    assert splits_step(prefill, 2) and not splits_step(decode, 2) and not splits_step(short, 2)
    assert not splits_step(prefill, 1)


@pytest.mark.parametrize(
    ("seq_lens", "cp"), [([37, 6, 2], 2), ([43, 1, 11], 2), ([37, 6, 2], 4), ([1, 9, 1, 1, 30], 4)]
)
def test_split_keeps_short_chunks_whole(seq_lens: list[int], cp: int) -> None:
    split = context_parallel_split(seq_lens, cp)
    mirrored = balanced_split([n if n >= 2 * cp else 0 for n in seq_lens], cp)
    starts = [sum(seq_lens[:r]) for r in range(len(seq_lens))]
    valid_index = split.token_index[split.valid]
    assert sorted(valid_index.tolist()) == list(range(sum(seq_lens))), "every token exactly once"
    request, position = split.request_index[split.valid], split.positions[split.valid]
    assert valid_index.tolist() == [starts[r] + p for r, p in zip(request.tolist(), position.tolist(), strict=True)]
    assert split.num_local_tokens == int(split.valid.sum(dim=1).max())
    for rank in range(cp):
        mine = set(zip(split.request_index[rank].tolist(), split.positions[rank].tolist(), strict=True))
        mirror = zip(mirrored.request_index[rank].tolist(), mirrored.positions[rank].tolist(), strict=True)
        assert {pair for pair in mirror if pair[0] >= 0} <= mine, "long chunks keep their mirrored blocks"
    for r, length in enumerate(seq_lens):
        if length < 2 * cp:
            holders = {rank for rank in range(cp) if (split.request_index[rank] == r).any()}
            assert len(holders) == 1, f"short request {r} is spread over ranks {holders}"
