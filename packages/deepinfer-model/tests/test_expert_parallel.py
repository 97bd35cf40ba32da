"""The layered model with its routed experts sharded over real gloo worlds of 2 and 4 CPU ranks (expert parallelism,
with and without attention data parallelism) against the single-process forward of the same requests.

Every rank stores only its own experts (loaded from the full checkpoint, the others skipped) and reaches the others
through ``ExpertParallelMoE``'s all-to-all dispatch. The per-choice combine keeps the single-process FP32 summation
order, so the ranks' logits differ from one process only where an expert GEMM sees a different row batch.

Tolerances (relative to the largest reference logit): FP32 mode 1e-5 (measured: at most 9.4e-7; CPU FP32 GEMMs are
not row-batch invariant, and an expert sees other ranks' rows); exact mode 1e-2, a few BF16 ulps in case a GEMM
rounds differently in another batch (measured: bitwise equal on CPU).
"""

from __future__ import annotations

import pytest
import torch
from _ep_world import run_world
from _expert_parallel_support import TOLERANCE, expert_parallel, requests
from _layered_model_support import run_chunks, tiny_config, tiny_model, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.groups import ParallelGroups


def _rank(
    rank: int, world_size: int, mode_name: str, num_redundant: int, placement_seed: int | None, own_requests: bool
) -> tuple[torch.Tensor, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """One rank: build the sharded model, run its requests; returns (logits, stored experts, placement's experts)."""
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    ep = expert_parallel(groups, num_redundant, placement_seed)
    model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode[mode_name], tiny_vocab(), expert_parallel=ep)
    model.load_weights(tiny_weights().items())
    stored = []
    for block in model.layers:
        assert isinstance(block.ffn, MoE)
        stored.append(block.ffn.experts.w13.local_experts)
        assert block.ffn.experts.w13.weight.shape[0] == ep.placement.layout.num_local_experts
    ids, bounds = requests(rank if own_requests else 0)
    expected = [ep.local_experts(layer) for layer in range(len(model.layers))]
    return run_chunks(model, ids, bounds), stored, expected


def _check(world_size: int, mode_name: str, num_redundant: int, placement_seed: int | None, own: bool) -> None:
    results = run_world(world_size, _rank, mode_name, num_redundant, placement_seed, own)
    reference_model = tiny_model(ComputeMode[mode_name])
    worst = 0.0
    for rank, (logits, stored, expected) in enumerate(results):
        assert stored == expected, f"rank {rank} stores experts {stored}, placement says {expected}"
        ids, bounds = requests(rank if own else 0)
        reference = run_chunks(reference_model, ids, bounds)
        assert logits.shape == reference.shape
        error = float((logits - reference).abs().max() / reference.abs().max())
        worst = max(worst, error)
        assert error <= TOLERANCE[mode_name], f"rank {rank}: relative error {error:.3g} > {TOLERANCE[mode_name]}"
    held = {e for _, stored, _ in results for layer in stored[:1] for e in layer}
    assert held == set(range(tiny_config().text.n_routed_experts)), f"experts held over all ranks: {sorted(held)}"


# Each (world size, mode) pair appears somewhere below; the full cross product would double the file's run time.
@pytest.mark.parametrize(("world_size", "mode_name"), [(2, "FP32"), (4, "EXACT")])
def test_expert_parallel_same_batch_matches_single_process(world_size: int, mode_name: str) -> None:
    _check(world_size, mode_name, num_redundant=0, placement_seed=None, own=False)


@pytest.mark.parametrize(("world_size", "mode_name"), [(2, "EXACT"), (4, "FP32"), (4, "EXACT")])
def test_attention_data_parallel_with_expert_parallel(world_size: int, mode_name: str) -> None:
    # Each rank has its own request (different prompt and length); tokens meet only in the MoE dispatch.
    _check(world_size, mode_name, num_redundant=0, placement_seed=None, own=True)


@pytest.mark.parametrize(("world_size", "mode_name"), [(2, "FP32"), (4, "EXACT")])
def test_redundant_experts_in_a_shuffled_placement(world_size: int, mode_name: str) -> None:
    # 8 logical + 4 replicas, shuffled per layer: which replica a choice reaches must not change the result.
    _check(world_size, mode_name, num_redundant=4, placement_seed=7, own=True)
