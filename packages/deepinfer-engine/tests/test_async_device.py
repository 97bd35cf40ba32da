"""A fake device for asynchronous-scheduling tests, and tests of the fake device itself.

`FakeDeviceRunner` satisfies `ModelRunnerProtocol`: `execute` only queues the step; a background "device" thread runs
the steps in launch order (optionally after an artificial delay, or held until the host has launched the next step
or waits for this one). The device keeps its own memory: a paged KV cache (token ids per block row, written at the
true positions through the block tables the scheduler sends), per-request histories used as a shadow to check every
KV read, and the previous step's results (emitted tokens, proposed drafts, rejected-draft counts). Placeholder
inputs are resolved from that memory only, and positions are corrected by the previous step's rejections, as the
real runner must do on the GPU.

Sampling: `fake_sample` is the fake model's greedy token, or, for a request with a seed, a token drawn with a random
generator keyed by (request seed, position). Drafts are verified by exact match against that sample, so the emitted
token at a position never depends on how many drafts a step verified or on the batch.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
from factories import VOCAB_SIZE, fake_next_token, make_request, make_scheduler

from deepinfer_engine.outputs import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from deepinfer_engine.request import Request

WAIT_TIMEOUT_S = 30.0


def fake_sample(history: list[int], seed: int | None) -> int:
    """The token sampled after `history`: greedy without a seed, else keyed by (seed, position)."""
    greedy = fake_next_token(history)
    if seed is None:
        return greedy
    offset = random.Random(seed * 1_000_003 + len(history)).randrange(4)
    return (greedy + 7919 * offset) % VOCAB_SIZE


def fake_drafts(history: list[int], seed: int | None, num_drafts: int) -> tuple[int, ...]:
    """Drafts after `history`: right for a history-dependent prefix, wrong after it."""
    num_right = fake_next_token(history[::-1]) % (num_drafts + 1)
    drafts: list[int] = []
    hypothetical = list(history)
    for j in range(num_drafts):
        token = fake_sample(hypothetical, seed)
        if j >= num_right:
            token = (token + 1) % VOCAB_SIZE
        drafts.append(token)
        hypothetical.append(token)
    return tuple(drafts)


def reference_tokens(
    request: Request, max_model_len: int, seed: int | None, stops_at: Callable[[int], bool] | None = None
) -> list[int]:
    """What `request` generates with no scheduler involved (its stop conditions; `stops_at` plays the
    engine's stop-string check on the last token)."""
    history = request.prompt_token_ids
    output: list[int] = []
    stop = request.stop
    while True:
        token = fake_sample(history, seed)
        history.append(token)
        output.append(token)
        if token == stop.eos_token_id and not stop.ignore_eos:
            return output
        if token in stop.stop_token_ids or (stops_at is not None and stops_at(token)):
            return output
        if len(history) > max_model_len or len(output) >= stop.max_tokens:
            return output


@dataclass
class Launch:
    """The handle of one launched step."""

    index: int
    scheduler_output: SchedulerOutput
    future: Future[ModelRunnerOutput] = field(default_factory=Future)


@dataclass(frozen=True)
class _StepResult:
    emitted: tuple[int, ...]
    drafts: tuple[int, ...]
    num_rejected: int


class FakeDeviceRunner:
    """Runs the fake model on a background device thread (see the module docstring).

    Args:
        block_size: tokens per block of the scheduler's cache manager.
        num_draft_tokens: drafts proposed for every sampled request (0: no drafter).
        seeds: request id -> sampling seed; absent or None means greedy.
        delay_s: artificial device time per step.
        gate: hold each device step until the host launched the next one or waits for this one, and record which.
    """

    def __init__(
        self,
        block_size: int,
        num_draft_tokens: int = 0,
        seeds: Mapping[str, int | None] | None = None,
        delay_s: float = 0.0,
        gate: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_draft_tokens = num_draft_tokens
        self.seeds = dict(seeds or {})
        self.delay_s = delay_s
        self.gate = gate
        self.events: list[tuple[str, int]] = []
        self.released_by: dict[int, str] = {}
        self.num_placeholder_tokens_resolved = 0
        self.num_preempted_in_flight = 0  # preempted while the step computing them was still running
        self._in_flight_ids: set[str] = set()
        self._cond = threading.Condition()
        self._num_launched = 0
        self._num_waited = 0
        self._waiting_on = -1
        self._queue: queue.SimpleQueue[Launch | None] = queue.SimpleQueue()
        # Device memory, touched only by the device thread.
        self._kv: dict[int, list[int]] = {}
        self._tables: dict[str, list[int]] = {}
        self._history: dict[str, list[int]] = {}
        self._previous: dict[str, _StepResult] = {}
        self._thread = threading.Thread(target=self._device_loop, name="fake-device", daemon=True)
        self._thread.start()

    def execute(self, scheduler_output: SchedulerOutput) -> Launch:
        with self._cond:
            if self._num_waited < self._num_launched:
                self.num_preempted_in_flight += len(self._in_flight_ids & set(scheduler_output.preempted_request_ids))
            self._in_flight_ids = {s.request_id for s in scheduler_output.scheduled_requests}
            launch = Launch(self._num_launched, scheduler_output)
            self._num_launched += 1
            self.events.append(("launch", launch.index))
            self._cond.notify_all()
        self._queue.put(launch)
        return launch

    def wait(self, handle: Launch) -> ModelRunnerOutput:
        with self._cond:
            assert handle.index == self._num_waited, "steps must be waited for in launch order"
            self._num_waited += 1
            self._waiting_on = handle.index
            self.events.append(("wait", handle.index))
            self._cond.notify_all()
        return handle.future.result(timeout=WAIT_TIMEOUT_S)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=WAIT_TIMEOUT_S)

    def _device_loop(self) -> None:
        while (launch := self._queue.get()) is not None:
            with self._cond:
                self.events.append(("device_start", launch.index))
                if self.gate:
                    released = self._cond.wait_for(
                        lambda i=launch.index: self._num_launched > i + 1 or self._waiting_on >= i, WAIT_TIMEOUT_S
                    )
                    next_launched = self._num_launched > launch.index + 1
                    self.released_by[launch.index] = "next_launch" if next_launched else "host_wait"
                    assert released
            if self.delay_s:
                time.sleep(self.delay_s)
            try:
                launch.future.set_result(self._run(launch.scheduler_output))
            except BaseException as error:  # handed to the host through the future
                launch.future.set_exception(error)
            with self._cond:
                self.events.append(("device_end", launch.index))

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in (*scheduler_output.finished_request_ids, *scheduler_output.preempted_request_ids):
            self._tables.pop(request_id, None)
            self._history.pop(request_id, None)
        results: dict[str, _StepResult] = {}
        sampled_all: list[tuple[int, ...]] = []
        drafts_all: list[tuple[int, ...]] = []
        for scheduled in scheduler_output.scheduled_requests:
            request_id = scheduled.request_id
            if scheduled.is_new:
                self._tables[request_id] = []
                self._history[request_id] = []
            table = self._tables[request_id]
            del table[scheduled.first_new_block_index :]
            table.extend(scheduled.new_block_ids)
            history = self._history[request_id]
            start = scheduled.num_computed_tokens
            inputs = list(scheduled.input_token_ids)
            num_placeholders = scheduled.num_placeholder_tokens
            if num_placeholders:
                assert inputs == [PLACEHOLDER_TOKEN_ID] * num_placeholders
                previous = self._previous[request_id]  # the step launched just before sampled it
                start -= previous.num_rejected
                inputs = [previous.emitted[-1], *previous.drafts[: num_placeholders - 1]]
                assert len(inputs) == num_placeholders
                self.num_placeholder_tokens_resolved += num_placeholders
            else:
                assert PLACEHOLDER_TOKEN_ID not in inputs
            assert len(history) == start, (request_id, len(history), scheduled)
            for offset, token in enumerate(inputs):
                self._write_kv(table, start + offset, token)
            history.extend(inputs)
            if not scheduled.samples_token:
                sampled_all.append(())
                drafts_all.append(())
                continue
            seed = self.seeds.get(request_id)
            num_drafts = scheduled.num_draft_tokens
            base = len(history) - num_drafts
            emitted: list[int] = []
            for j in range(num_drafts + 1):
                target = fake_sample(self._read_history(request_id, table, base + j), seed)
                emitted.append(target)
                if j == num_drafts or history[base + j] != target:
                    break
            del history[base + len(emitted) - 1 :]  # rejected drafts: the cache rollback forgets them
            drafts = fake_drafts([*history, emitted[-1]], seed, self.num_draft_tokens)
            results[request_id] = _StepResult(tuple(emitted), drafts, num_drafts - (len(emitted) - 1))
            sampled_all.append(tuple(emitted))
            drafts_all.append(drafts)
        self._previous = results
        request_ids = tuple(s.request_id for s in scheduler_output.scheduled_requests)
        return ModelRunnerOutput(
            request_ids, tuple(sampled_all), None, tuple(drafts_all) if self.num_draft_tokens else None
        )

    def _write_kv(self, table: list[int], position: int, token: int) -> None:
        block_id = table[position // self.block_size]
        assert block_id != 0
        self._kv.setdefault(block_id, [PLACEHOLDER_TOKEN_ID] * self.block_size)[position % self.block_size] = token

    def _read_history(self, request_id: str, table: list[int], length: int) -> list[int]:
        """The first `length` tokens of the request as the model sees them: its last three and one older token come
        from the KV cache and must match the shadow history."""
        shadow = self._history[request_id]
        older = fake_next_token(shadow[:1]) % length
        for position in {*range(max(0, length - 3), length), older}:
            block_id = table[position // self.block_size]
            assert self._kv[block_id][position % self.block_size] == shadow[position], (request_id, position)
        return shadow[:length]


def drive_synchronously(scheduler, runner, max_steps=10_000):
    tokens = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        out = scheduler.schedule()
        for output in scheduler.update_from_output(out, runner.wait(runner.execute(out))):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("no progress")


@pytest.mark.parametrize("seeded", [False, True])
def test_device_runner_matches_reference_synchronously(seeded):
    scheduler = make_scheduler(block_size=8, max_num_draft_tokens=3, max_num_batched_tokens=64)
    requests = [make_request(i, prompt_len=3 + 5 * i, max_tokens=20) for i in range(6)]
    seeds = {r.request_id: (100 + i if seeded else None) for i, r in enumerate(requests)}
    expected = {r.request_id: reference_tokens(r, 512, seeds[r.request_id]) for r in requests}
    runner = FakeDeviceRunner(block_size=8, num_draft_tokens=3, seeds=seeds)
    for request in requests:
        scheduler.add_request(request)
    assert drive_synchronously(scheduler, runner) == expected
    assert runner.num_placeholder_tokens_resolved == 0
    runner.close()


def test_seeded_sampling_depends_on_seed_and_position_only():
    history = [5, 6, 7, 8]
    assert fake_sample(history, 3) == fake_sample(list(history), 3)
    assert len({fake_sample(history, seed) for seed in range(40)}) > 1
    assert fake_sample(history, None) == fake_next_token(history)


def test_device_resolves_placeholders_from_its_memory():
    scheduler = make_scheduler(block_size=4, max_num_seqs=4, max_num_draft_tokens=2, max_num_batched_tokens=32)
    request = make_request("a", prompt_len=5, max_tokens=30)
    expected = reference_tokens(request, 512, None)
    scheduler.add_request(request)
    runner = FakeDeviceRunner(block_size=4, num_draft_tokens=2)
    first = scheduler.schedule()
    first_launch = runner.execute(first)
    second = scheduler.schedule()  # the prompt step is in flight: the decode step uses placeholders
    (scheduled,) = second.scheduled_requests
    assert scheduled.num_placeholder_tokens == 3 and scheduled.input_token_ids == (PLACEHOLDER_TOKEN_ID,) * 3
    assert scheduled.num_draft_tokens == 2 and scheduled.num_computed_tokens == 5
    second_launch = runner.execute(second)
    outputs = scheduler.update_from_output(first, runner.wait(first_launch))
    assert [o.new_token_ids for o in outputs] == [tuple(expected[:1])]
    outputs = scheduler.update_from_output(second, runner.wait(second_launch))
    (output,) = outputs
    assert list(output.new_token_ids) == expected[1 : 1 + len(output.new_token_ids)]
    assert runner.num_placeholder_tokens_resolved == 3
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.cache_manager.num_tokens("a") == request.num_computed_tokens
    runner.close()
