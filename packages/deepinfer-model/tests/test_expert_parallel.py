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
from _layered_model_support import prompt, run_chunks, tiny_config, tiny_model, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM, ExpertParallelMoE
from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement
from deepinfer_parallel.groups import ParallelGroups

TOLERANCE = {"FP32": 1e-5, "EXACT": 1e-2}


def _requests(index: int) -> tuple[torch.Tensor, list[int]]:
    """Request ``index``: its own prompt and length, one prefill chunk then two single-token steps (every rank runs
    the same number of steps, as the DP vote makes them)."""
    length = 9 + 3 * index
    return prompt(length, seed=11 + index), [0, length - 2, length - 1, length]


def _expert_parallel(groups: ParallelGroups, num_redundant: int, placement_seed: int | None) -> ExpertParallelMoE:
    text = tiny_config().text
    if placement_seed is None:
        return ExpertParallelMoE.create(groups, text.n_routed_experts, text.num_hidden_layers, num_redundant)
    layout = ExpertLayoutConfig(text.n_routed_experts, num_redundant, groups.config.expert_parallel_size)
    # Same shuffled placement on every rank (seeded), different per layer: replicas land on arbitrary ranks.
    generator = torch.Generator().manual_seed(placement_seed)
    initial = ExpertPlacement.initial(layout, text.num_hidden_layers).physical_to_logical
    shuffled = torch.stack([row[torch.randperm(row.numel(), generator=generator)] for row in initial])
    placement = ExpertPlacement.from_physical_to_logical(shuffled, layout)
    dispatcher = AllToAllDispatcher(groups.expert_parallel, layout.num_local_experts)
    return ExpertParallelMoE(groups.expert_parallel, placement, dispatcher)


def _rank(
    rank: int, world_size: int, mode_name: str, num_redundant: int, placement_seed: int | None, own_requests: bool
) -> tuple[torch.Tensor, list[tuple[int, ...]], list[tuple[int, ...]]]:
    """One rank: build the sharded model, run its requests; returns (logits, stored experts, placement's experts)."""
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    ep = _expert_parallel(groups, num_redundant, placement_seed)
    model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode[mode_name], tiny_vocab(), expert_parallel=ep)
    model.load_weights(tiny_weights().items())
    stored = []
    for block in model.layers:
        assert isinstance(block.ffn, MoE)
        stored.append(block.ffn.experts.w13.local_experts)
        assert block.ffn.experts.w13.weight.shape[0] == ep.placement.layout.num_local_experts
    ids, bounds = _requests(rank if own_requests else 0)
    expected = [ep.local_experts(layer) for layer in range(len(model.layers))]
    return run_chunks(model, ids, bounds), stored, expected


def _check(world_size: int, mode_name: str, num_redundant: int, placement_seed: int | None, own: bool) -> None:
    results = run_world(world_size, _rank, mode_name, num_redundant, placement_seed, own)
    reference_model = tiny_model(ComputeMode[mode_name])
    worst = 0.0
    for rank, (logits, stored, expected) in enumerate(results):
        assert stored == expected, f"rank {rank} stores experts {stored}, placement says {expected}"
        ids, bounds = _requests(rank if own else 0)
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


