import dataclasses

import pytest
from factories import FakeRunner, make_request, make_scheduler, reference_generation, run_to_completion

from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.outputs import ModelRunnerOutput, RequestFailure
from deepinfer_engine.request import FinishReason, RequestStatus


def step(scheduler, runner):
    scheduler_output = scheduler.schedule()
    runner_output = runner.execute(scheduler_output)
    return scheduler_output, scheduler.update_from_output(scheduler_output, runner_output)


def test_chunked_prefill_respects_token_budget():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64, block_size=16)
    runner = FakeRunner(cache_manager=scheduler.cache_manager)
    scheduler.add_request(make_request("a", prompt_len=100, max_tokens=2))
    scheduler.add_request(make_request("b", prompt_len=10, max_tokens=2))
    chunks = []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert out.num_batched_tokens <= 32
        chunks.append(
            [
                (s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.samples_token)
                for s in out.scheduled_requests
            ]
        )
    # "a" takes the whole budget in 32-token chunks; "b" waits for budget (FCFS) and gets the leftover of a's
    # last chunk; decodes are served before prefill chunks.
    assert chunks[0] == [("a", 0, 32, False)]
    assert chunks[1] == [("a", 32, 32, False)]
    assert chunks[2] == [("a", 64, 32, False)]
    assert chunks[3] == [("a", 96, 4, True), ("b", 0, 10, True)]
    assert chunks[4] == [("a", 100, 1, True), ("b", 10, 1, True)]
    assert len(chunks) == 5


def test_chunk_input_tokens_and_decode_inputs():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    runner = FakeRunner()
    request = make_request("a", prompt_len=12, max_tokens=3)
    prompt = request.prompt_token_ids
    scheduler.add_request(request)
    out, outputs = step(scheduler, runner)
    assert out.scheduled_requests[0].input_token_ids == tuple(prompt[:8]) and outputs == []
    out, outputs = step(scheduler, runner)
    assert out.scheduled_requests[0].input_token_ids == tuple(prompt[8:])
    (first,) = outputs
    out, outputs = step(scheduler, runner)
    assert out.scheduled_requests[0].input_token_ids == first.new_token_ids  # decode feeds the last sampled token
    assert out.scheduled_requests[0].num_computed_tokens == 12


def test_decode_matches_reference():
    scheduler = make_scheduler()
    runner = FakeRunner(cache_manager=scheduler.cache_manager)
    requests = [make_request(i, prompt_len=3 + 5 * i, max_tokens=7 + i) for i in range(6)]
    expected = {r.request_id: reference_generation(r, 512) for r in requests}
    for request in requests:
        scheduler.add_request(request)
    assert run_to_completion(scheduler, runner) == expected
    assert scheduler.cache_manager.num_free_blocks == scheduler.cache_manager.num_usable_blocks


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner()
    for i in range(5):
        scheduler.add_request(make_request(i, prompt_len=4, max_tokens=3))
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.scheduled_requests] == ["0", "1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 3
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, runner)
        assert scheduler.num_running <= 2


def test_preemption_victim_is_the_request_with_most_outputs_and_it_recomputes():
    # 3 usable blocks of 4 tokens. "a" (prompt 4) runs first; "b" (prompt 3) joins one step later, so "a" always
    # has more outputs. At step 4 "b" is served first (fewer outputs) and needs a block: "a" is the victim.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(cache_manager=scheduler.cache_manager)
    a = make_request("a", prompt_len=4, max_tokens=6)
    b = make_request("b", prompt_len=3, max_tokens=4)
    expected = {"a": reference_generation(a, 512), "b": reference_generation(b, 512)}
    scheduler.add_request(a)
    tokens = {"a": [], "b": []}

    def collect(outputs):
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)

    collect(step(scheduler, runner)[1])
    scheduler.add_request(b)
    collect(step(scheduler, runner)[1])
    collect(step(scheduler, runner)[1])
    assert (a.num_output_tokens, b.num_output_tokens) == (3, 2)
    assert scheduler.cache_manager.num_free_blocks == 0
    out, outputs = step(scheduler, runner)
    collect(outputs)
    assert out.preempted_request_ids == ("a",)
    assert [s.request_id for s in out.scheduled_requests] == ["b"]
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0 and a.num_preemptions == 1
    assert not scheduler.cache_manager.has_request("a")
    # "a" waits (its 7 tokens need 2 blocks) until "b" finishes, then recomputes prompt + outputs at once.
    resumed = None
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, runner)
        collect(outputs)
        for s in out.scheduled_requests:
            if s.request_id == "a" and resumed is None:
                resumed = s
    assert resumed.is_new and resumed.num_computed_tokens == 0 and resumed.first_new_block_index == 0
    assert a.num_preemptions == 1
    assert resumed.input_token_ids == tuple(expected["a"][:0] + a.prompt_token_ids + expected["a"][:3])
    assert tokens == expected


