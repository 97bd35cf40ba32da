"""Many random requests under cache pressure: nothing is lost, outputs equal an unpressured run, no block leaks."""

import random

from factories import FakeRunner, make_request, make_scheduler, reference_generation

MAX_MODEL_LEN = 256


def random_requests(seed: int, count: int):
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 120))]
        requests.append(make_request(f"r{i}", prompt=prompt, max_tokens=rng.randint(1, 40), eos_token_id=1))
    return requests


def drive(scheduler, runner, requests, seed):
    """Add requests in random bursts while stepping; check accounting and victim order every step."""
    rng = random.Random(seed)
    pending = list(requests)
    tokens = {}
    finished = {}
    num_preemptions = 0
    manager = scheduler.cache_manager
    live = {}
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 12)):
            if pending:
                request = pending.pop(0)
                live[request.request_id] = request
                scheduler.add_request(request)
        keys = {
            r.request_id: (r.num_output_tokens, int(r.request_id[1:]))
            for r in live.values()
            if manager.has_request(r.request_id)
        }
        out = scheduler.schedule()
        scheduled = {s.request_id for s in out.scheduled_requests}
        victims = [keys[v] for v in out.preempted_request_ids]
        assert victims == sorted(victims, reverse=True)
        bystanders = [k for rid, k in keys.items() if rid not in scheduled and rid not in out.preempted_request_ids]
        if victims and bystanders:
            assert min(victims) >= max(bystanders)
        num_preemptions += len(victims)
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        assert scheduler.num_running <= scheduler.config.max_num_seqs
        for output in scheduler.update_from_output(out, runner.execute(out)):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                assert output.request_id not in finished
                finished[output.request_id] = output.completion
                live.pop(output.request_id)
        held = [b for rid in manager.request_ids for b in manager.block_ids(rid)]
        assert len(held) == len(set(held)) and len(held) + manager.num_free_blocks == manager.num_usable_blocks
        for rid in manager.request_ids:
            assert manager.num_tokens(rid) == live[rid].num_computed_tokens
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_state_slots == manager.config.num_state_slots - 1
    return tokens, finished, num_preemptions


def check_against_reference(tokens, finished, requests):
    assert set(finished) == {r.request_id for r in requests}  # none lost
    fresh = random_requests_by_id(requests)
    for request_id, request in fresh.items():
        assert tokens[request_id] == reference_generation(request, MAX_MODEL_LEN), request_id
        assert list(finished[request_id].token_ids) == tokens[request_id]


def random_requests_by_id(requests):
    return {
        r.request_id: make_request(
            r.request_id, prompt=r.prompt_token_ids, max_tokens=r.stop.max_tokens, eos_token_id=1
        )
        for r in requests
    }


def test_thousand_requests_under_cache_pressure_match_unpressured_run():
    pressured = make_scheduler(
        num_blocks=41, block_size=16, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN
    )
    requests = random_requests(0, 1000)
    tokens, finished, num_preemptions = drive(pressured, FakeRunner(cache_manager=pressured.cache_manager), requests, 1)
    assert num_preemptions > 50
    check_against_reference(tokens, finished, requests)

    roomy = make_scheduler(
        num_blocks=4000, block_size=16, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN
    )
    requests = random_requests(0, 1000)
    roomy_tokens, roomy_finished, roomy_preemptions = drive(roomy, FakeRunner(), requests, 1)
    assert roomy_preemptions == 0
    assert roomy_tokens == tokens
    assert {k: v.finish_reason for k, v in roomy_finished.items()} == {k: v.finish_reason for k, v in finished.items()}


def test_requests_with_drafts_under_cache_pressure():
    scheduler = make_scheduler(
        num_blocks=31,
        block_size=8,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_model_len=MAX_MODEL_LEN,
        max_num_draft_tokens=3,
    )
    requests = random_requests(7, 300)
    runner = FakeRunner(num_draft_tokens=3, cache_manager=scheduler.cache_manager)
    tokens, finished, num_preemptions = drive(scheduler, runner, requests, 8)
    assert num_preemptions > 10
    check_against_reference(tokens, finished, requests)
    assert sum(c.metrics.num_accepted_draft_tokens for c in finished.values()) > 0


def test_random_aborts_leave_no_leak():
    scheduler = make_scheduler(
        num_blocks=25, block_size=8, max_num_seqs=8, max_num_batched_tokens=64, max_num_draft_tokens=2
    )
    runner = FakeRunner(num_draft_tokens=2, cache_manager=scheduler.cache_manager)
    rng = random.Random(3)
    requests = random_requests(11, 200)
    finished = {}
    from deepinfer_engine.request import RequestStatus

    pending = list(requests)
    live = set()
    while pending or scheduler.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            request = pending.pop(0)
            scheduler.add_request(request)
            live.add(request.request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            scheduler.finish_request(victim, RequestStatus.FINISHED_ABORTED)
        out = scheduler.schedule()
        for output in scheduler.update_from_output(out, runner.execute(out)):
            if output.finished:
                finished[output.request_id] = output.finish_reason
                live.discard(output.request_id)
    assert set(finished) == {r.request_id for r in requests}
    assert any(reason.value == "abort" for reason in finished.values())
    manager = scheduler.cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks and not manager.request_ids
