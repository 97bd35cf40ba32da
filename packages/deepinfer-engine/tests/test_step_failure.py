"""A failed or interrupted step never breaks the engine.

A model forward that raises once (an injected out-of-memory error, or KeyboardInterrupt) in the middle of a
`generate` call finishes that call's unfinished requests with the "error" finish reason (KeyboardInterrupt is
re-raised after the clean-up), frees all their cache, and leaves the `LLM` usable: the next `generate` gives the same
tokens as a fresh engine. Synchronous and asynchronous scheduling, CPU; the gpu-marked variant runs the same on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_support import make_llm, random_prompts

from deepinfer_engine import LLM, FinishReason, SamplingParams

PROMPTS = random_prompts(5, 3, 30, seed=21)
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seq_seed=7),
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tokens(llm: LLM) -> list[tuple[int, ...]]:
    outputs = llm.generate(prompt_token_ids=PROMPTS * 2, sampling_params=PARAMS * 5, use_tqdm=False)
    assert all(o.ok for o in outputs)
    return [o.token_ids for o in outputs]


def _fail_forward_once(llm: LLM, after_calls: int, error: BaseException) -> Callable[[], int]:
    """Make the model's forward raise `error` on call `after_calls` + 1 (once); returns a call counter. Decode steps
    that replay a CUDA graph never call the forward, so graph replays count (and fail) as forwards too."""
    assert llm.engine is not None
    calls = 0

    def failing_version(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls == after_calls + 1:
                raise error
            return run(*args, **kwargs)

        return failing

    model = llm.engine.model
    model.forward = failing_version(model.forward)  # type: ignore[method-assign]
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        graphs.replay = failing_version(graphs.replay)  # type: ignore[method-assign]
    return lambda: calls


def _assert_clean(llm: LLM) -> None:
    assert llm.engine is not None
    manager = llm.engine.cache_manager
    assert not manager.request_ids
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_state_slots == manager.config.num_state_slots - 1
    assert not llm.engine.core.has_unfinished_requests() and llm.engine.scheduler.num_steps_in_flight == 0


def _check_recovery(root: Path, **kwargs: Any) -> None:
    expected = _tokens(make_llm(root, **kwargs))
    llm = make_llm(root, **kwargs)
    _fail_forward_once(llm, 3, RuntimeError("CUDA out of memory (injected)"))
    outputs = llm.generate(prompt_token_ids=PROMPTS * 2, sampling_params=PARAMS * 5, use_tqdm=False)
    failed = [o for o in outputs if o.finish_reason is FinishReason.ERROR]
    assert failed, "the injected failure should stop the requests still running"
    for output in failed:
        assert output.error_message is not None and "CUDA out of memory (injected)" in output.error_message
    for output, tokens in zip(outputs, expected, strict=True):
        if output.ok:
            assert output.token_ids == tokens  # requests that finished before the failure are untouched
    _assert_clean(llm)
    assert _tokens(llm) == expected
    _assert_clean(llm)


def _check_interrupt(root: Path, **kwargs: Any) -> None:
    expected = _tokens(make_llm(root, **kwargs))
    llm = make_llm(root, **kwargs)
    calls = _fail_forward_once(llm, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=PROMPTS * 2, sampling_params=PARAMS * 5, use_tqdm=False)
    assert calls() == 3
    _assert_clean(llm)
    assert _tokens(llm) == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_finishes_the_call_with_errors_and_the_next_call_is_fresh(
    tmp_path_factory: pytest.TempPathFactory, async_scheduling: bool
) -> None:
    _check_recovery(tmp_path_factory.getbasetemp() / "tiny", async_scheduling=async_scheduling, block_size=8)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_keyboard_interrupt_cleans_up_then_propagates(
    tmp_path_factory: pytest.TempPathFactory, async_scheduling: bool
) -> None:
    _check_interrupt(tmp_path_factory.getbasetemp() / "tiny", async_scheduling=async_scheduling)


def test_interrupted_summary_does_not_claim_every_request_finished(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    llm = make_llm(tmp_path_factory.getbasetemp() / "tiny")
    _fail_forward_once(llm, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS[0])
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("generate: interrupted: 0 of 5 requests finished"), summary


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_failed_and_interrupted_steps(tmp_path_factory: pytest.TempPathFactory, async_scheduling: bool) -> None:
    root = tmp_path_factory.getbasetemp() / "tiny"
    _check_recovery(root, device="cuda", async_scheduling=async_scheduling)
    _check_interrupt(root, device="cuda", async_scheduling=async_scheduling)


def test_a_failure_while_admitting_gives_every_prompt_an_output(tmp_path_factory: pytest.TempPathFactory) -> None:
    llm = make_llm(tmp_path_factory.getbasetemp() / "tiny")
    assert llm.engine is not None
    tokenizer = llm.engine.tokenizer
    encode = tokenizer.encode

    def failing(text: str) -> list[int]:
        if text == "third":
            raise RuntimeError("tokenizer crashed (injected)")
        return encode(text)

    tokenizer.encode = failing  # type: ignore[method-assign]
    outputs = llm.generate(["first", "second", "third", "fourth"], PARAMS[0], use_tqdm=False)
    assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] * 4
    assert all(o.error_message is not None and "tokenizer crashed (injected)" in o.error_message for o in outputs)
    _assert_clean(llm)
    del tokenizer.encode
    assert all(o.ok for o in llm.generate(["first", "second"], PARAMS[0], use_tqdm=False))
