"""Scheduler behaviour while a step is in flight: placeholders, deferred frees, in-flight rollback, guards."""

import pytest
from factories import make_cache_manager, make_request, make_scheduler
from test_async_device import FakeDeviceRunner, reference_tokens

from deepinfer_engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput
from deepinfer_engine.request import FinishReason, RequestStatus


class Pipeline:
    """Drives a scheduler by hand, one step ahead, the way `EngineCore` does."""

    def __init__(self, scheduler, runner):
        self.scheduler = scheduler
        self.runner = runner
        self.launched = []

    def launch(self):
        out = self.scheduler.schedule()
        self.launched.append((out, self.runner.execute(out)))
        return out

    def commit(self):
        out, handle = self.launched.pop(0)
        return self.scheduler.update_from_output(out, self.runner.wait(handle))


def ids(scheduler_output):
    return [s.request_id for s in scheduler_output.scheduled_requests]


def test_finished_request_keeps_its_cache_until_its_extra_step_is_committed():
    first, eos = reference_tokens(make_request("a", prompt_len=5, max_tokens=10), 512, None)[:2]
    assert first != eos
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=10, eos_token_id=eos))
    pipe = Pipeline(scheduler, FakeDeviceRunner(block_size=4))
    pipe.launch()
    pipe.launch()
    assert [o.new_token_ids for o in pipe.commit()] == [(first,)]
    extra = pipe.launch()  # scheduled before the EOS of the step in flight is known
    assert ids(extra) == ["a"] and extra.scheduled_requests[0].num_placeholder_tokens == 1
    (last,) = pipe.commit()
    assert last.finish_reason is FinishReason.STOP and last.completion.token_ids == (first, eos)
    assert scheduler.cache_manager.has_request("a")  # the extra step still computes into it
    drain = pipe.launch()
    assert drain.is_empty and drain.finished_request_ids == {"a"}
    assert pipe.commit() == []  # the extra result is discarded
    assert not scheduler.cache_manager.has_request("a")
    assert scheduler.cache_manager.num_free_blocks == scheduler.cache_manager.num_usable_blocks
    pipe.commit()
    pipe.runner.close()


def test_abort_in_flight_defers_the_free_and_discards_the_result():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=10))
    pipe = Pipeline(scheduler, FakeDeviceRunner(block_size=4))
    pipe.launch()
    pipe.launch()
    (first,) = pipe.commit()
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.cache_manager.has_request("a")
    with pytest.raises(ValueError, match="still holds the cache"):
        scheduler.add_request(make_request("a"))
    (aborted,) = pipe.commit()
    assert aborted.finish_reason is FinishReason.ABORT and aborted.new_token_ids == ()
    assert aborted.completion.token_ids == first.new_token_ids
    assert not scheduler.cache_manager.has_request("a")
    pipe.runner.close()


@pytest.mark.parametrize(("prompt_len", "max_tokens", "max_model_len"), [(5, 1, 512), (12, 5, 12)])
def test_request_surely_finished_by_the_step_in_flight_is_not_scheduled_again(prompt_len, max_tokens, max_model_len):
    scheduler = make_scheduler(block_size=4, max_model_len=max_model_len)
    scheduler.add_request(make_request("a", prompt_len=prompt_len, max_tokens=max_tokens))
    pipe = Pipeline(scheduler, FakeDeviceRunner(block_size=4))
    pipe.launch()
    assert pipe.launch().is_empty
    (output,) = pipe.commit()
    assert output.finish_reason is FinishReason.LENGTH
    assert not scheduler.cache_manager.has_request("a")  # nothing in flight computes it: freed at once
    pipe.commit()
    pipe.runner.close()


def test_placeholder_positions_are_optimistic_and_corrected_on_commit():
    scheduler = make_scheduler(block_size=4, max_num_seqs=4, max_num_draft_tokens=3, max_num_batched_tokens=64)
    request = make_request("a", prompt_len=6, max_tokens=50)
    scheduler.add_request(request)
    runner = FakeDeviceRunner(block_size=4, num_draft_tokens=3)
    pipe = Pipeline(scheduler, runner)
    pipe.launch()
    tokens = []
    for _ in range(12):
        out = pipe.launch()
        (scheduled,) = out.scheduled_requests
        assert scheduled.num_placeholder_tokens == 4 and scheduled.num_draft_tokens == 3
        assert scheduled.input_token_ids == (PLACEHOLDER_TOKEN_ID,) * 4
        # Optimistic: every draft of the step in flight accepted, the last sampled token not computed yet.
        assert scheduled.num_computed_tokens == request.num_computed_tokens - 4
        for output in pipe.commit():
            tokens.extend(output.new_token_ids)
        assert scheduler.cache_manager.num_tokens("a") == request.num_computed_tokens
        # After the commit only the step just launched is in flight: the one sampled token plus its drafts.
        assert request.num_computed_tokens == request.num_tokens - 1 + 4
        assert request.num_output_placeholders == 4
    assert request.num_verified_draft_tokens > request.num_accepted_draft_tokens > 0
    assert tokens == reference_tokens(make_request("a", prompt_len=6, max_tokens=50), 512, None)[: len(tokens)]
    runner.close()


