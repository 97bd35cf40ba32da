"""Fake requests, cache specs and a fake model runner for CPU scheduler tests.

The fake model is a deterministic function of the token history, so any run of the scheduler — under cache pressure,
with chunked prefill, preemption or draft tokens — must produce exactly the tokens `reference_generation` does.
The fake runner rebuilds each request's history only from what the scheduler sends it (input tokens, computed
counts, `is_new`), the way a real runner's cache does, and checks the scheduler's block-table deltas.
"""

from __future__ import annotations

import torch

from deepinfer_engine.cache_manager import CacheManager
from deepinfer_engine.config import CacheConfig, SchedulerConfig
from deepinfer_engine.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer_engine.request import Request, StopCriteria
from deepinfer_engine.scheduler import Scheduler
from deepinfer_model.cache_spec import CacheGroupSpec, CacheSpec

VOCAB_SIZE = 1000
EOS = 1


def make_cache_spec(backtracking_tokens: int = 4, window: int = 8) -> CacheSpec:
    """A small spec with every group kind: C1 rows, C2 rows, a SWA ring and a C2 compressor state."""
    return CacheSpec(
        (
            CacheGroupSpec.sliding_window("swa", (0, 1, 2), 16, window, backtracking_tokens, torch.uint8),
            CacheGroupSpec.paged("compressed_c2", (1,), 8, 2, torch.uint8),
            CacheGroupSpec.paged("compressed_c1", (2,), 8, 1, torch.uint8),
            CacheGroupSpec.state("compressor_c2", (1,), 32, 2, backtracking_tokens, torch.float32),
        )
    )


def make_cache_manager(
    num_blocks: int = 64, block_size: int = 16, num_state_slots: int = 65, backtracking_tokens: int = 4
) -> CacheManager:
    config = CacheConfig(block_size=block_size, num_state_slots=num_state_slots)
    return CacheManager(make_cache_spec(backtracking_tokens), config, num_blocks)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 512,
    max_num_draft_tokens: int = 0,
    stop_preempted_requests: bool = False,
    num_state_slots: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        max_num_draft_tokens=max_num_draft_tokens,
        stop_preempted_requests=stop_preempted_requests,
    )
    slots = num_state_slots if num_state_slots is not None else max_num_seqs + 1
    backtracking = max(max_num_draft_tokens + 1, 1)
    return Scheduler(config, make_cache_manager(num_blocks, block_size, slots, backtracking))


def make_request(
    request_id: str | int,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    prompt: list[int] | None = None,
    eos_token_id: int | None = None,
    ignore_eos: bool = False,
    stop_token_ids: frozenset[int] = frozenset(),
) -> Request:
    if prompt is None:
        seed = sum(ord(c) for c in str(request_id))
        prompt = [(7 * i + 3 + 13 * seed) % VOCAB_SIZE for i in range(prompt_len)]
    stop = StopCriteria(
        max_tokens=max_tokens, eos_token_id=eos_token_id, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )
    return Request(str(request_id), prompt, stop)


def fake_next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the history (its length and last three tokens)."""
    tail = history[-3:]
    value = len(history) * 2654435761
    for token in tail:
        value = (value ^ token) * 1000003
    return value % VOCAB_SIZE


def reference_generation(request: Request, max_model_len: int) -> list[int]:
    """Tokens the fake model generates for `request` with no scheduler involved (EOS, max_tokens, max_model_len)."""
    history = request.prompt_token_ids
    output: list[int] = []
    stop = request.stop
    while True:
        token = fake_next_token(history)
        history.append(token)
        output.append(token)
        if token == stop.eos_token_id and not stop.ignore_eos:
            return output
        if token in stop.stop_token_ids or len(history) > max_model_len or len(output) >= stop.max_tokens:
            return output


class FakeRunner:
    """Executes `SchedulerOutput`s with the fake model, verifying draft tokens greedily.

    Args:
        num_draft_tokens: drafts proposed per request after each sampled token (0: no drafter).
        cache_manager: when given, each step's block-table delta is checked against the manager.
    """

    def __init__(self, num_draft_tokens: int = 0, cache_manager: CacheManager | None = None) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.cache_manager = cache_manager
        self.history: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_steps = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for request_id in (*scheduler_output.finished_request_ids, *scheduler_output.preempted_request_ids):
            self.history.pop(request_id, None)
            self.block_tables.pop(request_id, None)
        sampled_all: list[tuple[int, ...]] = []
        drafts_all: list[tuple[int, ...]] = []
        for scheduled in scheduler_output.scheduled_requests:
            request_id = scheduled.request_id
            if scheduled.is_new:
                assert scheduled.num_computed_tokens == 0
                assert scheduled.first_new_block_index == 0
                self.history[request_id] = []
                self.block_tables[request_id] = []
            history = self.history[request_id]
            assert len(history) == scheduled.num_computed_tokens, (request_id, len(history), scheduled)
            table = self.block_tables[request_id]
            del table[scheduled.first_new_block_index :]
            table.extend(scheduled.new_block_ids)
            if self.cache_manager is not None:
                assert tuple(table) == self.cache_manager.block_ids(request_id)
            history.extend(scheduled.input_token_ids)
            if not scheduled.samples_token:
                sampled_all.append(())
                drafts_all.append(())
                continue
            num_drafts = scheduled.num_draft_tokens
            base = len(history) - num_drafts
            emitted: list[int] = []
            for j in range(num_drafts + 1):
                target = fake_next_token(history[: base + j])
                emitted.append(target)
                if j == num_drafts or history[base + j] != target:
                    break
            del history[base + len(emitted) - 1 :]  # drop rejected drafts, as the cache rollback does
            sampled_all.append(tuple(emitted))
            drafts_all.append(self._propose([*history, emitted[-1]]))
        request_ids = tuple(s.request_id for s in scheduler_output.scheduled_requests)
        drafts = tuple(drafts_all) if self.num_draft_tokens else None
        return ModelRunnerOutput(request_ids, tuple(sampled_all), None, drafts)

    def _propose(self, history: list[int]) -> tuple[int, ...]:
        """Drafts that are right for a history-dependent prefix and wrong after it."""
        num_right = fake_next_token(history[::-1]) % (self.num_draft_tokens + 1)
        drafts: list[int] = []
        hypothetical = list(history)
        for j in range(self.num_draft_tokens):
            token = fake_next_token(hypothetical)
            if j >= num_right:
                token = (token + 1) % VOCAB_SIZE
            drafts.append(token)
            hypothetical.append(token)
        return tuple(drafts)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1_000_000) -> dict[str, list[int]]:
    """Drive the scheduler until every request finished; returns the generated tokens per request."""
    tokens: dict[str, list[int]] = {}
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps <= max_steps, "scheduler made no progress"
        scheduler_output = scheduler.schedule()
        runner_output = runner.execute(scheduler_output)
        for output in scheduler.update_from_output(scheduler_output, runner_output):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.completion is not None:
                assert list(output.completion.token_ids) == tokens[output.request_id]
    return tokens
