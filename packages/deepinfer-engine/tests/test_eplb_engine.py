"""EPLB in a dp = ep = 2 CPU engine (gloo): experts are rearranged on schedule, moved between the ranks, and the greedy
tokens stay those of the same engine without EPLB and of one process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts

from deepinfer_engine.eplb import EplbStats
from deepinfer_kernels.testing_npu_double import NpuDouble
from deepinfer_sampling import SamplingParams

_PROMPTS = random_prompts(6, 2, 30, seed=5)
# A skewed workload: every prompt repeats a few tokens, so the router keeps choosing the same experts.
_SKEWED = [[7, 7, 7, 9] * 6 for _ in range(4)] + [[11] * 12, [7, 9] * 5]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _rank_processes_without_npu_double() -> Iterator[None]:
    # As in test_parallel_engine: spawned ranks cannot inherit the torch_npu test double; they compute as "cpu".
    with pytest.MonkeyPatch.context() as patch:
        if isinstance(sys.modules.get("torch_npu"), NpuDouble):
            patch.setenv("DEEPINFER_ACCELERATOR", "cpu")
        yield


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eplb")


def _tokens(root: Path, prompts: list[list[int]], **kwargs: object) -> list[tuple[int, ...]]:
    llm = make_llm(root, **kwargs)
    try:
        return [tuple(o.token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=_GREEDY)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def expected(root: Path) -> dict[str, list[tuple[int, ...]]]:
    """Greedy tokens of one process and of dp = ep = 2 without EPLB, for both prompt sets."""
    tokens = {}
    for name, prompts in (("random", _PROMPTS), ("skewed", _SKEWED)):
        tokens[name] = _tokens(root, prompts)
        tokens[f"{name}-parallel"] = _tokens(root, prompts, data_parallel_size=2, expert_parallel_size=2)
    return tokens


def _run_with_eplb(
    root: Path, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], environ: dict[str, str]
) -> tuple[list[tuple[int, ...]], list[EplbStats]]:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    llm = make_llm(root, data_parallel_size=2, expert_parallel_size=2)
    try:
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=_GREEDY)
        stats = llm.eplb_stats()
    finally:
        llm.close()
    return [tuple(o.token_ids) for o in outputs], stats


def _check_stats(stats: list[EplbStats], num_physical: int) -> None:
    assert len(stats) == 2, "one entry per rank"
    # Both EP ranks decided the same rearrangements at the same steps and hold the same placement.
    assert stats[0] == stats[1]
    first = stats[0]
    assert first.num_rearrangements >= 1
    assert any(r.num_moved_slots > 0 for r in first.rearrangements), first.rearrangements
    assert all(len(layer) == num_physical for layer in first.physical_to_logical)
    initial = tuple(i % 8 for i in range(num_physical))
    assert any(layer != initial for layer in first.physical_to_logical)


def test_rearrangement_keeps_the_greedy_tokens(
    root: Path, monkeypatch: pytest.MonkeyPatch, expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # Interval 2, window 1: the first rearrangement after 1 counted (decode) step, then every 2.
    environ = {"DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "2", "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "1"}
    tokens, stats = _run_with_eplb(root, monkeypatch, _PROMPTS, environ)
    assert tokens == expected["random-parallel"]
    assert tokens == expected["random"]
    _check_stats(stats, num_physical=8)
    # 7 decode steps are counted (the first step holds the prefills): rearrangements after steps 1, 3, 5 and 7.
    assert stats[0].num_counted_steps == 7
    assert [r.counted_step for r in stats[0].rearrangements] == [1, 3, 5, 7]


def test_redundant_experts_on_a_skewed_workload(
    root: Path, monkeypatch: pytest.MonkeyPatch, expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # 8 logical + 2 replica slots over 2 ranks; interval 4, window 2: rearrangements after 1 and 5 counted steps.
    environ = {
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "4",
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "2",
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "2",
        "DEEPINFER_REARRANGE_P2P_GROUPS": "2",
    }
    tokens, stats = _run_with_eplb(root, monkeypatch, _SKEWED, environ)
    assert tokens == expected["skewed-parallel"]
    assert tokens == expected["skewed"]
    _check_stats(stats, num_physical=10)
    assert [r.counted_step for r in stats[0].rearrangements] == [1, 5]
    for record in stats[0].rearrangements:
        # Figures of the window the placement was computed from; the new placement never balances worse.
        assert record.imbalance_after <= record.imbalance_before + 1e-9, record
    assert stats[0].rearrangements[0].imbalance_after < stats[0].rearrangements[0].imbalance_before


def test_rearrangement_after_prefill(
    root: Path, monkeypatch: pytest.MonkeyPatch, expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # Prefill steps count; the first decode step after one rearranges whatever the schedule (interval 100).
    environ = {
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "100",
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "4",
        "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE": "1",
    }
    tokens, stats = _run_with_eplb(root, monkeypatch, _SKEWED, environ)
    assert tokens == expected["skewed"]
    assert stats[0] == stats[1]
    assert stats[0].num_counted_steps == 8  # the prefill step and 7 decode steps
    assert [r.counted_step for r in stats[0].rearrangements] == [2]
