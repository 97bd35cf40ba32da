"""Data- and expert-parallel `LLM` on CPU: rank processes over gloo give the greedy tokens of one process; bad sizes
fail at construction with the sizes named; prompts are assigned to ranks round-robin; a rank that dies mid-call
ends the call at once."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts, tokens_by_params

from deepinfer_engine.executor import assign_round_robin
from deepinfer_sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("rank_processes_without_npu_double")

_PROMPTS = random_prompts(8, 2, 40, seed=11)  # mixed lengths, 8 prompts
_GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_SEEDED = SamplingParams(temperature=1.0, seq_seed=1234, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def single_process_tokens(root: Path) -> dict[str, list[tuple[int, ...]]]:
    return tokens_by_params(make_llm(root), _PROMPTS, {"greedy": _GREEDY, "seeded": _SEEDED})


def test_round_robin_assignment() -> None:
    assert assign_round_robin(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_round_robin(1, 3) == [[0], [], []]
    with pytest.raises(ValueError, match="num_ranks"):
        assign_round_robin(4, 0)


@pytest.mark.parametrize(("dp", "ep"), [(2, 2), (1, 2)])
def test_parallel_matches_one_process(
    root: Path, single_process_tokens: dict[str, list[tuple[int, ...]]], dp: int, ep: int
) -> None:
    llm = make_llm(root, data_parallel_size=dp, expert_parallel_size=ep)
    try:
        greedy = llm.generate(prompt_token_ids=_PROMPTS, sampling_params=_GREEDY, use_tqdm=False)
        # Same request numbers as the single-process engine's second call, so the same seeds.
        seeded = llm.generate(prompt_token_ids=_PROMPTS, sampling_params=_SEEDED, use_tqdm=False)
        # Fewer prompts than ranks: one rank stays idle for the whole call and still joins every step.
        alone = llm.generate(prompt_token_ids=_PROMPTS[:1], sampling_params=_GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert [o.prompt_token_ids for o in greedy] == [tuple(p) for p in _PROMPTS]
    assert [tuple(o.token_ids) for o in greedy] == single_process_tokens["greedy"]
    assert [tuple(o.token_ids) for o in seeded] == single_process_tokens["seeded"]
    assert tuple(alone[0].token_ids) == single_process_tokens["greedy"][0]


def test_ep_size_must_divide_dp_size(root: Path) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=3, expert_parallel_size=2"):
        make_llm(root, data_parallel_size=3, expert_parallel_size=2)


def test_experts_must_divide_over_ep_ranks(root: Path) -> None:
    # The tiny checkpoint has 8 routed experts.
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the model's n_routed_experts=8"):
        make_llm(root, data_parallel_size=3, expert_parallel_size=3)


def test_unwired_parallel_sizes_still_refused(root: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        make_llm(root, tensor_parallel_size=2)


def test_a_rank_that_dies_mid_call_ends_the_call_at_once(root: Path) -> None:
    # A crashed rank leaves its peers blocked in a collective; the driver must not wait for them (gloo's timeout is
    # 600 s) but stop every rank and raise.
    llm = make_llm(root, data_parallel_size=2, expert_parallel_size=2)
    ranks = multiprocessing.active_children()
    assert len(ranks) == 2
    killer = threading.Timer(2.0, ranks[-1].kill)
    long_run = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RuntimeError, match=r"rank \d of 2 (failed|exited without answering); every rank process"):
            llm.generate(prompt_token_ids=_PROMPTS, sampling_params=long_run, use_tqdm=False)
    finally:
        killer.cancel()
        llm.close()
    assert time.monotonic() - start < 60.0
    assert not any(rank.is_alive() for rank in ranks)