def test_stop_preempted_requests_finishes_the_victim():
    scheduler = make_scheduler(
        num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16, stop_preempted_requests=True
    )
    runner = FakeRunner()
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(make_request("b", prompt_len=3, max_tokens=4))
    step(scheduler, runner)
    step(scheduler, runner)
    out, outputs = step(scheduler, runner)
    assert out.preempted_request_ids == ("a",)
    finished = {o.request_id: o for o in outputs if o.finished}
    assert finished["a"].finish_reason is FinishReason.INSUFFICIENT_SYSTEM_RESOURCE
    assert len(finished["a"].completion.token_ids) == 3
    assert scheduler.num_waiting == 0
    run_outputs(scheduler, runner)
    assert scheduler.cache_manager.num_free_blocks == scheduler.cache_manager.num_usable_blocks


def test_request_preempts_itself_when_no_other_candidate():
    # 3 usable blocks of 4 tokens. "y" (prompt 7) holds 2 blocks, "x" (prompt 1) joins and takes the third. Next
    # step "x" (fewer outputs) is served first; "y" then needs a block and is the only unscheduled candidate.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    runner = FakeRunner(cache_manager=scheduler.cache_manager)
    y = make_request("y", prompt_len=7, max_tokens=5)
    x = make_request("x", prompt_len=1, max_tokens=3)
    expected = {"y": reference_generation(y, 512), "x": reference_generation(x, 512)}
    scheduler.add_request(y)
    outputs = step(scheduler, runner)[1]
    scheduler.add_request(x)
    outputs += step(scheduler, runner)[1]
    assert scheduler.cache_manager.num_free_blocks == 0
    out, more = step(scheduler, runner)
    outputs += more
    assert out.preempted_request_ids == ("y",)
    assert [s.request_id for s in out.scheduled_requests] == ["x"]
    outputs += run_outputs(scheduler, runner)
    tokens = {}
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == expected


@pytest.mark.parametrize("position", [0, 2, 4])
def test_eos_stops_and_is_emitted(position):
    probe = make_request("a", prompt_len=5, max_tokens=8)
    reference = reference_generation(probe, 512)
    eos = reference[position]
    assert eos not in reference[:position]
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=8, eos_token_id=eos))
    outputs = []
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1]
    last = outputs[-1]
    assert last.finish_reason is FinishReason.STOP and last.completion.stop_reason is None
    assert list(last.completion.token_ids) == reference[: position + 1]


def test_ignore_eos_runs_to_max_tokens():
    probe = make_request("a", prompt_len=5, max_tokens=8)
    reference = reference_generation(probe, 512)
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=8, eos_token_id=reference[1], ignore_eos=True))
    tokens = run_to_completion(scheduler, FakeRunner())
    assert tokens["a"] == reference


def test_stop_token_id_reports_stop_reason():
    probe = make_request("a", prompt_len=5, max_tokens=8)
    reference = reference_generation(probe, 512)
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=8, stop_token_ids=frozenset({reference[3]})))
    runner = FakeRunner()
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1]
    completion = outputs[-1].completion
    assert completion.finish_reason is FinishReason.STOP
    assert completion.stop_reason == reference[3]
    assert list(completion.token_ids) == reference[: reference.index(reference[3]) + 1]


def test_max_tokens_gives_length():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=3))
    runner = FakeRunner()
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1]
    assert [len(o.new_token_ids) for o in outputs] == [1, 1, 1]
    assert [o.finished for o in outputs] == [False, False, True]
    assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].num_output_tokens == 3


def test_max_model_len_allows_one_token_past_it():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add_request(make_request("a", prompt_len=8, max_tokens=100))
    tokens = run_to_completion(scheduler, FakeRunner())
    assert len(tokens["a"]) == 3  # total length 11 > 10 finishes


def test_eos_wins_over_length_on_the_same_token():
    probe = make_request("a", prompt_len=5, max_tokens=3)
    reference = reference_generation(probe, 512)
    assert reference[2] not in reference[:2]
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=3, eos_token_id=reference[2]))
    outputs = run_outputs(scheduler)
    assert len(outputs[-1].completion.token_ids) == 3
    assert outputs[-1].finish_reason is FinishReason.STOP


