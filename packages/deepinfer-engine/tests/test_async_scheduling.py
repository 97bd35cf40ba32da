"""Asynchronous scheduling gives the outputs of synchronous scheduling, token for token.

Hundreds of random requests (greedy and seeded sampling; EOS, stop-token, stop-string, max_tokens and max_model_len
stops; draft tokens) run through `EngineCore` twice, under cache pressure (preemption with recompute) and with
aborts issued between steps — in asynchronous mode while the aborted request is usually in flight. The fake device
(test_async_device.py) resolves placeholders from its own memory and checks every KV read against its shadow.
"""

import dataclasses
import random

import pytest
from factories import make_request, make_scheduler
from test_async_device import FakeDeviceRunner, reference_tokens

from deepinfer_engine.engine_core import EngineCore
from deepinfer_engine.request import FinishReason, RequestStatus

MAX_MODEL_LEN = 160
BLOCK_SIZE = 8


def stops_at(token):
    """The stop string "<23>" of requests that have one appears with any token divisible by 23."""
    return token % 23 == 0


def reference(spec):
    request_id, kwargs, sampling_seed, _, stop_string = spec
    checker = stops_at if stop_string else None
    return reference_tokens(make_request(request_id, **kwargs), MAX_MODEL_LEN, sampling_seed, checker)


