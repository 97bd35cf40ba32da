"""Greedy drafting steps (docs/design/speculative.md, "Greedy steps") against the general path in `LLM.generate`
(CPU, the built-in checkpoint, whose drafts are often accepted, nextn = 5): every result of every `Speculator.sample`
call — emitted tokens, logprobs and top logprobs, accepted counts, drafts, confidences and the draft probability rows
kept for the next step — is bit for bit what the general path (processed distributions, `verify_rejection`, sampled
drafts) gives on the same engine inputs, also for greedy requests with penalties, golden tokens, a grammar or EOS
masking; a batch with one sampled request takes the general path."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_support import make_llm

import deepinfer_engine.speculative as speculative
from deepinfer_engine import SamplingParams
from deepinfer_engine.admission import Admission
from deepinfer_sampling import Sampler, SamplingBatch

NEXTN = 5
HELD_OUT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "tiny_heldout.jsonl"
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, top_logprobs=3)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("greedy_steps")


def _general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the general path for greedy requests: no batch counts as all-greedy and no draft row as a raw argmax."""
    build = SamplingBatch.build.__func__  # type: ignore[attr-defined]

    def build_general(cls: type[SamplingBatch], *args: Any, **kwargs: Any) -> SamplingBatch:
        return dataclasses.replace(build(cls, *args, **kwargs), all_greedy=False)

    monkeypatch.setattr(SamplingBatch, "build", classmethod(build_general))
    monkeypatch.setattr(Sampler, "processed_is_raw_argmax", lambda self, rows: False)


def _prompts(num: int, skip: int) -> list[str]:
    """`num` held-out task prompts, every `skip`-th one (several tasks)."""
    lines = HELD_OUT.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines[::skip][:num]]


def _run(root: Path, prompts: list[str], params: list[SamplingParams]) -> tuple[list, dict[str, int]]:
    """Every `Speculator.sample` result of one generate call (host tensors and the requests' draft probability rows),
    how often each verifier ran, and how many steps were not all-greedy."""
    llm = make_llm(root, model=None, nextn=NEXTN)
    speculator = llm.engine.runner.speculator
    assert speculator is not None
    calls = {"verify_greedy": 0, "verify_rejection": 0, "steps_with_a_sampled_row": 0}
    records: list[tuple[torch.Tensor, ...]] = []
    sample = speculator.sample

    def recorded_sample(logits: torch.Tensor, batch: Any, bitmask: Any, requests: Any) -> Any:
        calls["steps_with_a_sampled_row"] += not batch.all_greedy
        step = sample(logits, batch, bitmask, requests)
        probs = tuple(r.request.draft_probs.clone() for r in requests)
        records.append((step.token_ids, step.logprobs, step.top_ids, step.top_values, step.num_accepted, *probs))
        records.append((step.draft_ids, step.draft_confidences))
        return step

    def counted(name: str) -> Any:
        verify = getattr(speculative, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return verify(*args, **kwargs)

        return call

    speculator.sample = recorded_sample  # type: ignore[method-assign]
    poll = Admission.poll
    with pytest.MonkeyPatch.context() as patch:
        for name in ("verify_greedy", "verify_rejection"):
            patch.setattr(speculative, name, counted(name))
        # A grammar compiles in the background, so its request would join the first step it is ready for: the two
        # runs compared would batch differently. Waiting for it before the first step gives both the same steps.
        patch.setattr(Admission, "poll", lambda self, wait_s: poll(self, 60.0))
        outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    assert sum(o.metrics.num_accepted_draft_tokens for o in outputs) > 0
    return records, calls


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """float32 values as their bit patterns (NaN and the sign of zero compare too)."""
    return tensor.view(torch.int32) if tensor.dtype == torch.float32 else tensor


def _assert_bitwise_equal(fast: list, general: list) -> None:
    assert len(fast) == len(general)
    for fast_step, general_step in zip(fast, general, strict=True):
        assert len(fast_step) == len(general_step)
        for a, b in zip(fast_step, general_step, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("num_prompts", [1, 7])
def test_greedy_steps_equal_the_general_path(root: Path, num_prompts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(num_prompts, 37)
    params = [GREEDY] * num_prompts
    fast, fast_calls = _run(root, prompts, params)
    assert fast_calls["verify_rejection"] == fast_calls["steps_with_a_sampled_row"] == 0
    assert fast_calls["verify_greedy"] > 1
    _general_path(monkeypatch)
    general, general_calls = _run(root, prompts, params)
    assert general_calls["verify_greedy"] == 0 and general_calls["verify_rejection"] == fast_calls["verify_greedy"]
    _assert_bitwise_equal(fast, general)


def test_a_batch_with_a_sampled_request_takes_the_general_path(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _prompts(4, 53)
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, seq_seed=5)
    params = [GREEDY, sampled, GREEDY, GREEDY]
    mixed, mixed_calls = _run(root, prompts, params)
    # Steps in which the sampled request waits for its last results are all-greedy and take the greedy path.
    assert mixed_calls["verify_rejection"] == mixed_calls["steps_with_a_sampled_row"] > 1
    _general_path(monkeypatch)
    general, _ = _run(root, prompts, params)
    _assert_bitwise_equal(mixed, general)


@pytest.mark.parametrize("eos_suppressed", [False, True], ids=["argmax_drafts", "sampled_drafts"])
def test_greedy_steps_with_masks_penalties_and_golden_tokens(
    root: Path, eos_suppressed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Verification takes the greedy path in every step; the drafts are argmaxes unless a request masks EOS on them.
    common = {"temperature": 0.0, "max_tokens": 14, "ignore_eos": True, "top_logprobs": 2}
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2, **common),
        SamplingParams(golden_token_ids=(40, 41, 40), **common),
        SamplingParams(so_args={"schema_type": "regex", "schema": "[0-9]{2,12}"}, **common),
    ]
    if eos_suppressed:
        params.append(SamplingParams(first_n_token_no_eos=30, **common))
    prompts = _prompts(len(params), 41)
    builds: list[int] = []
    build = SamplingBatch.build.__func__  # type: ignore[attr-defined]

    def counted_build(cls: type[SamplingBatch], rows: Any, *args: Any, **kwargs: Any) -> SamplingBatch:
        builds.append(len(rows))
        return build(cls, rows, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SamplingBatch, "build", classmethod(counted_build))
        fast, fast_calls = _run(root, prompts, params)
    assert fast_calls["verify_rejection"] == 0 and fast_calls["verify_greedy"] > 1
    # One batch per sampling step, plus one for the draft rows of each step in which the EOS-masking request drafts.
    steps = fast_calls["verify_greedy"]
    assert len(builds) > steps if eos_suppressed else len(builds) == steps
    _general_path(monkeypatch)
    general, _ = _run(root, prompts, params)
    _assert_bitwise_equal(fast, general)
