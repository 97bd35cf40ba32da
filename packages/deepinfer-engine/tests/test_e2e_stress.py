"""Many requests of random lengths under cache pressure: every request completes exactly once, outputs equal an
unpressured run (greedy), and the cache returns to empty. The 1,000-request run is marked slow; a smaller variant
runs by default."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from llm_support import VOCAB_SIZE, make_llm

from deepinfer_engine import LLM, SamplingParams


def _workload(num: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 30))] for _ in range(num)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8)) for _ in range(num)]
    return prompts, params


def _run(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], min_preemptions: int = 0
) -> list[tuple[int, ...]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) >= min_preemptions
    assert len(outputs) == len(prompts)
    assert len({o.request_id for o in outputs}) == len(prompts), "each request completes exactly once"
    assert all(o.ok for o in outputs), [(o.finish_reason, o.error_message) for o in outputs if not o.ok]
    for output, p in zip(outputs, params, strict=True):
        assert 1 <= len(output.token_ids) <= p.max_tokens
    manager = llm.engine.cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks, "every block returns to the pool"
    assert manager.num_free_state_slots == llm.engine.config.cache.num_state_slots - 1
    assert not llm.engine.core.has_unfinished_requests()
    return [o.token_ids for o in outputs]


def _compare_under_pressure(root: Path, num: int, seed: int) -> None:
    prompts, params = _workload(num, seed)
    expected = _run(make_llm(root, precision="fp32", max_num_seqs=16, num_cache_blocks=512), prompts, params)
    for async_scheduling in (False, True):
        tight = make_llm(
            root,
            precision="fp32",
            max_num_seqs=16,
            block_size=4,
            num_cache_blocks=16,
            async_scheduling=async_scheduling,
        )
        assert _run(tight, prompts, params, min_preemptions=1) == expected


def test_requests_under_cache_pressure(tmp_path: Path) -> None:
    _compare_under_pressure(tmp_path, 64, seed=1)


@pytest.mark.slow
def test_thousand_requests_under_cache_pressure(tmp_path: Path) -> None:
    _compare_under_pressure(tmp_path, 1000, seed=2)
