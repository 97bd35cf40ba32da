"""Shared pieces of the expert-parallel model tests: tolerances, each rank's request, the placements used."""

from __future__ import annotations

import torch
from _layered_model_support import prompt, tiny_config

from deepinfer_model.deepseek_v41 import ExpertParallelMoE
from deepinfer_parallel.config import ExpertLayoutConfig
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement
from deepinfer_parallel.groups import ParallelGroups

TOLERANCE = {"FP32": 1e-5, "EXACT": 1e-2}


def requests(index: int) -> tuple[torch.Tensor, list[int]]:
    """Request ``index``: its own prompt and length, one prefill chunk then two single-token steps (every rank runs
    the same number of steps, as the DP vote makes them)."""
    length = 9 + 3 * index
    return prompt(length, seed=11 + index), [0, length - 2, length - 1, length]


def expert_parallel(groups: ParallelGroups, num_redundant: int, placement_seed: int | None) -> ExpertParallelMoE:
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
