"""EPLB in a dp = ep = 2 CPU engine (gloo): experts are rearranged on schedule, moved between the ranks, and the greedy
tokens stay those of the same engine without EPLB and of one process. The replica case runs by default (~25 s); the
skewed-workload and after-prefill cases are marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts

from deepinfer_engine.eplb import EplbStats
from deepinfer_sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("rank_processes_without_npu_double")

# Five prompts over two DP ranks holding at most two requests each: rank 0 prefills its third prompt while rank 1
# decodes or pads, so the ranks' steps differ in kind and only the vote keeps their step counts equal.
_PROMPTS = random_prompts(5, 2, 30, seed=5)
_FEW_SEQS = {"max_num_seqs": 2}
# A skewed workload: every prompt repeats a few tokens, so the router keeps choosing the same experts.
_SKEWED = [[7, 7, 7, 9] * 6 for _ in range(4)] + [[11] * 12, [7, 9] * 5]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


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
def random_expected(root: Path) -> dict[str, list[tuple[int, ...]]]:
    """Greedy tokens of `_PROMPTS` in one process and at dp = ep = 2 without EPLB."""
    return {
        "one process": _tokens(root, _PROMPTS),
        "parallel": _tokens(root, _PROMPTS, data_parallel_size=2, expert_parallel_size=2, **_FEW_SEQS),
    }


@pytest.fixture(scope="module")
def skewed_expected(root: Path) -> dict[str, list[tuple[int, ...]]]:
    """Greedy tokens of `_SKEWED` in one process and at dp = ep = 2 without EPLB."""
    return {
        "one process": _tokens(root, _SKEWED),
        "parallel": _tokens(root, _SKEWED, data_parallel_size=2, expert_parallel_size=2),
    }


def _run_with_eplb(
    root: Path, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]], environ: dict[str, str], **kwargs: object
) -> tuple[list[tuple[int, ...]], list[EplbStats]]:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    llm = make_llm(root, data_parallel_size=2, expert_parallel_size=2, **kwargs)
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


def test_rearrangement_with_redundant_experts_keeps_the_greedy_tokens(
    root: Path, monkeypatch: pytest.MonkeyPatch, random_expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # 8 logical + 2 replica slots over 2 ranks; interval 2, window 1: rearrangements after 1, 3, 5, ... counted steps.
    environ = {
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "2",
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "1",
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "2",
    }
    tokens, stats = _run_with_eplb(root, monkeypatch, _PROMPTS, environ, **_FEW_SEQS)
    assert tokens == random_expected["parallel"]
    assert tokens == random_expected["one process"]
    _check_stats(stats, num_physical=10)
    # 16 lockstep steps, two of them with a prefill (the first, and rank 0 admitting its third prompt).
    assert stats[0].num_counted_steps == 14
    assert [r.counted_step for r in stats[0].rearrangements] == [1, 3, 5, 7, 9, 11, 13]


@pytest.mark.slow
def test_skewed_workload_is_balanced_without_replicas(
    root: Path, monkeypatch: pytest.MonkeyPatch, skewed_expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # Interval 4, window 2, two P2P buckets: rearrangements after 1 and 5 counted steps.
    environ = {
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "4",
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "2",
        "DEEPINFER_REARRANGE_P2P_GROUPS": "2",
    }
    tokens, stats = _run_with_eplb(root, monkeypatch, _SKEWED, environ)
    assert tokens == skewed_expected["parallel"]
    assert tokens == skewed_expected["one process"]
    _check_stats(stats, num_physical=8)
    assert [r.counted_step for r in stats[0].rearrangements] == [1, 5]
    for record in stats[0].rearrangements:
        # Figures of the window the placement was computed from; the new placement never balances worse.
        assert record.imbalance_after <= record.imbalance_before + 1e-9, record
    assert stats[0].rearrangements[0].imbalance_after < stats[0].rearrangements[0].imbalance_before


@pytest.mark.slow
def test_rearrangement_after_prefill(
    root: Path, monkeypatch: pytest.MonkeyPatch, skewed_expected: dict[str, list[tuple[int, ...]]]
) -> None:
    # Prefill steps count; the first decode step after one rearranges whatever the schedule (interval 100).
    environ = {
        "DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL": "100",
        "DEEPINFER_EXPERT_COUNT_WINDOW_SIZE": "4",
        "DEEPINFER_REARRANGE_AFTER_PREFILL_IN_NORMAL_ENGINE": "1",
    }
    tokens, stats = _run_with_eplb(root, monkeypatch, _SKEWED, environ)
    assert tokens == skewed_expected["one process"]
    assert stats[0] == stats[1]
    assert stats[0].num_counted_steps == 8  # the prefill step and 7 decode steps
    assert [r.counted_step for r in stats[0].rearrangements] == [2]
