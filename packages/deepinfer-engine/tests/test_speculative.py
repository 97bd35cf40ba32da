"""Speculative decoding with the DSpark drafter in `LLM.generate` (CPU, tiny checkpoint): greedy output with drafts
equals greedy output without (also under preemption and for requests with penalties or grammars), seeded sampling with
drafts is reproducible, the draft counters are consistent, a checkpoint whose drafter and target agree accepts every
draft, and bad arguments fail clearly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts, tiny_dir
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from deepinfer_engine import LLM, GenerateOutput, SamplingParams
from deepinfer_engine.model_runner import StepHandle
from deepinfer_engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference import engram_vocabulary_from_tokenizer, reference_forward, reference_forward_full
from deepinfer_model.reference_dspark import reference_dspark_forward, reference_dspark_heads

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


def _edited_checkpoint(root: Path, name: str, edit: dict[str, float], drop_drafter: bool = False) -> Path:
    """A copy of the tiny checkpoint with the named tensors filled with a constant (or without DSpark blocks)."""
    target = root / name
    if target.is_dir():
        return target
    shutil.copytree(tiny_dir(root), target)
    tensors = load_file(str(target / SHARD))
    for tensor_name, value in edit.items():
        tensors[tensor_name] = torch.full_like(tensors[tensor_name], value)
    if drop_drafter:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        config = json.loads((target / "config.json").read_text())
        text = config["text_config"]
        text["compress_ratios"] = text["compress_ratios"][: -text["num_nextn_predict_layers"]]
        text["num_nextn_predict_layers"] = 0
        (target / "config.json").write_text(json.dumps(config))
        index = json.loads((target / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, str(target / SHARD), metadata={"format": "pt"})
    return target


def _tokens(outputs: list[GenerateOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outputs]


def _check_counters(outputs: list[GenerateOutput]) -> None:
    for output in outputs:
        metrics = output.metrics
        assert 0 <= metrics.num_accepted_draft_tokens <= metrics.num_verified_draft_tokens
        assert metrics.num_accepted_draft_tokens < metrics.num_generated_tokens


def test_greedy_with_drafts_equals_greedy_without_also_under_preemption(root: Path) -> None:
    # FP32 compute mode: verify batches of several rows and one-row decode steps then agree up to summation order.
    prompts = random_prompts(10, 3, 40, seed=3)
    plain = make_llm(root, precision="fp32").generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    expected = _tokens(plain)
    assert all(o.metrics.num_verified_draft_tokens == 0 for o in plain)
    drafting = make_llm(root, precision="fp32", nextn=3, async_scheduling=False)
    outputs = drafting.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    _check_counters(outputs)
    # After its first token every request verifies nextn drafts per step (fewer only near max_tokens).
    assert all(o.metrics.num_verified_draft_tokens >= 3 for o in outputs)
    tight = make_llm(root, precision="fp32", nextn=2, block_size=4, num_cache_blocks=24, async_scheduling=False)
    pressured = tight.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in pressured) > 0, "the tiny cache should force preemption"
    assert _tokens(pressured) == expected
    _check_counters(pressured)
    assert tight.engine.cache_manager.num_free_blocks == tight.engine.cache_manager.num_usable_blocks


def test_requests_with_penalties_logprobs_or_grammars_draft_next_to_plain_ones(root: Path) -> None:
    prompts = random_prompts(4, 5, 20, seed=4)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, top_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6, so_args={"schema_type": "regex", "schema": "(yes|no)!"}),
    ]
    plain = make_llm(root, precision="fp32").generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    outputs = make_llm(root, precision="fp32", nextn=2, async_scheduling=False).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    assert _tokens(outputs) == _tokens(plain)
    assert all(o.metrics.num_verified_draft_tokens > 0 for o in outputs)
    assert outputs[3].text in ("yes!", "no!")
    for got, want in zip(outputs, plain, strict=True):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert [[t for t, _ in top] for top in outputs[2].top_logprobs] == [
        [t for t, _ in top] for top in plain[2].top_logprobs
    ]


def test_seeded_sampling_with_drafts_is_reproducible(root: Path) -> None:
    prompts = random_prompts(4, 3, 30, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seq_seed=100 + i) for i in range(4)]
    first = make_llm(root, nextn=2)
    once = first.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    again = first.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    other = make_llm(root, nextn=2, max_num_seqs=2).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    assert _tokens(once) == _tokens(again) == _tokens(other)
    _check_counters(once)
    assert [o.logprobs for o in once] == [o.logprobs for o in again]


def test_drafter_that_agrees_with_the_target_gets_every_draft_accepted(root: Path) -> None:
    # Zero final norms (and no Markov bias): target and drafter logits are all zero, so both predict token 0
    # greedily and the uniform distribution when sampling; drafts then always pass verification.
    edit = {"norm.weight": 0.0, "mtp.0.norm.weight": 0.0, "mtp.0.markov_head.head.weight": 0.0}
    model = str(_edited_checkpoint(root, "agreeing-drafter", edit))
    prompts = random_prompts(3, 4, 25, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    plain = make_llm(root, model=model).generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    drafting = make_llm(root, model=model, nextn=3)
    outputs = drafting.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain) == [[0] * 9] * 3
    # Token 1 comes from the prompt step, then two decode steps verify 3 drafts each and accept all of them.
    for output in outputs:
        assert output.metrics.num_verified_draft_tokens == output.metrics.num_accepted_draft_tokens == 6
    sampled = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seq_seed=7)
    results = drafting.generate(prompt_token_ids=prompts, sampling_params=sampled, use_tqdm=False)
    for output in results:
        assert output.metrics.num_accepted_draft_tokens == 6
        assert len(set(output.token_ids)) > 1  # sampled from the uniform distribution, not stuck on one token


def test_bad_arguments_fail_clearly(root: Path) -> None:
    for bad in (-1, 33, True, 2.0):
        with pytest.raises(ValueError, match="nextn"):
            make_llm(root, nextn=bad)
    no_drafter = str(_edited_checkpoint(root, "no-drafter", {}, drop_drafter=True))
    with pytest.raises(ValueError, match="DSpark"):
        make_llm(root, model=no_drafter, nextn=2)
    assert (
        make_llm(root, model=no_drafter)
        .generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0]
        .ok
    )
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_llm(root, nextn=3, max_num_seqs=8, max_num_batched_tokens=16)


def test_asynchronous_scheduling_with_drafts_equals_synchronous(root: Path) -> None:
    # Under asynchronous scheduling a request in flight verifies placeholders at optimistic positions; the runner
    # shifts them back by the drafts the step in flight rejected. Every kind of request, seeded: identical results.
    prompts = random_prompts(6, 3, 30, seed=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=8, seq_seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, max_tokens=6, seq_seed=9, golden_token_ids=[7, 8, 9, 10]),
        SamplingParams(temperature=1.0, max_tokens=9, seq_seed=3, ignore_eos=True, top_k=50, top_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6, so_args={"schema_type": "regex", "schema": "(yes|no)!"}),
    ]
    results = {}
    for mode in (False, True):
        llm: LLM = make_llm(root, precision="fp32", nextn=2, async_scheduling=mode)
        assert llm.engine.config.async_scheduling is mode
        results[mode] = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        _check_counters(results[mode])
    sync, asynchronous = results[False], results[True]
    assert _tokens(asynchronous) == _tokens(sync)
    assert sum(o.metrics.num_accepted_draft_tokens for o in sync) > 0
    for got, want in zip(asynchronous, sync, strict=True):
        assert got.finish_reason is want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in want.top_logprobs]
        values = [v for top in got.top_logprobs for _, v in top]
        assert values == pytest.approx([v for top in want.top_logprobs for _, v in top], abs=1e-5)
    assert _tokens(asynchronous)[3][:4] == [7, 8, 9, 10]


def test_asynchronous_scheduling_with_drafts_under_preemption_and_full_acceptance(root: Path) -> None:
    prompts = random_prompts(10, 3, 40, seed=3)
    plain = make_llm(root, precision="fp32").generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    tight = make_llm(root, precision="fp32", nextn=2, block_size=4, num_cache_blocks=24, async_scheduling=True)
    pressured = tight.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in pressured) > 0, "the tiny cache should force preemption"
    assert _tokens(pressured) == _tokens(plain)
    assert tight.engine.cache_manager.num_free_blocks == tight.engine.cache_manager.num_usable_blocks
    edit = {"norm.weight": 0.0, "mtp.0.norm.weight": 0.0, "mtp.0.markov_head.head.weight": 0.0}
    model = str(_edited_checkpoint(root, "agreeing-drafter", edit))
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    agreeing = make_llm(root, model=model, nextn=3, async_scheduling=True)
    outputs = agreeing.generate(prompt_token_ids=prompts[:3], sampling_params=params, use_tqdm=False)
    assert _tokens(outputs) == [[0] * 9] * 3
    assert all(o.metrics.num_accepted_draft_tokens == 6 for o in outputs)


def _reference_greedy_drafts(root: Path, context: list[int], anchor: int, nextn: int) -> list[int]:
    """Greedy drafts of the single-file reference drafter after `context`, opened by `anchor` (FP32)."""
    directory = tiny_dir(root)
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    config, weights = checkpoint.config, checkpoint.tensors
    full = reference_forward_full(config, weights, torch.tensor(context), vocabulary, precision="fp32")
    hidden = reference_dspark_forward(config, weights, full.target_features, anchor, nextn, precision="fp32").hidden
    drafts, previous = [], anchor
    for k in range(nextn):
        logits, _ = reference_dspark_heads(
            config, weights, hidden[k : k + 1], torch.tensor([previous]), precision="fp32"
        )
        previous = int(logits[0].argmax())
        drafts.append(previous)
    return drafts


def test_runner_drafts_and_verification_match_the_reference(root: Path) -> None:
    # Two steps of one request driven by hand: the prompt step drafts after the prompt; the next step verifies those
    # drafts against the target (greedy: accepted iff equal to the target argmax) and drafts after the accepted prefix.
    nextn = 3
    llm = make_llm(root, precision="fp32", nextn=nextn)
    runner = llm.engine.runner
    prompt = random_prompts(1, 30, 30, seed=8)[0]
    first = ScheduledRequest(
        is_new=True,
        input_token_ids=tuple(prompt),
        num_computed_tokens=0,
        num_draft_tokens=0,
        samples_token=True,
        first_new_block_index=0,
        new_block_ids=(1, 2, 3),
        request_id="drafted",
        num_prompt_tokens=len(prompt),
        state_slot=1,
        new_request=NewRequestData(GREEDY, 1, tuple(prompt)),
    )
    out = runner.wait(runner.execute(SchedulerOutput(40_000, (first,), frozenset(), ())))
    (golden,) = out.sampled_token_ids[0]
    assert out.draft_token_ids is not None
    drafts = list(out.draft_token_ids[0])
    assert drafts == _reference_greedy_drafts(root, prompt, golden, nextn)

    second = ScheduledRequest(
        is_new=False,
        input_token_ids=(golden, *drafts),
        num_computed_tokens=len(prompt),
        num_draft_tokens=nextn,
        samples_token=True,
        first_new_block_index=3,
        new_block_ids=(),
        request_id="drafted",
        num_prompt_tokens=len(prompt),
        state_slot=1,
        new_request=NewRequestData(GREEDY, 1, tuple(prompt)),
    )
    out = runner.wait(runner.execute(SchedulerOutput(40_001, (second,), frozenset(), ())))
    emitted = list(out.sampled_token_ids[0])
    directory = tiny_dir(root)
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    sequence = torch.tensor([*prompt, golden, *drafts])
    logits = reference_forward(checkpoint.config, checkpoint.tensors, sequence, vocabulary, precision="fp32")
    targets = logits[len(prompt) :].argmax(dim=-1).tolist()  # the target's choice after golden, d1, d2, d3
    accepted = 0
    while accepted < nextn and drafts[accepted] == targets[accepted]:
        accepted += 1
    assert emitted == [*drafts[:accepted], targets[accepted]]
    assert out.draft_token_ids is not None
    context = [*prompt, golden, *drafts[:accepted]]
    assert list(out.draft_token_ids[0]) == _reference_greedy_drafts(root, context, emitted[-1], nextn)
    runner.wait(runner.execute(SchedulerOutput(40_002, (), frozenset({"drafted"}), ())))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_greedy_with_drafts_equals_greedy_without(root: Path) -> None:
    prompts = random_prompts(8, 3, 40, seed=10)
    plain = make_llm(root, device="cuda", precision="fp32")
    expected = _tokens(plain.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
    drafting = make_llm(root, device="cuda", precision="fp32", nextn=3)
    outputs = drafting.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert _tokens(outputs) == expected
    _check_counters(outputs)
    assert all(o.metrics.num_verified_draft_tokens >= 3 for o in outputs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_steps_and_draft_steps_in_one_engine(root: Path) -> None:
    # Exact precision on CUDA captures decode graphs; a request that reaches max_tokens - 1 verifies no drafts, so a
    # step of such requests alone replays a graph while the others run eager verify steps (the agreeing checkpoint
    # makes both exact). Requests with a penalty draft like the others.
    edit = {"norm.weight": 0.0, "mtp.0.norm.weight": 0.0, "mtp.0.markov_head.head.weight": 0.0}
    model = str(_edited_checkpoint(root, "agreeing-drafter", edit))
    llm = make_llm(root, model=model, device="cuda", nextn=3)
    assert llm.engine.runner.graphs is not None
    prompts = random_prompts(4, 4, 25, seed=11)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 if i % 2 else 9, ignore_eos=True, repetition_penalty=1.2)
        for i in range(4)
    ]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _tokens(outputs) == [[0] * 9, [0] * 6] * 2
    # 9 tokens: the prompt step's, then two steps of 3 accepted drafts and a bonus token; 6 tokens: 1 + 4 + 1.
    assert [o.metrics.num_accepted_draft_tokens for o in outputs] == [6, 3, 6, 3]
    alone = llm.generate(prompt_token_ids=prompts[1:2], sampling_params=params[1], use_tqdm=False)
    assert _tokens(alone) == [[0] * 6]


@pytest.mark.gpu
@needs_cuda
def test_cuda_execute_with_drafts_never_synchronizes(root: Path) -> None:
    # Verification, draft sampling, history writes and result copies must not synchronize; the eager model forwards
    # (main and draft) are excluded like in test_model_runner.
    engine = make_llm(root, device="cuda", nextn=2, async_scheduling=True)
    runner = engine.engine.runner
    model = runner.model
    execute, forward, draft_forward = runner.execute, model.forward, model.draft_forward

    def guarded(scheduler_output: SchedulerOutput) -> StepHandle:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(scheduler_output)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def unguarded(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object) -> torch.Tensor:
            torch.cuda.set_sync_debug_mode("default")
            try:
                return function(*args)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        return call

    runner.execute = guarded  # type: ignore[method-assign]
    model.forward = unguarded(forward)  # type: ignore[method-assign]
    model.draft_forward = unguarded(draft_forward)  # type: ignore[method-assign]
    outputs = engine.generate(prompt_token_ids=random_prompts(6, 2, 20, seed=6), sampling_params=GREEDY, use_tqdm=False)
    assert all(o.ok for o in outputs)
    assert all(o.metrics.num_verified_draft_tokens > 0 for o in outputs)


def _default_nextn(root: Path, **kwargs: object) -> int:
    llm = LLM(cache_dir=str(root), device="cpu", max_num_seqs=2, num_cache_blocks=32, block_size=16, **kwargs)
    return llm.config.scheduler.max_num_draft_tokens


def test_nextn_defaults_as_the_reference(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE", raising=False)
    assert _default_nextn(root) == 5  # the tiny checkpoint has DSpark blocks
    assert _default_nextn(root, nextn=0) == 0
    # Without DSpark blocks nothing drafts, without error; asking for drafts explicitly is an error.
    no_drafter = _edited_checkpoint(root, "no-drafter", {}, drop_drafter=True)
    assert _default_nextn(root, model=str(no_drafter)) == 0
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    assert _default_nextn(root) == 2
    assert _default_nextn(root, model=str(no_drafter)) == 0
    assert _default_nextn(root, nextn=3) == 3  # the argument wins
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    assert _default_nextn(root) == 0
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "-1")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE"):
        _default_nextn(root)