def _moe_inputs(rank: int) -> torch.Tensor:
    """[n, H] fp32 MoE inputs of a rank; ranks 1 and 3 are idle (zero tokens), as attention-DP ranks can be."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn([6, 0, 4, 0][rank], tiny_config().text.hidden_size, generator=generator)


def _idle_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    model = DeepseekV41ForCausalLM(
        tiny_config(), ComputeMode.FP32, tiny_vocab(), expert_parallel=_expert_parallel(groups, 0, None)
    )
    model.load_weights(tiny_weights().items())
    with torch.no_grad():
        return [block.ffn(_moe_inputs(rank)) for block in model.layers]


@pytest.mark.parametrize("world_size", [4])
def test_idle_ranks_take_part_in_the_moe(world_size: int) -> None:
    # Every MoE layer on every rank, some ranks with zero tokens: the busy ranks still get their experts' results.
    results = run_world(world_size, _idle_rank)
    reference = tiny_model(ComputeMode.FP32)
    with torch.no_grad():
        for rank, outputs in enumerate(results):
            for layer, (out, block) in enumerate(zip(outputs, reference.layers, strict=True)):
                expected = block.ffn(_moe_inputs(rank))
                assert out.shape == expected.shape
                if expected.numel():
                    error = float((out - expected).abs().max() / expected.abs().max())
                    assert error <= TOLERANCE["FP32"], f"rank {rank} layer {layer}: relative error {error:.3g}"


def _rebalance_rank(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    ep = _expert_parallel(groups, 4, None)
    model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.EXACT, tiny_vocab(), expert_parallel=ep)
    model.load_weights(tiny_weights().items())
    ids, bounds = _requests(rank)
    before = run_chunks(model, ids, bounds)
    # A new placement (as EPLB would choose): the same seeded per-layer shuffle on every rank.
    generator = torch.Generator().manual_seed(21)
    current = ep.placement.physical_to_logical
    new = torch.stack([row[torch.randperm(row.numel(), generator=generator)] for row in current])
    moes = [block.ffn for block in model.layers]
    ep.rebalance(moes, new)
    weights = tiny_weights()
    for layer, moe in enumerate(moes):
        stack = moe.experts.w2
        assert stack.local_experts == ep.local_experts(layer)
        for slot, expert in enumerate(stack.local_experts):
            stored = weights[f"layers.{layer}.ffn.experts.{expert}.w2.weight"]
            assert torch.equal(stack.weight[slot], stored), f"layer {layer} slot {slot} does not hold expert {expert}"
    assert torch.equal(ep.placement.physical_to_logical, new)
    return before, run_chunks(model, ids, bounds)


def test_rebalancing_moves_expert_weights_and_keeps_the_logits() -> None:
    # EPLB on the real model: weights move between 2 ranks (8 logical + 4 replicas), the forward is unchanged.
    results = run_world(2, _rebalance_rank)
    reference = tiny_model(ComputeMode.EXACT)
    for rank, (before, after) in enumerate(results):
        ids, bounds = _requests(rank)
        expected = run_chunks(reference, ids, bounds)
        for logits in (before, after):
            error = float((logits - expected).abs().max() / expected.abs().max())
            assert error <= TOLERANCE["EXACT"], f"rank {rank}: relative error {error:.3g}"


def _sizes_rank(rank: int, world_size: int) -> str:
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    with pytest.raises(ValueError, match="do not divide") as info:
        ExpertParallelMoE.create(groups, tiny_config().text.n_routed_experts, tiny_config().text.num_hidden_layers)
    return str(info.value)


def test_experts_that_do_not_divide_over_the_ranks_raise() -> None:
    # 8 routed experts over 3 EP ranks: the error names the counts and a redundant count that would work.
    messages = run_world(3, _sizes_rank)
    assert all("num_redundant_experts=1" in message for message in messages), messages


def test_mismatched_sizes_raise() -> None:
    text = tiny_config().text
    groups = ParallelGroups.build(ParallelConfig(), 0)
    wrong_experts = ExpertParallelMoE.create(groups, text.n_routed_experts - 2, text.num_hidden_layers)
    with pytest.raises(ValueError, match="routed experts"):
        DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab(), expert_parallel=wrong_experts)
    wrong_layers = ExpertParallelMoE.create(groups, text.n_routed_experts, text.num_hidden_layers + 1)
    with pytest.raises(ValueError, match="backbone layers"):
        DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab(), expert_parallel=wrong_layers)
    layout = ExpertLayoutConfig(text.n_routed_experts, 0, 2)
    placement = ExpertPlacement.initial(layout, text.num_hidden_layers)
    with pytest.raises(ValueError, match="expert_parallel_size=2"):
        ExpertParallelMoE(groups.expert_parallel, placement, AllToAllDispatcher(groups.expert_parallel, 4))
    single = ExpertPlacement.initial(ExpertLayoutConfig(text.n_routed_experts, 0, 1), text.num_hidden_layers)
    with pytest.raises(ValueError, match="local expert slots"):
        ExpertParallelMoE(groups.expert_parallel, single, AllToAllDispatcher(groups.expert_parallel, 4))
