"""Acceptance of the batch-invariant mode on NVIDIA (docs/design/numerics.md, "Batch invariance"; docs/reproducible.md):
on the built-in checkpoint with CUDA graphs, a request's greedy tokens and the log-probs of its tokens and their top
20 alternatives (log-softmax of its logits rows, so equal floats mean equal logits up to a shift) are bitwise the
same alone and inside a batch of 64 mixed requests (prompt lengths and output lengths differ; a small token budget
makes prefill chunks run in the same steps as decodes). Without the flag some of them differ. With drafting and
seeded sampling (the deterministic recipe) tokens do not depend on the batch either."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_engine import LLM, GenerateOutput, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HELD_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "tiny_heldout.jsonl"
ENGINE: dict[str, Any] = {
    "device": "cuda",
    "nextn": 0,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
    "block_size": 16,
    "num_cache_blocks": 4096,
}
TARGET = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, top_logprobs=20)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _held_out(num: int, start: int = 0) -> list[str]:
    lines = HELD_OUT.read_text(encoding="utf-8").splitlines()[start : start + num]
    return [json.loads(line)["prompt"] for line in lines]


def _signature(output: GenerateOutput) -> tuple[Any, ...]:
    assert output.ok
    return output.token_ids, output.logprobs, output.top_logprobs


def _mixed_batch(targets: list[str]) -> tuple[list[str], list[SamplingParams]]:
    """The targets, reversed, interleaved with 64 − len(targets) other requests of other lengths."""
    others = _held_out(64 - len(targets), start=100)
    prompts: list[str] = []
    params: list[SamplingParams] = []
    for i, prompt in enumerate(targets[::-1]):
        prompts += [prompt, others[i]]
        params += [TARGET, SamplingParams(temperature=0.0, max_tokens=1 + 5 * (i % 7), ignore_eos=True)]
    return prompts, params


def _alone_and_together(llm: LLM, targets: list[str]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    prompts, params = _mixed_batch(targets)
    mixed = llm.generate(prompts, params, use_tqdm=False)
    together = [_signature(o) for o, p in zip(mixed, params, strict=True) if p is TARGET][::-1]
    alone = [_signature(llm.generate([prompt], TARGET, use_tqdm=False)[0]) for prompt in targets]
    return alone, together


def test_a_request_alone_and_in_a_batch_of_64_gets_the_same_bits(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    llm = LLM(cache_dir=str(root), **ENGINE)
    assert llm.engine.model.batch_invariant and llm.engine.runner.graphs is not None
    alone, together = _alone_and_together(llm, _held_out(32))
    llm.close()
    for index, (a, t) in enumerate(zip(alone, together, strict=True)):
        assert a == t, index


def test_without_the_flag_some_request_differs(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    llm = LLM(cache_dir=str(root), **ENGINE)
    assert not llm.engine.model.batch_invariant
    alone, together = _alone_and_together(llm, _held_out(32))
    llm.close()
    assert alone != together


def test_the_recipe_with_drafts_and_seeds_does_not_depend_on_the_batch(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deterministic recipe on NVIDIA (docs/reproducible.md): flag on, fixed-length verification, drafting on,
    seeded sampling at temperature > 0 — the same tokens in a batch, reversed, and alone."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    llm = LLM(cache_dir=str(root), **{**ENGINE, "nextn": 5})
    assert llm.engine.config.scheduler.max_num_draft_tokens > 0 and not llm.engine.config.mtp_varlen
    prompts = _held_out(16, start=200)
    params = [
        SamplingParams(temperature=0.6 + 0.05 * i, top_p=0.9, max_tokens=16, seq_seed=100 + i, ignore_eos=True)
        for i in range(16)
    ]
    first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reversed_ = [o.token_ids for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    alone = [llm.generate([prompts[i]], params[i], use_tqdm=False)[0].token_ids for i in (0, 9)]
    llm.close()
    assert reversed_ == first
    assert alone == [first[0], first[9]]
