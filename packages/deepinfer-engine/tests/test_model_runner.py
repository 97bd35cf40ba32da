"""The model runner on its own: protocol misuse errors, and on CUDA (gpu-marked) parity with the reference, async ==
sync and no host-device synchronization inside `execute`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts, reference_greedy

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model_runner import StepHandle
from deepinfer_engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


@pytest.fixture(scope="module")
def llm(root: Path) -> LLM:
    return make_llm(root)


def _one_request_step(step: int, request_id: str, new: NewRequestData | None = None) -> SchedulerOutput:
    scheduled = ScheduledRequest(
        request_id=request_id,
        is_new=True,
        input_token_ids=(5, 6, 7),
        num_computed_tokens=0,
        num_draft_tokens=0,
        samples_token=True,
        num_prompt_tokens=3,
        state_slot=1,
        first_new_block_index=0,
        new_block_ids=(1,),
        new_request=new,
    )
    return SchedulerOutput(step, (scheduled,), frozenset(), ())


def test_unregistered_request_is_an_error(llm: LLM) -> None:
    with pytest.raises(KeyError, match="without its NewRequestData"):
        llm.engine.runner.execute(_one_request_step(10_000, "never-added"))


def test_wait_out_of_launch_order_is_an_error(llm: LLM) -> None:
    runner = llm.engine.runner
    first = runner.execute(_one_request_step(20_000, "runner-a", NewRequestData(GREEDY, 1, (5, 6, 7))))
    second = runner.execute(_one_request_step(20_001, "runner-b", NewRequestData(GREEDY, 2, (5, 6, 7))))
    with pytest.raises(RuntimeError, match="in launch order"):
        runner.wait(second)
    a, b = runner.wait(first), runner.wait(second)
    assert a.request_ids == ("runner-a",) and len(a.sampled_token_ids[0]) == 1
    assert a.sampled_token_ids == b.sampled_token_ids  # same prompt, greedy: the same token
    done = SchedulerOutput(20_002, (), frozenset({"runner-a", "runner-b"}), ())
    assert runner.wait(runner.execute(done)).request_ids == ()
    assert a.top_logprobs == (((),),) and a.failures == {}  # no alternatives asked for


@pytest.mark.gpu
@needs_cuda
def test_cuda_greedy_equals_reference(root: Path) -> None:
    prompts = random_prompts(8, 3, 40, seed=4)
    expected = reference_greedy(root, prompts, GREEDY.max_tokens)
    engine = make_llm(root, device="cuda", precision="fp32")
    outputs = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outputs] == expected


@pytest.mark.gpu
@needs_cuda
def test_cuda_async_equals_sync_with_seeds(root: Path) -> None:
    # Under cache pressure the asynchronous schedule differs from the synchronous one (it reserves the in-flight
    # token), so GPU kernels see other batch rows and log-probs may differ by float rounding (9.5e-7 seen on an
    # H200); sampled tokens and the top-logprob token ids must still be identical.
    prompts = random_prompts(12, 2, 50, seed=5)
    params = [SamplingParams(temperature=0.8, max_tokens=6, seq_seed=i, top_logprobs=2) for i in range(12)]
    results = []
    for async_scheduling in (False, True):
        engine = make_llm(root, device="cuda", async_scheduling=async_scheduling, num_cache_blocks=30, block_size=8)
        results.append(engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    for sync, overlapped in zip(*results, strict=True):
        assert sync.token_ids == overlapped.token_ids
        for sync_top, async_top in zip(sync.top_logprobs, overlapped.top_logprobs, strict=True):
            assert [t for t, _ in sync_top] == [t for t, _ in async_top]
            assert max(abs(a - b) for (_, a), (_, b) in zip(sync_top, async_top, strict=True)) <= 1e-5


@pytest.mark.gpu
@needs_cuda
def test_cuda_execute_never_synchronizes(root: Path) -> None:
    # The runner's own work (buffers, uploads, graph replays, sampling, result copies) must not synchronize. The
    # eager model forward is excluded: prefill steps index with data-dependent boolean masks.
    engine = make_llm(root, device="cuda", async_scheduling=True)
    runner = engine.engine.runner
    execute, forward = runner.execute, runner.model.forward

    def guarded(scheduler_output: SchedulerOutput) -> StepHandle:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(scheduler_output)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def unguarded_forward(*args: object) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("default")
        try:
            return forward(*args)  # type: ignore[arg-type]
        finally:
            torch.cuda.set_sync_debug_mode("error")

    runner.execute = guarded  # type: ignore[method-assign]
    runner.model.forward = unguarded_forward  # type: ignore[method-assign]
    outputs = engine.generate(prompt_token_ids=random_prompts(6, 2, 20, seed=6), sampling_params=GREEDY, use_tqdm=False)
    assert all(o.ok for o in outputs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_structured_output_is_valid_json(root: Path) -> None:
    import json

    pattern = r'\{"color":"(red|green|blue)","ok":(true|false)\}'
    params = [
        SamplingParams(temperature=1.0, max_tokens=40, seq_seed=i, so_args={"schema_type": "regex", "schema": pattern})
        for i in range(6)
    ]
    for async_scheduling in (False, True):
        engine = make_llm(root, device="cuda", async_scheduling=async_scheduling)
        for output in engine.generate(["JSON:"] * 6, params, use_tqdm=False):
            value = json.loads(output.text)
            assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
