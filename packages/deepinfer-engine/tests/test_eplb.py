"""EPLB settings from the environment, the expert layout with replica slots, and the imbalance metric (no ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm

from deepinfer_engine.envs import read_env
from deepinfer_engine.eplb import EplbSettings, engine_expert_layout, rank_imbalance
from deepinfer_parallel.config import EplbConfig, ParallelConfig

_WINDOW = "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE"
_INTERVAL = "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL"
_AFTER_PREFILL = "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE"


def test_off_by_default() -> None:
    settings = EplbSettings.from_env(read_env({}))
    assert settings == EplbSettings(None, 0, False)


def test_settings_from_the_environment() -> None:
    env = read_env(
        {
            _WINDOW: "3",
            _INTERVAL: "8",
            _AFTER_PREFILL: "1",
            "DEEPINFER_REARRANGE_P2P_GROUPS": "2",
            "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "5",
        }
    )
    settings = EplbSettings.from_env(env)
    assert settings == EplbSettings(EplbConfig(window_size=3, step_interval=8, num_p2p_groups=2), 5, True)
    assert settings.schedule is not None and settings.schedule.first_rearrangement_step == 2


def test_window_may_be_anything_while_rearrangement_is_off() -> None:
    assert EplbSettings.from_env(read_env({_WINDOW: "0"})).schedule is None


@pytest.mark.parametrize(
    ("environ", "pattern"),
    [
        ({_WINDOW: "5", _INTERVAL: "4"}, rf"{_WINDOW}=5 must be in \[1, {_INTERVAL}=4\]"),
        ({_WINDOW: "0", _INTERVAL: "4"}, rf"{_WINDOW}=0 must be in \[1, {_INTERVAL}=4\]"),
        ({_AFTER_PREFILL: "1"}, rf"{_AFTER_PREFILL} is set but {_INTERVAL}=0"),
        ({_INTERVAL: "-1"}, rf"{_INTERVAL}='-1' is invalid: must be >= 0"),
        ({"DEEPINFER_REARRANGE_P2P_GROUPS": "0"}, "DEEPINFER_REARRANGE_P2P_GROUPS='0' is invalid"),
    ],
)
def test_invalid_combinations_name_the_variables(environ: dict[str, str], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        EplbSettings.from_env(read_env(environ))


def test_llm_refuses_an_invalid_combination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_WINDOW, "9")
    monkeypatch.setenv(_INTERVAL, "4")
    with pytest.raises(ValueError, match=rf"{_WINDOW}=9 must be in \[1, {_INTERVAL}=4\]"):
        make_llm(tmp_path, data_parallel_size=2, expert_parallel_size=2)


def test_settings_validate_themselves() -> None:
    with pytest.raises(ValueError, match="min_redundant_experts must be >= 0"):
        EplbSettings(None, -1)
    with pytest.raises(ValueError, match="rearrange_after_prefill needs rearrangement on"):
        EplbSettings(None, 0, True)


def test_expert_layout_adds_replicas_only_when_asked() -> None:
    config = ParallelConfig(world_size=3, data_parallel_size=3, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the model's n_routed_experts=8"):
        engine_expert_layout(config, 8, EplbSettings())
    # At least 2 replicas asked for; rounded up to 4 so that 12 physical experts divide over 3 ranks.
    layout = engine_expert_layout(config, 8, EplbSettings(None, 2))
    assert (layout.num_redundant_experts, layout.num_local_experts) == (4, 4)
    assert engine_expert_layout(config, 9, EplbSettings()).num_redundant_experts == 0


def test_rank_imbalance() -> None:
    # One layer, 4 logical experts over 2 ranks; step loads [6, 2, 1, 1] and [2, 2, 2, 2].
    load = torch.tensor([[[6, 2, 1, 1]], [[2, 2, 2, 2]]])
    initial = torch.tensor([[0, 1, 2, 3]])  # rank loads (8, 2) then (4, 4): (8 + 4) / (5 + 4)
    assert rank_imbalance(load, initial, 2) == pytest.approx(12 / 9)
    balanced = torch.tensor([[0, 2, 1, 3]])  # (7, 3) then (4, 4)
    assert rank_imbalance(load, balanced, 2) == pytest.approx(11 / 9)
    # Replicas of experts 0 and 1 (6 physical slots) split their load over both copies: (5, 5) then (4, 4).
    replicated = torch.tensor([[0, 1, 2, 0, 3, 1]])
    assert rank_imbalance(load, replicated, 2) == pytest.approx(1.0)
    assert rank_imbalance(torch.zeros(1, 1, 4), initial, 2) == 1.0