def random_specs(seed, count):
    """(request id, request kwargs, sampling seed, abort after this many tokens or None, has a stop string)."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        request_id = f"r{i}"
        long_prompt = rng.random() < 0.05
        prompt_len = rng.randint(MAX_MODEL_LEN - 12, MAX_MODEL_LEN - 2) if long_prompt else rng.randint(1, 60)
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        max_tokens = 50 if long_prompt else rng.randint(1, 40)
        sampling_seed = rng.randrange(2**32) if rng.random() < 0.5 else None
        kwargs = {"prompt": prompt, "max_tokens": max_tokens}
        probe = reference_tokens(make_request(request_id, **kwargs), MAX_MODEL_LEN, sampling_seed)
        kind = rng.random()
        if kind < 0.3:
            kwargs["eos_token_id"] = probe[rng.randrange(len(probe))]
        elif kind < 0.4:
            kwargs["stop_token_ids"] = frozenset({probe[rng.randrange(len(probe))]})
        elif kind < 0.5:
            kwargs["eos_token_id"] = probe[0]
            kwargs["ignore_eos"] = True
        stop_string = 0.5 <= kind < 0.6
        abort_after = rng.randint(0, 10) if rng.random() < 0.1 else None
        specs.append((request_id, kwargs, sampling_seed, abort_after, stop_string))
    return specs


def run(specs, async_scheduling, num_draft_tokens, num_blocks, seed):
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_model_len=MAX_MODEL_LEN,
        max_num_draft_tokens=num_draft_tokens,
        num_state_slots=24,
    )
    seeds = {spec[0]: spec[2] for spec in specs}
    stop_string_ids = {spec[0] for spec in specs if spec[4]}

    runner = FakeDeviceRunner(BLOCK_SIZE, num_draft_tokens, seeds, delay_s=0.0002)
    core = EngineCore(scheduler, runner, async_scheduling=async_scheduling)
    rng = random.Random(seed)
    pending = list(specs)
    abort_after = {spec[0]: spec[3] for spec in specs if spec[3] is not None}
    tokens = {}
    finished = {}
    num_aborts_in_flight = 0
    manager = scheduler.cache_manager
    while pending or core.has_unfinished_requests():
        for _ in range(rng.randint(0, 6)):
            if pending:
                request_id, kwargs, *_ = pending.pop(0)
                core.add_request(make_request(request_id, **kwargs))
        for request_id, limit in list(abort_after.items()):
            if request_id not in finished and len(tokens.get(request_id, ())) >= limit:
                try:
                    request = scheduler.get_request(request_id)
                except KeyError:
                    continue  # not added yet
                num_aborts_in_flight += request.num_output_placeholders > 0
                core.abort_request(request_id)
                del abort_after[request_id]
        for output in core.step():
            new = list(output.new_token_ids)
            completion = output.completion
            # What the engine's output processor does with stop strings (deepinfer_engine.output_processor).
            hit = next((j for j, t in enumerate(new) if stops_at(t)), None)
            if output.request_id in stop_string_ids and hit is not None:
                stop_string_ids.discard(output.request_id)
                num_kept = output.num_output_tokens - len(new) + hit + 1
                new = new[: hit + 1]
                if completion is None:
                    scheduler.finish_request(
                        output.request_id,
                        RequestStatus.FINISHED_STOPPED,
                        stop_reason="<23>",
                        num_output_tokens=num_kept,
                    )
                elif completion.finish_reason is FinishReason.LENGTH or len(completion.token_ids) > num_kept:
                    completion = dataclasses.replace(
                        completion,
                        token_ids=completion.token_ids[:num_kept],
                        finish_reason=FinishReason.STOP,
                        stop_reason="<23>",
                    )
            tokens.setdefault(output.request_id, []).extend(new)
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = completion
        held = [b for rid in manager.request_ids for b in manager.block_ids(rid)]
        assert len(held) == len(set(held)) and len(held) + manager.num_free_blocks == manager.num_usable_blocks
    runner.close()
    assert not manager.request_ids  # nothing leaked: every block and state slot is back
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_state_slots == manager.config.num_state_slots - 1
    assert scheduler.num_steps_in_flight == 0
    for request_id, completion in finished.items():
        assert list(completion.token_ids) == tokens.get(request_id, [])
    in_flight = (num_aborts_in_flight, runner.num_preempted_in_flight)
    return tokens, finished, runner.num_placeholder_tokens_resolved, in_flight


@pytest.mark.parametrize("num_draft_tokens", [0, 3])
def test_async_outputs_equal_sync_outputs_under_pressure_with_stops_and_aborts(num_draft_tokens):
    specs = random_specs(num_draft_tokens, 300)
    sync_tokens, sync_finished, sync_placeholders, _ = run(specs, False, num_draft_tokens, 50, seed=5)
    async_tokens, async_finished, async_placeholders, in_flight = run(specs, True, num_draft_tokens, 50, 5)

    assert set(sync_finished) == set(async_finished) == {spec[0] for spec in specs}
    assert sync_placeholders == 0 and async_placeholders > 0
    num_aborts_in_flight, num_preempted_in_flight = in_flight
    assert num_aborts_in_flight > 0 and num_preempted_in_flight > 0
    reasons = set()
    for spec in specs:
        request_id, abort_after = spec[0], spec[3]
        expected = reference(spec)
        for tokens, finished in ((sync_tokens, sync_finished), (async_tokens, async_finished)):
            got = tokens.get(request_id, [])
            reason = finished[request_id].finish_reason
            reasons.add(reason)
            if reason is FinishReason.ABORT:
                assert abort_after is not None and len(got) >= abort_after and got == expected[: len(got)]
            else:
                assert got == expected, (request_id, reason)
        if abort_after is None:
            assert async_tokens.get(request_id) == sync_tokens.get(request_id)
            assert async_finished[request_id].finish_reason is sync_finished[request_id].finish_reason
            assert async_finished[request_id].stop_reason == sync_finished[request_id].stop_reason
    assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT} <= reasons
    assert any(c.stop_reason == "<23>" for c in async_finished.values())
    for finished in (sync_finished, async_finished):
        assert sum(c.metrics.num_preemptions for c in finished.values()) > 10
        if num_draft_tokens:
            accepted = sum(c.metrics.num_accepted_draft_tokens for c in finished.values())
            verified = sum(c.metrics.num_verified_draft_tokens for c in finished.values())
            assert 0 < accepted < verified
    max_model_len_hits = [
        request_id
        for request_id, c in async_finished.items()
        if c.finish_reason is FinishReason.LENGTH and len(c.prompt_token_ids) + len(c.token_ids) > MAX_MODEL_LEN
    ]
    assert max_model_len_hits


def test_async_without_cache_pressure_matches_pressured_run():
    specs = [spec for spec in random_specs(11, 120) if spec[3] is None]
    roomy, roomy_finished, _, _ = run(specs, True, 2, 2000, seed=1)
    pressured, pressured_finished, _, _ = run(specs, True, 2, 45, seed=2)
    assert sum(c.metrics.num_preemptions for c in roomy_finished.values()) == 0
    assert sum(c.metrics.num_preemptions for c in pressured_finished.values()) > 0
    assert roomy == pressured
