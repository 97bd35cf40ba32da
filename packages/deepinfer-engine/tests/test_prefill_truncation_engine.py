"""YOCO prefill truncation through `LLM` on the tiny checkpoint (window 64): the environment reaches the model, the
keep length is checked against the window plus the backtracking tokens, `mask` and `compact` generate the same
tokens (chunked prefill, with and without drafting) and a prompt within the keep length is not truncated."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_support import make_llm, random_prompts

from deepinfer_engine import SamplingParams
from deepinfer_engine.engine_args import EngineArgs, prefill_truncation
from deepinfer_engine.envs import read_env

MODE, KEEP = "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _tokens(root: Path, monkeypatch: pytest.MonkeyPatch, mode: str, nextn: int, prompts: list[list[int]]) -> tuple:
    monkeypatch.setenv(MODE, mode)
    monkeypatch.setenv(KEEP, "70" if mode != "off" else "0")
    # A small token budget prefills the long prompts in chunks.
    llm = make_llm(root, nextn=nextn, max_num_batched_tokens=64)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert all(output.ok for output in outputs)
    return [tuple(output.token_ids) for output in outputs], llm.model.consumer_layer_rows


@pytest.mark.parametrize("nextn", [0, 5])
def test_mask_and_compact_generate_the_same_tokens(root: Path, monkeypatch: pytest.MonkeyPatch, nextn: int) -> None:
    prompts = random_prompts(3, 150, 190, seed=31) + random_prompts(1, 30, 60, seed=32)
    masked, masked_rows = _tokens(root, monkeypatch, "mask", nextn, prompts)
    compact, compact_rows = _tokens(root, monkeypatch, "compact", nextn, prompts)
    off, _ = _tokens(root, monkeypatch, "off", nextn, prompts[3:])
    assert compact == masked
    assert compact[3:] == off  # shorter than KEEP: nothing is truncated
    assert compact_rows < masked_rows


def test_keep_below_window_plus_backtracking_names_both_numbers(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE, "compact")
    monkeypatch.setenv(KEEP, "60")
    message = rf"{KEEP}=60 is below sliding_window \(64\) \+ max backtracking tokens \(6\) = 70"
    with pytest.raises(ValueError, match=message):
        make_llm(root, nextn=5)
    monkeypatch.setenv(KEEP, "0")
    with pytest.raises(ValueError, match=rf"{KEEP}=0 must be > 0 when {MODE}='compact'"):
        make_llm(root)


def test_compact_refuses_context_parallelism() -> None:
    env = read_env({MODE: "compact", KEEP: "140"})
    with pytest.raises(ValueError, match="'compact' does not run with context_parallel_size=2"):
        prefill_truncation(EngineArgs(context_parallel_size=2), env)
    assert prefill_truncation(EngineArgs(), env).keep_tokens == 140


def test_prompt_logprobs_are_refused_under_truncation(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MODE, "mask")
    monkeypatch.setenv(KEEP, "70")
    llm = make_llm(root)
    asks = SamplingParams(max_tokens=2, prompt_logprobs=True)
    refused, served = llm.generate(
        prompt_token_ids=[[5, 6, 7], [5, 6, 7]], sampling_params=[asks, GREEDY], use_tqdm=False
    )
    assert not refused.ok and refused.error_message is not None and "prompt_logprobs" in refused.error_message
    assert served.ok and len(served.token_ids) == GREEDY.max_tokens
