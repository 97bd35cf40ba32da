"""Expert parallelism of the layered model at its edges: idle (zero-token) ranks, an EPLB rearrangement of the
model's expert weights, sharded DSpark blocks, and sizes that do not fit (gloo worlds of CPU ranks; tolerances as in
``test_expert_parallel``).
"""

from __future__ import annotations

import pytest
import torch
from _ep_world import run_world
from _expert_parallel_support import TOLERANCE, expert_parallel, requests
from _layered_model_support import prompt, run_chunks, tiny_config, tiny_model, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM, ExpertParallelMoE
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement
from deepinfer_parallel.groups import ParallelGroups


def _moe_inputs(rank: int) -> torch.Tensor:
    """[n, H] fp32 MoE inputs of a rank; ranks 1 and 3 are idle (zero tokens), as attention-DP ranks can be."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn([6, 0, 4, 0][rank], tiny_config().text.hidden_size, generator=generator)


def _idle_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    model = DeepseekV41ForCausalLM(
        tiny_config(), ComputeMode.FP32, tiny_vocab(), expert_parallel=expert_parallel(groups, 0, None)
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
    ep = expert_parallel(groups, 4, None)
    model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.EXACT, tiny_vocab(), expert_parallel=ep)
    model.load_weights(tiny_weights().items())
    ids, bounds = requests(rank)
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
        ids, bounds = requests(rank)
        expected = run_chunks(reference, ids, bounds)
        for logits in (before, after):
            error = float((logits - expected).abs().max() / expected.abs().max())
            assert error <= TOLERANCE["EXACT"], f"rank {rank}: relative error {error:.3g}"


def _draft_hidden(model: DeepseekV41ForCausalLM, index: int) -> torch.Tensor:
    """Prefill request ``index`` (its own prompt), then one DSpark draft block after it: [block, H]."""
    text = tiny_config().text
    ids = prompt(20 + 4 * index, seed=40 + index)
    state = model.allocate_state(block_size=8, num_blocks=8, num_state_slots=1)
    table = torch.arange(8, dtype=torch.int32)[None, :]
    block = [17] + [text.dspark_noise_token_id] * (text.dspark_block_size - 1)
    with torch.no_grad():
        model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state)
        return model.draft_forward(ForwardBatch.for_requests([block], [ids.numel()], table, [0]), state)


def _draft_rank(rank: int, world_size: int) -> torch.Tensor:
    text = tiny_config().text
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    draft_ep = ExpertParallelMoE.create(groups, text.dspark_n_routed_experts, text.num_nextn_predict_layers)
    model = DeepseekV41ForCausalLM(
        tiny_config(),
        ComputeMode.FP32,
        tiny_vocab(),
        expert_parallel=expert_parallel(groups, 0, None),
        draft_expert_parallel=draft_ep,
    )
    model.load_weights(tiny_weights().items())
    for block in model.mtp:
        assert block.ffn.experts.w13.weight.shape[0] == text.dspark_n_routed_experts // world_size
    return _draft_hidden(model, rank)


def test_dspark_blocks_sharded_too() -> None:
    # Backbone and DSpark experts both sharded over 2 ranks, each rank its own request: the draft hidden states match.
    results = run_world(2, _draft_rank)
    reference = tiny_model(ComputeMode.FP32)
    for rank, hidden in enumerate(results):
        expected = _draft_hidden(reference, rank)
        error = float((hidden - expected).abs().max() / expected.abs().max())
        assert error <= TOLERANCE["FP32"], f"rank {rank}: relative error {error:.3g}"


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
    with pytest.raises(ValueError, match="DSpark blocks"):
        DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab(), draft_expert_parallel=wrong_layers)
    layout = ExpertLayoutConfig(text.n_routed_experts, 0, 2)
    placement = ExpertPlacement.initial(layout, text.num_hidden_layers)
    with pytest.raises(ValueError, match="expert_parallel_size=2"):
        ExpertParallelMoE(groups.expert_parallel, placement, AllToAllDispatcher(groups.expert_parallel, 4))
    single = ExpertPlacement.initial(ExpertLayoutConfig(text.n_routed_experts, 0, 1), text.num_hidden_layers)
    with pytest.raises(ValueError, match="local expert slots"):
        ExpertParallelMoE(groups.expert_parallel, single, AllToAllDispatcher(groups.expert_parallel, 4))
