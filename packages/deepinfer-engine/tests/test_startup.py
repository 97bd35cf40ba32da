"""Start-up sizing: the profiling step takes the path of a real step, the token budget halves until a step fits,
the cache budget arithmetic, and the line the engine logs about what it chose."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_support import make_llm

from deepinfer_engine import LLM
from deepinfer_engine.engine_args import EngineArgs
from deepinfer_engine.envs import read_env
from deepinfer_engine.startup import (
    cache_budget_from_memory,
    describe_prompt_attention,
    fitting_token_budget,
    profile_step,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_llm(tmp_path_factory.mktemp("deepinfer-cache"))


def _record_forwards(llm: LLM, fail_above: int | None = None) -> list[tuple[int, int]]:
    """Record (tokens, logits rows) of every model forward; raise out-of-memory above `fail_above` tokens."""
    assert llm.engine is not None
    model = llm.engine.model
    forward = model.forward
    seen: list[tuple[int, int]] = []

    def recording(batch: Any, state: Any) -> torch.Tensor:
        rows = batch.logits_indices.numel() if batch.logits_indices is not None else batch.input_ids.numel()
        seen.append((batch.input_ids.numel(), rows))
        if fail_above is not None and batch.input_ids.numel() > fail_above:
            raise torch.OutOfMemoryError("profiling step too large (injected)")
        return forward(batch, state)

    model.forward = recording  # type: ignore[method-assign]
    return seen


def test_the_profiling_step_runs_a_full_step_through_the_runner(llm: LLM) -> None:
    assert llm.engine is not None
    seen = _record_forwards(llm)
    args = EngineArgs(device="cpu", max_num_seqs=5, block_size=16)
    peak = profile_step(llm.engine.model, args, read_env({}), llm.engine.config.model_dir, torch.device("cpu"), 70)
    assert peak is None  # only CUDA measures memory
    assert seen == [(70, 5)]  # every token of the budget, one sampled row per request
    del llm.engine.model.forward


def test_the_token_budget_halves_until_a_step_fits(llm: LLM) -> None:
    assert llm.engine is not None
    seen = _record_forwards(llm, fail_above=40)
    args = EngineArgs(device="cpu", max_num_seqs=4, block_size=16)
    model, env, directory = llm.engine.model, read_env({}), llm.engine.config.model_dir

    def profile(n: int) -> int | None:
        return profile_step(model, args, env, directory, torch.device("cpu"), n)

    assert fitting_token_budget(profile, 160, floor=4, halve=True) == (40, None)
    assert [tokens for tokens, _ in seen] == [160, 80, 40]
    with pytest.raises(torch.OutOfMemoryError):
        fitting_token_budget(profile, 160, floor=4, halve=False)  # a budget the user gave is not changed
    with pytest.raises(torch.OutOfMemoryError):
        fitting_token_budget(profile, 160, floor=100, halve=True)
    del llm.engine.model.forward


def test_cache_budget_arithmetic() -> None:
    gib = 2**30
    assert cache_budget_from_memory(100 * gib, 40 * gib, 5 * gib, 0.9) == 45 * gib
    with pytest.raises(ValueError, match="no device memory left for the cache"):
        cache_budget_from_memory(100 * gib, 85 * gib, 6 * gib, 0.9)


def test_the_engine_says_what_it_chose(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer_engine"):
        llm = LLM(cache_dir=str(tmp_path), device="cpu", max_num_seqs=4)
    assert llm.engine is not None
    chosen = llm.engine.config
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine on cpu")]
    assert f"max_model_len={chosen.scheduler.max_model_len} (checkpoint limit 4096)" in line
    assert f"max_num_batched_tokens={chosen.scheduler.max_num_batched_tokens}" in line
    assert f"cache of {chosen.num_blocks} blocks x 128 tokens" in line and "from the CPU default" in line


def test_the_prompt_attention_line_says_why_not_flashmla() -> None:
    cpu = torch.device("cpu")
    assert describe_prompt_attention(EngineArgs(flashmla=False), False, cpu, 64, 512).endswith("(flashmla=False)")
    assert "not 'fp32'" in describe_prompt_attention(EngineArgs(precision="fp32"), False, cpu, 64, 512)
    assert "batch-invariant" in describe_prompt_attention(EngineArgs(), True, cpu, 64, 512)
    line = describe_prompt_attention(EngineArgs(), False, cpu, 64, 512)
    assert line.startswith("prompt attention: the package's kernels (FlashMLA unavailable:") and "cpu" in line


@pytest.mark.gpu
@needs_cuda
def test_cuda_defaults_start_and_say_what_they_chose(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer_engine"):
        llm = LLM(cache_dir=str(tmp_path))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine on cuda")]
    assert "activation peak of a" in line and "profiling step" in line
    assert any(r.getMessage().startswith("prompt attention: ") for r in caplog.records)
    too_long = [3 + i % 1000 for i in range(llm.config.scheduler.max_model_len + 1)]  # ids inside the vocabulary
    outputs = llm.generate(prompt_token_ids=[[5, 6, 7], too_long], use_tqdm=False)
    assert (
        outputs[0].ok and outputs[1].error_message is not None and "exceeds max_model_len" in outputs[1].error_message
    )
