"""Context-parallel `LLM` on CPU: CP rank processes over gloo (prefill chunks split over the CP ranks, decode run
whole on each) give the greedy and seeded tokens of one process; sizes that do not fit fail at construction with the
sizes named."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts, tokens_by_params

from deepinfer_engine import LLM
from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.worker import parallel_config
from deepinfer_sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("rank_processes_without_npu_double")

# Lengths 2 … 40: some shorter than 2·cp, most not a multiple of it.
_PROMPTS = random_prompts(6, 2, 40, seed=23)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
_SEEDED = SamplingParams(temperature=1.0, seq_seed=99, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("context_parallel")


@pytest.fixture(scope="module")
def single_process_tokens(root: Path) -> dict[str, list[tuple[int, ...]]]:
    return tokens_by_params(make_llm(root), _PROMPTS, {"greedy": _GREEDY, "seeded": _SEEDED})


def _generate(llm: LLM) -> dict[str, list[tuple[int, ...]]]:
    return tokens_by_params(llm, _PROMPTS, {"greedy": _GREEDY, "seeded": _SEEDED})


def test_context_parallel_matches_one_process(
    root: Path, single_process_tokens: dict[str, list[tuple[int, ...]]]
) -> None:
    llm = make_llm(root, context_parallel_size=2)
    try:
        assert _generate(llm) == single_process_tokens
        # Grammars compile at different times on the CP ranks, so structured output is refused up front.
        structured = SamplingParams(max_tokens=4, so_args={"schema_type": "regex", "schema": "[a-z]+"})
        with pytest.raises(ValueError, match=r"prompt 1 asks for structured output .*context_parallel_size=2"):
            llm.generate(prompt_token_ids=_PROMPTS[:2], sampling_params=[_GREEDY, structured], use_tqdm=False)
        # The engine still serves later calls.
        alone = llm.generate(prompt_token_ids=_PROMPTS[:1], sampling_params=_GREEDY, use_tqdm=False)
        assert tuple(alone[0].token_ids) == single_process_tokens["greedy"][0]
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "cp", "ep"), [(2, 2, 4), (1, 4, 1)])
def test_context_parallel_with_data_and_expert_parallel_matches_one_process(
    root: Path, single_process_tokens: dict[str, list[tuple[int, ...]]], dp: int, cp: int, ep: int
) -> None:
    llm = make_llm(root, data_parallel_size=dp, context_parallel_size=cp, expert_parallel_size=ep)
    try:
        assert _generate(llm) == single_process_tokens
    finally:
        llm.close()


def test_world_layout() -> None:
    # EP alone implies ep // cp DP ranks; the world is dp · cp.
    config = parallel_config(EngineArgs(context_parallel_size=2, expert_parallel_size=4))
    assert (config.world_size, config.data_parallel_size, config.context_parallel_size) == (4, 2, 2)
    config = parallel_config(EngineArgs(context_parallel_size=4, expert_parallel_size=2))
    assert (config.world_size, config.data_parallel_size) == (4, 1)


def test_sizes_that_do_not_divide(root: Path) -> None:
    with pytest.raises(ValueError, match=r"expert_parallel_size=2, context_parallel_size=3: .*does not divide"):
        make_llm(root, context_parallel_size=3, expert_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=3, expert_parallel_size=4, context_parallel_size=2"):
        make_llm(root, data_parallel_size=3, context_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="context_parallel_size must be a positive int, got 0"):
        make_llm(root, context_parallel_size=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        # A 16-token budget chunks the longer prompts: split steps continue from cached history and mix in decodes.
        {"max_num_batched_tokens": 16},
        # Speculative decoding: verify steps of 1 + 3 tokens are split too (4 = 2·cp); drafts run whole.
        {"nextn": 3},
    ],
)
def test_chunked_prefill_and_speculative_decoding_match_one_process(root: Path, settings: dict[str, int]) -> None:
    # CP ranks always step synchronously (deepinfer_engine.engine: lockstep ranks run no asynchronous scheduling), so
    # the one process does too (asynchronous scheduling gives the same tokens, see test_reproducible.py).
    reference = make_llm(root, async_scheduling=False, **settings)
    expected = _generate(reference)
    llm = make_llm(root, context_parallel_size=2, **settings)
    try:
        assert _generate(llm) == expected
    finally:
        llm.close()
