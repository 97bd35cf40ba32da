"""EPLB load recording of ``ExpertParallelMoE`` (``record_load``): every routing choice of every rank's tokens is
counted once, on the rank and slot that computed it, and folds into the same logical-expert counts whatever the
placement (replicas included). Gloo worlds of CPU ranks."""

from __future__ import annotations

import pytest
import torch
from _ep_world import run_world
from _expert_parallel_support import expert_parallel, requests
from _layered_model_support import run_chunks, tiny_config, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.eplb.stats import ExpertLoadWindow
from deepinfer_parallel.groups import ParallelGroups


def _load_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    """Logical load [1, layers, experts] summed over the ranks, for the start-up placement and a shuffled one with
    4 replicas; the second model's recording is switched off again and must then count nothing."""
    groups = ParallelGroups.build(ParallelConfig(world_size, world_size, 1, world_size), rank)
    loads = []
    for num_redundant, seed in ((0, None), (4, 7)):
        ep = expert_parallel(groups, num_redundant, seed)
        model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.EXACT, tiny_vocab(), expert_parallel=ep)
        model.load_weights(tiny_weights().items())
        window = ExpertLoadWindow(ep.placement.layout, ep.placement.num_layers, EplbConfig(window_size=2))
        ep.record_load(window)
        ids, bounds = requests(rank)
        run_chunks(model, ids, bounds)
        window.end_step(ep.placement.physical_to_logical)
        ep.record_load(None)
        run_chunks(model, ids, bounds)
        window.end_step(ep.placement.physical_to_logical)
        loads.append(window.sum_over_ranks(groups.expert_parallel))
    return loads


def test_recorded_load_counts_every_routing_choice_once() -> None:
    results = run_world(2, _load_rank)
    text = tiny_config().text
    num_tokens = sum(requests(rank)[1][-1] for rank in range(2))
    assert torch.equal(results[0][0], results[1][0]), "the summed window differs between the ranks"
    plain, replicated = results[0]
    assert plain.shape == (2, text.num_hidden_layers, text.n_routed_experts)
    # Step 0 recorded: k choices per token of both ranks in every layer; step 1 ran with recording off.
    assert plain[0].sum(dim=1).tolist() == [num_tokens * text.num_experts_per_tok] * text.num_hidden_layers
    assert int(plain[1].sum()) == 0
    # Routing does not depend on where the experts live: the same logical counts with replicas on shuffled slots.
    assert torch.equal(plain, replicated)


def test_window_of_another_layout_is_refused() -> None:
    groups = ParallelGroups.build(ParallelConfig(1, 1, 1, 1), 0)
    ep = expert_parallel(groups, 0, None)
    other = ExpertLayoutConfig(tiny_config().text.n_routed_experts, 2, 1)
    with pytest.raises(ValueError, match="load window laid out for"):
        ep.record_load(ExpertLoadWindow(other, ep.placement.num_layers, EplbConfig(window_size=1)))
