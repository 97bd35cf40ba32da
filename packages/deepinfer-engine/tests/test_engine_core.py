"""EngineCore: the synchronous loop, the overlapped loop, its one-step output lag, and proof of overlap."""

import pytest
from factories import make_request, make_scheduler
from test_async_device import FakeDeviceRunner, reference_tokens

from deepinfer_engine.engine_core import EngineCore
from deepinfer_engine.request import FinishReason


def make_core(async_scheduling, num_draft_tokens=0, gate=False, delay_s=0.0, **scheduler_kwargs):
    scheduler = make_scheduler(block_size=4, max_num_draft_tokens=num_draft_tokens, **scheduler_kwargs)
    runner = FakeDeviceRunner(block_size=4, num_draft_tokens=num_draft_tokens, gate=gate, delay_s=delay_s)
    return EngineCore(scheduler, runner, async_scheduling=async_scheduling)


def run_steps(core):
    steps = []
    while core.has_unfinished_requests():
        steps.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in core.step()])
    core.runner.close()
    return steps


def test_async_outputs_come_one_step_later():
    expected = reference_tokens(make_request("a", prompt_len=5, max_tokens=4), 512, None)
    per_mode = {}
    for async_scheduling in (False, True):
        core = make_core(async_scheduling)
        core.add_request(make_request("a", prompt_len=5, max_tokens=4))
        per_mode[async_scheduling] = run_steps(core)
    sync_steps = [[("a", (t,), None)] for t in expected[:3]] + [[("a", (expected[3],), FinishReason.LENGTH)]]
    assert per_mode[False] == sync_steps
    # Async: nothing to return before the first step lands, and a last call collects the step in flight.
    assert per_mode[True] == [[], *sync_steps, []]


def test_async_drains_and_frees_everything():
    core = make_core(True, num_draft_tokens=2, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(i, prompt_len=3 + 4 * i, max_tokens=6 + 3 * i) for i in range(4)]
    expected = {r.request_id: reference_tokens(r, 512, None) for r in requests}
    for request in requests:
        core.add_request(request)
    tokens = {}
    for step in run_steps(core):
        for request_id, new_tokens, _ in step:
            tokens.setdefault(request_id, []).extend(new_tokens)
    assert tokens == expected
    assert not core.has_step_in_flight and core.scheduler.num_steps_in_flight == 0
    manager = core.scheduler.cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.request_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_through_the_core(async_scheduling):
    core = make_core(async_scheduling)
    core.add_request(make_request("a", prompt_len=5, max_tokens=20))
    core.add_request(make_request("b", prompt_len=5, max_tokens=3))
    tokens = {"a": [], "b": []}
    while len(tokens["a"]) < 2:
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
    core.abort_request("a")
    final = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                final[output.request_id] = output.finish_reason
    core.runner.close()
    assert final == {"a": FinishReason.ABORT, "b": FinishReason.LENGTH}
    assert tokens["a"] == reference_tokens(make_request("a", prompt_len=5, max_tokens=20), 512, None)[:2]
    manager = core.scheduler.cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def gated_run(async_scheduling):
    """Every device step is held until the host either launched the next step or waits for this one."""
    core = make_core(async_scheduling, num_draft_tokens=2, gate=True, max_num_seqs=4, max_num_batched_tokens=64)
    requests = [make_request(i, prompt_len=2 + 3 * i, max_tokens=5 + 2 * i) for i in range(4)]
    for request in requests:
        core.add_request(request)
    tokens = {}
    for step in run_steps(core):
        for request_id, new_tokens, _ in step:
            tokens.setdefault(request_id, []).extend(new_tokens)
    assert tokens == {r.request_id: reference_tokens(r, 512, None) for r in requests}
    runner = core.runner
    order = {event: position for position, event in enumerate(runner.events)}
    return runner, order


def test_scheduler_runs_while_the_device_step_is_busy():
    runner, order = gated_run(async_scheduling=True)
    num_launches = len(runner.released_by)
    assert num_launches > 5
    for index in range(num_launches - 1):
        # Step index+1 was scheduled and launched while step index was on the device (launched, not finished):
        # the device could only finish that step because of the launch, not because the host waited for it.
        assert runner.released_by[index] == "next_launch"
        assert order[("launch", index)] < order[("launch", index + 1)] < order[("device_end", index)]
        assert order[("launch", index + 1)] < order[("wait", index)]
    assert runner.released_by[num_launches - 1] == "host_wait"  # the last step has no successor
    assert runner.num_placeholder_tokens_resolved > 0


def test_synchronous_mode_never_overlaps():
    runner, order = gated_run(async_scheduling=False)
    num_launches = len(runner.released_by)
    assert set(runner.released_by.values()) == {"host_wait"}
    for index in range(num_launches - 1):
        assert order[("device_end", index)] < order[("launch", index + 1)]
    assert runner.num_placeholder_tokens_resolved == 0


def test_core_needs_a_scheduler_with_nothing_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    scheduler.schedule()
    runner = FakeDeviceRunner(block_size=16)
    with pytest.raises(ValueError, match="has 1 steps in flight"):
        EngineCore(scheduler, runner)
    runner.close()


def test_async_is_the_default():
    runner = FakeDeviceRunner(block_size=16)
    assert EngineCore(make_scheduler(), runner).async_scheduling
    runner.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_preempted_requests_and_ignored_requests(async_scheduling):
    core = make_core(
        async_scheduling,
        num_draft_tokens=1,
        num_blocks=9,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=40,
        stop_preempted_requests=True,
    )
    requests = [make_request(i, prompt_len=4 + 3 * i, max_tokens=12) for i in range(6)]
    for request in requests:
        core.add_request(request)
    core.add_request(make_request("long", prompt_len=41))
    tokens = {}
    reasons = {}
    for step in run_steps(core):
        for request_id, new_tokens, reason in step:
            tokens.setdefault(request_id, []).extend(new_tokens)
            if reason is not None:
                reasons[request_id] = reason
    assert reasons.pop("long") is FinishReason.PROMPT_LENGTH_EXCEEDED
    assert FinishReason.INSUFFICIENT_SYSTEM_RESOURCE in reasons.values()
    for request in requests:
        expected = reference_tokens(
            make_request(request.request_id, prompt_len=request.num_prompt_tokens, max_tokens=12), 40, None
        )
        got = tokens.get(request.request_id, [])
        assert got == (expected if reasons[request.request_id] is FinishReason.LENGTH else expected[: len(got)])
    manager = core.scheduler.cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.request_ids