def test_stop_string_finish_keeps_the_tokens_before_the_match():
    # The engine's output processor finds a stop string after a step and ends the request through finish_request.
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=6, max_tokens=10))
    runner = FakeRunner()
    outputs = []
    while scheduler.has_unfinished_requests():
        new = step(scheduler, runner)[1]
        outputs += new
        if any(o.request_id == "a" and o.num_output_tokens == 5 and not o.finished for o in new):
            scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED, stop_reason="STOP!", num_output_tokens=4)
    final = {o.request_id: o.completion for o in outputs if o.finished}
    assert final["a"].finish_reason is FinishReason.STOP and final["a"].stop_reason == "STOP!"
    assert list(final["a"].token_ids) == [t for o in outputs if o.request_id == "a" for t in o.new_token_ids][:4]
    assert final["b"].finish_reason is FinishReason.LENGTH
    assert scheduler.cache_manager.num_free_blocks == scheduler.cache_manager.num_usable_blocks


def test_a_request_the_runner_failed_keeps_no_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=5, max_tokens=10))
    first = scheduler.schedule()
    runner_output = FakeRunner().execute(first)
    failure = RequestFailure(RequestStatus.FINISHED_ERROR, "no token could be sampled")
    runner_output = dataclasses.replace(
        runner_output,
        sampled_token_ids=((), runner_output.sampled_token_ids[1]),
        logprobs=None,
        failures={"a": failure},
    )
    outputs = {o.request_id: o for o in scheduler.update_from_output(first, runner_output)}
    assert outputs["a"].finish_reason is FinishReason.ERROR
    assert outputs["a"].completion.token_ids == () and outputs["a"].completion.error_message == failure.message
    assert outputs["b"].new_token_ids == runner_output.sampled_token_ids[1] and not outputs["b"].finished
    assert not scheduler.cache_manager.has_request("a")


def test_prompt_too_long_or_too_big_is_ignored():
    scheduler = make_scheduler(max_model_len=20, num_blocks=3, block_size=4)  # 2 usable blocks = 8 positions
    scheduler.add_request(make_request("long", prompt_len=21))
    scheduler.add_request(make_request("big", prompt_len=6, max_tokens=4))  # needs 9 positions
    scheduler.add_request(make_request("ok", prompt_len=6, max_tokens=3))
    assert scheduler.num_waiting == 1
    outputs = run_outputs(scheduler)
    ignored = [o for o in outputs if o.finish_reason is FinishReason.PROMPT_LENGTH_EXCEEDED]
    assert sorted(o.request_id for o in ignored) == ["big", "long"]
    assert all(o.new_token_ids == () and o.completion.metrics.first_scheduled_step is None for o in ignored)


def run_outputs(scheduler, runner=None):
    runner = runner or FakeRunner()
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, runner)[1]
    return outputs


def test_abort_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=4, max_tokens=10))
    step(scheduler, runner)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert scheduler.cache_manager.num_free_blocks == scheduler.cache_manager.num_usable_blocks
    out, outputs = step(scheduler, runner)
    assert out.is_empty and out.finished_request_ids == {"a", "b"}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.ABORT), ("b", FinishReason.ABORT)]
    assert not scheduler.has_unfinished_requests()
    with pytest.raises(KeyError, match="no unfinished request 'a'"):
        scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)


def test_error_finish_carries_message():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    scheduler.finish_request("a", RequestStatus.FINISHED_STRUCTURED_OUTPUT_FAILED, "grammar timeout")
    (output,) = run_outputs(scheduler)
    assert output.completion.error_message == "grammar timeout"
    assert output.finish_reason is FinishReason.STRUCTURED_OUTPUT_FAILED
    with pytest.raises(ValueError, match="needs a finished status"):
        scheduler.finish_request("a", RequestStatus.RUNNING)


def test_result_for_a_request_finished_in_flight_is_discarded():
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("a", max_tokens=5))
    out = scheduler.schedule()
    result = runner.execute(out)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(out, result)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", (), FinishReason.ABORT)]


def test_drafts_are_verified_and_rejections_rolled_back():
    scheduler = make_scheduler(max_num_draft_tokens=3, max_num_batched_tokens=256)
    runner = FakeRunner(num_draft_tokens=3, cache_manager=scheduler.cache_manager)
    requests = [make_request(i, prompt_len=5 + 3 * i, max_tokens=40) for i in range(4)]
    expected = {r.request_id: reference_generation(r, 512) for r in requests}
    for request in requests:
        scheduler.add_request(request)
    tokens = {}
    completions = []
    num_steps = 0
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, runner)
        num_steps += 1
        for s in out.scheduled_requests:
            assert s.num_draft_tokens <= 3
        for request in requests:
            if scheduler.cache_manager.has_request(request.request_id):
                assert scheduler.cache_manager.num_tokens(request.request_id) == request.num_computed_tokens
                assert request.num_computed_tokens == request.num_tokens - 1
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.completion:
                completions.append(o.completion)
    assert tokens == expected
    verified = sum(c.metrics.num_verified_draft_tokens for c in completions)
    accepted = sum(c.metrics.num_accepted_draft_tokens for c in completions)
    assert 0 < accepted < verified  # both acceptances and rejections happened
    assert num_steps < 1 + 40  # drafts made decoding take fewer steps than one token each


