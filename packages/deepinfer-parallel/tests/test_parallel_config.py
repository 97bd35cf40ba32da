"""ParallelConfig / ExpertLayoutConfig / EplbConfig validation and single-process groups."""

from __future__ import annotations

import logging

import pytest

from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig, ParallelConfig
from deepinfer_parallel.groups import (
    ParallelGroups,
    context_parallel_rank_lists,
    data_parallel_rank_lists,
    expert_parallel_rank_lists,
)


def test_defaults_are_a_single_process():
    config = ParallelConfig()
    assert (config.world_size, config.num_replicas) == (1, 1)


def test_world_size_must_be_a_multiple_of_dp_times_cp():
    with pytest.raises(
        ValueError, match=r"world_size=6 is not a multiple of .* = 4 \* 1 = 4; allowed .* multiples of 4"
    ):
        ParallelConfig(world_size=6, data_parallel_size=4)


def test_ep_must_divide_dp_times_cp():
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide .* = 6; allowed .* \[1, 2, 3, 6\]"):
        ParallelConfig(world_size=6, data_parallel_size=3, context_parallel_size=2, expert_parallel_size=4)


def test_sizes_must_be_positive_ints():
    with pytest.raises(ValueError, match="context_parallel_size must be >= 1, got 0"):
        ParallelConfig(context_parallel_size=0)
    with pytest.raises(TypeError, match="data_parallel_size must be an int"):
        ParallelConfig(data_parallel_size=2.0)  # type: ignore[arg-type]


def test_physical_experts_must_divide_over_ep():
    with pytest.raises(ValueError, match=r"10 \+ 1 = 11 physical experts do not divide .* num_redundant_experts=2"):
        ExpertLayoutConfig(num_logical_experts=10, num_redundant_experts=1, expert_parallel_size=4)


def test_expert_layout_rounds_redundant_up_and_warns(caplog):
    config = ParallelConfig(world_size=8, data_parallel_size=8, expert_parallel_size=8)
    with caplog.at_level(logging.WARNING, logger="deepinfer_parallel.config"):
        layout = config.expert_layout(num_logical_experts=384, min_redundant_experts=3)
    assert (layout.num_redundant_experts, layout.num_physical_experts, layout.num_local_experts) == (8, 392, 49)
    assert "rounded up from 3 to 8" in caplog.text
    assert config.expert_layout(384).num_redundant_experts == 0


def test_eplb_window_must_fit_the_interval():
    with pytest.raises(ValueError, match=r"window_size=10 exceeds step_interval=4; .* \[1, 4\]"):
        EplbConfig(window_size=10, step_interval=4)
    assert not EplbConfig(window_size=10, step_interval=0).enabled
    assert EplbConfig(window_size=2, step_interval=3).first_rearrangement_step == 1


def test_rank_lists_for_replicated_grid():
    config = ParallelConfig(world_size=8, data_parallel_size=2, context_parallel_size=2, expert_parallel_size=4)
    assert context_parallel_rank_lists(config) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert data_parallel_rank_lists(config) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert expert_parallel_rank_lists(config) == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_single_process_groups_need_no_distributed_init():
    groups = ParallelGroups.build(ParallelConfig())
    assert (groups.rank, groups.dp_rank, groups.cp_rank, groups.ep_rank) == (0, 0, 0, 0)
    assert groups.expert_parallel.size == 1 and groups.expert_parallel.process_group is None


def test_multi_rank_groups_need_an_initialised_world():
    with pytest.raises(RuntimeError, match=r"needs an initialised torch\.distributed world"):
        ParallelGroups.build(ParallelConfig(world_size=2, data_parallel_size=2), rank=0)


def test_groups_reject_rank_outside_world():
    with pytest.raises(ValueError, match="rank=2 is outside the world of size 2"):
        ParallelGroups.build(ParallelConfig(world_size=2, data_parallel_size=2), rank=2)