def test_request_in_flight_waits_instead_of_preempting_itself():
    # 2 usable blocks of 4 tokens fit "a" (5 + 4 - 1 = 8 positions), but with the step in flight its worst case
    # (every draft accepted) needs a third block: it waits for that step instead of losing its work.
    scheduler = make_scheduler(
        num_blocks=3, block_size=4, max_num_seqs=2, max_num_draft_tokens=3, max_num_batched_tokens=16
    )
    request = make_request("a", prompt_len=5, max_tokens=4)
    scheduler.add_request(request)
    pipe = Pipeline(scheduler, FakeDeviceRunner(block_size=4, num_draft_tokens=3))
    pipe.launch()
    pipe.launch()
    tokens = [t for o in pipe.commit() for t in o.new_token_ids]
    waiting = pipe.launch()
    assert waiting.is_empty and not waiting.preempted_request_ids
    while scheduler.has_unfinished_requests() or pipe.launched:
        tokens += [t for o in pipe.commit() for t in o.new_token_ids]
        if scheduler.has_unfinished_requests():
            assert not pipe.launch().preempted_request_ids
    assert tokens == reference_tokens(make_request("a", prompt_len=5, max_tokens=4), 512, None)
    assert request.num_preemptions == 0
    pipe.runner.close()


def test_preempted_in_flight_result_is_discarded_and_request_recomputes():
    # 3 blocks of 4: "y" (prompt 6) holds 2, "x" (prompt 3) joins a step later and takes the third. When x's decode
    # needs a new block, y (more outputs) is the victim while its own step is still in flight.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    y = make_request("y", prompt_len=6, max_tokens=5)
    x = make_request("x", prompt_len=3, max_tokens=3)
    expected = {"y": reference_tokens(y, 512, None), "x": reference_tokens(x, 512, None)}
    scheduler.add_request(y)
    runner = FakeDeviceRunner(block_size=4)
    pipe = Pipeline(scheduler, runner)
    pipe.launch()
    scheduler.add_request(x)
    tokens = {"x": [], "y": []}
    preempted_in_flight = False
    while scheduler.has_unfinished_requests() or pipe.launched:
        if scheduler.has_unfinished_requests():
            out = pipe.launch()
            in_flight = {i for o, _ in pipe.launched[:-1] for i in ids(o)}
            preempted_in_flight |= bool(in_flight & set(out.preempted_request_ids))
        for output in pipe.commit():
            tokens[output.request_id].extend(output.new_token_ids)
    assert preempted_in_flight and y.num_preemptions == 1
    assert tokens == expected
    runner.close()


def test_steps_commit_in_order_and_at_most_two_are_in_flight():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=5))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert scheduler.num_steps_in_flight == 2
    with pytest.raises(RuntimeError, match=r"steps \[0, 1\] are in flight"):
        scheduler.schedule()
    with pytest.raises(ValueError, match=r"step 1 is not the oldest step in flight \[0, 1\]"):
        scheduler.update_from_output(second, ModelRunnerOutput(("a",), ((3,),)))
    scheduler.update_from_output(first, ModelRunnerOutput(("a",), ((3,),)))
    assert scheduler.num_steps_in_flight == 1
    with pytest.raises(ValueError, match="not the oldest"):
        scheduler.update_from_output(first, ModelRunnerOutput(("a",), ((3,),)))


def test_runner_must_propose_the_drafts_the_next_step_verifies():
    scheduler = make_scheduler(max_num_seqs=4, max_num_draft_tokens=2, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=10))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.scheduled_requests[0].num_draft_tokens == 2
    scheduler.update_from_output(first, ModelRunnerOutput(("a",), ((7,),), draft_token_ids=((8,),)))
    with pytest.raises(ValueError, match="proposed only 1 drafts"):
        scheduler.update_from_output(second, ModelRunnerOutput(("a",), ((9,),)))
    request = scheduler.get_request("a")
    assert request.num_output_tokens == 1 and request.num_output_placeholders == 3  # nothing was committed


def test_rejected_output_changes_nothing():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=4, max_tokens=10))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="request 'b': runner emitted 2 tokens"):
        scheduler.update_from_output(out, ModelRunnerOutput(("a", "b"), ((5,), (6, 7))))
    assert scheduler.get_request("a").num_output_tokens == 0  # "a" was not committed either
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(("a", "b"), ((5,), (6,))))
    assert [o.new_token_ids for o in outputs] == [(5,), (6,)]


def test_cache_rollback_moves_the_reservation_in_flight_down():
    manager = make_cache_manager(block_size=4, backtracking_tokens=4)
    manager.allocate("a", 10)  # step s writes positions 0 .. 9, the last 3 of them drafts
    manager.allocate("a", 14)  # step s+1 reserves 4 more before s is committed
    released = manager.rollback("a", 3, num_tokens_in_flight=4)
    assert manager.num_tokens("a") == 11 and len(released) == 1  # s+1 now writes 7 .. 10: 3 blocks
    manager.allocate("a", 12)  # s+2 reserves 1 token (drafts limited)
    # s+1 rejects its 3 drafts: written up to 11, 3 kept below it; the optimistic 14 was never written.
    manager.rollback("a", 3, num_tokens_in_flight=1)
    assert manager.num_tokens("a") == 9 and len(manager.block_ids("a")) == 3
    with pytest.raises(ValueError, match=r"num_tokens_in_flight must be in 0 \.\. 8, got 9"):
        manager.rollback("a", 0, num_tokens_in_flight=9)
    with pytest.raises(ValueError, match="the rings allow at most 4"):
        manager.rollback("a", 5, num_tokens_in_flight=1)