def test_drafts_never_exceed_remaining_max_tokens():
    scheduler = make_scheduler(max_num_draft_tokens=4)
    runner = FakeRunner(num_draft_tokens=4)
    request = make_request("a", prompt_len=5, max_tokens=3)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        allowed = max(0, 3 - request.num_output_tokens - 1)
        out, _ = step(scheduler, runner)
        for s in out.scheduled_requests:
            assert s.num_draft_tokens <= allowed


def test_update_validates_runner_output():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=1, max_num_draft_tokens=2)
    scheduler.add_request(make_request("a", prompt_len=20, max_tokens=5))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="expected \\('a',\\)"):
        scheduler.update_from_output(out, ModelRunnerOutput(("b",), ((),)))
    with pytest.raises(ValueError, match="partial prompt chunk"):
        scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((5,),)))
    scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((),)))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match=r"expected 1 \.\. 1"):
        scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((5, 6),)))
    scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((5,),), draft_token_ids=((7, 8),)))
    out = scheduler.schedule()
    assert out.scheduled_requests[0].input_token_ids == (5, 7, 8)
    with pytest.raises(ValueError, match="differ from the drafts"):
        scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((7, 9, 1),)))
    outputs = scheduler.update_from_output(out, ModelRunnerOutput(("a",), ((7, 9),), logprobs=((-0.1, -0.2),)))
    assert outputs[0].new_token_ids == (7, 9) and outputs[0].new_logprobs == (-0.1, -0.2)
    assert scheduler.get_request("a").num_computed_tokens == 22  # 20 prompt + 5 + 7; 8 rolled back


def test_runner_output_shape_validation():
    with pytest.raises(ValueError, match="logprobs has 2 entries for 1 requests"):
        ModelRunnerOutput(("a",), ((1,),), logprobs=((0.0,), (0.0,)))
    with pytest.raises(ValueError, match="1 logprobs for 2 sampled tokens"):
        ModelRunnerOutput(("a",), ((1, 2),), logprobs=((0.0,),))


def test_add_request_validation():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a"))
    request = make_request("b")
    request.set_status(RequestStatus.RUNNING)
    with pytest.raises(ValueError, match="must be new"):
        scheduler.add_request(request)


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=15, max_num_draft_tokens=1)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="backtracking tokens"):
        from factories import make_cache_manager

        from deepinfer_engine.scheduler import Scheduler

        Scheduler(SchedulerConfig(max_num_seqs=2, max_num_draft_tokens=5), make_cache_manager(backtracking_tokens=4))


def test_schedules_are_deterministic():
    def trace():
        scheduler = make_scheduler(
            num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, max_num_draft_tokens=2
        )
        runner = FakeRunner(num_draft_tokens=2)
        for i in range(12):
            scheduler.add_request(make_request(i, prompt_len=3 + (i * 7) % 11, max_tokens=4 + i % 5))
        outs = []
        while scheduler.has_unfinished_requests():
            out, _ = step(scheduler, runner)
            outs.append(out)
        return outs

    first = trace()
    assert any(o.preempted_request_ids for o in first)
    assert first == trace()


def test_metrics_count_steps_and_preemptions():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", prompt_len=12, max_tokens=2))
    step(scheduler, runner)  # step 0: first chunk of "a"
    scheduler.add_request(make_request("b", prompt_len=3, max_tokens=1))  # arrives at step 1
    outputs = run_outputs(scheduler, runner)
    metrics = {o.request_id: o.completion.metrics for o in outputs if o.finished}
    a, b = metrics["a"], metrics["b"]
    assert (a.arrival_step, a.first_scheduled_step, a.first_token_step, a.finished_step) == (0, 0, 1, 2)
    assert (b.arrival_step, b.first_scheduled_step, b.first_token_step, b.finished_step) == (1, 3, 3, 3)
    assert a.num_preemptions == b.num_preemptions == 0
    assert a.num_verified_draft_tokens == a.num_accepted_draft_tokens == 0
