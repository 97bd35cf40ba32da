"""Decode CUDA graphs: graph sizes, placeholder padding of the step buffers, when graphs are (not) used, and on CUDA
(gpu-marked) capture/replay equality with the eager forward, no host synchronization in a replay, and greedy output
with graphs equal to output without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.cuda_graphs import StepGraphs, graph_sizes
from deepinfer_engine.input_batch import HostStep, StepBuffers

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deepinfer-cache")


@pytest.mark.parametrize(
    ("max_size", "interval", "expected"),
    [
        (20, 8, (1, 2, 4, 8, 16, 20)),
        (8, 8, (1, 2, 4, 8)),
        (3, 8, (1, 2, 3)),
        (1, 8, (1,)),
        (12, 1, tuple(range(1, 13))),
        (10, 4, (1, 2, 4, 8, 10)),
    ],
)
def test_graph_sizes(max_size: int, interval: int, expected: tuple[int, ...]) -> None:
    assert graph_sizes(max_size, interval) == expected


def test_graph_sizes_follow_the_runtime_example() -> None:
    sizes = graph_sizes(1536, 8)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-2:] == (1528, 1536) and len(sizes) == 3 + 1536 // 8


def test_graph_sizes_reject_bad_bounds() -> None:
    with pytest.raises(ValueError, match="max_size >= 1 and interval >= 1"):
        graph_sizes(0, 8)


def _fill_decode(host: HostStep, requests: list[tuple[int, int, int, list[int]]]) -> None:
    """One decode token per request: (token, position, state slot, block ids)."""
    host.cu_query_lens[0] = 0
    for index, (token, position, slot, blocks) in enumerate(requests):
        host.token_ids[index] = token
        host.token_slots[index] = slot
        host.positions[index] = position
        host.cu_query_lens[index + 1] = index + 1
        host.context_lens[index] = position + 1
        host.state_slots[index] = slot
        host.block_table[index].zero_()
        host.block_table[index, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        host.logits_rows[index] = index


def test_pad_decode_fills_placeholders_over_stale_rows() -> None:
    buffers = StepBuffers(8, 8, 4, 6, 32, ngram_context=2, device=torch.device("cpu"))
    host = buffers.host_set(0)
    _fill_decode(host, [(9, 3, 1, [1]), (8, 5, 2, [2]), (7, 2, 3, [3]), (6, 1, 4, [4])])
    buffers.upload(host, 4, 4, 4, 1, 6)  # a wider earlier step leaves rows 2 and 3 stale
    _fill_decode(host, [(11, 4, 1, [1]), (12, 6, 2, [2, 5])])
    buffers.pad_uniform(host, 2, 1, 2, 4)
    batch = buffers.upload(host, 4, 4, 4, 1, 32)
    assert batch.input_ids.tolist() == [11, 12, 0, 0]
    assert batch.positions.tolist() == [4, 6, 0, 0]
    assert batch.cu_query_lens.tolist() == [0, 1, 2, 3, 4]
    assert batch.context_lens.tolist() == [5, 7, 1, 1]
    assert batch.state_slots.tolist() == [1, 2, 0, 0]
    assert batch.block_table.tolist() == [[1, 0, 0, 0], [2, 5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert batch.logits_indices is not None and batch.logits_indices.tolist() == [0, 1, 0, 0]
    # Engram prefixes come from the token history into the persistent buffer graphs read.
    assert batch.engram_prefix_ids is not None
    assert batch.engram_prefix_ids.data_ptr() == buffers.engram_prefix.data_ptr()
    assert batch.engram_prefix_ids[2:].tolist() == [[-1, -1], [-1, -1]]
    assert batch.engram_prefix_ids[0].tolist() == [int(buffers.history[1, 2]), int(buffers.history[1, 3])]
    assert int(buffers.history[1, 3]) == 9  # written by the earlier step


def test_cpu_engine_never_captures(root: Path) -> None:
    engine = make_llm(root)
    assert engine.engine.config.enforce_eager is False
    assert engine.engine.runner.graphs is None
    assert engine.engine.model.supports_graphs()  # the model could; the CPU device is what rules graphs out


def test_enforce_eager_and_interval_come_from_the_environment(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ENFORCE_EAGER", "1")
    monkeypatch.setenv("DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL", "4")
    engine = make_llm(root)
    assert engine.engine.config.enforce_eager is True
    assert engine.engine.config.cudagraph_batch_size_interval == 4


def test_decode_graphs_reject_sizes_beyond_the_buffers(root: Path) -> None:
    engine = make_llm(root)
    runner = engine.engine.runner
    with pytest.raises(ValueError, match="must be non-empty and fit the step buffers"):
        StepGraphs(runner.model, runner.state, runner.buffers, (1, 2, 64), 64)


# ---- CUDA ---------------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _cuda_engine(root: Path, **kwargs: object) -> LLM:
    return make_llm(root, device="cuda", max_num_seqs=16, **kwargs)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_greedy_output_equals_eager(root: Path) -> None:
    prompts = random_prompts(16, 2, 60, seed=11)
    graphed = _cuda_engine(root, enforce_eager=False)
    assert graphed.engine.runner.graphs is not None and graphed.engine.runner.graphs.sizes == (1, 2, 4, 8, 16)
    eager = _cuda_engine(root, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    with_graphs = graphed.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    without = eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in with_graphs] == [o.token_ids for o in without]


def _prefill(engine: LLM, requests: list[tuple[list[int], int, list[int]]]) -> None:
    """Run each (prompt, state slot, blocks) as one eager prefill step through the runner's buffers."""
    runner = engine.engine.runner
    buffers = runner.buffers
    host = buffers.host_set(1)
    total = 0
    host.cu_query_lens[0] = 0
    for index, (prompt, slot, blocks) in enumerate(requests):
        n = len(prompt)
        host.token_ids[total : total + n] = torch.tensor(prompt)
        host.token_slots[total : total + n] = slot
        host.positions[total : total + n] = torch.arange(n)
        total += n
        host.cu_query_lens[index + 1] = total
        host.context_lens[index] = n
        host.state_slots[index] = slot
        host.block_table[index].zero_()
        host.block_table[index, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        host.logits_rows[index] = total - 1
    longest = max(len(p) for p, _, _ in requests)
    batch = buffers.upload(host, total, len(requests), len(requests), longest, longest)
    with torch.inference_mode():
        runner.model(batch, runner.state)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_equals_eager_forward_and_never_synchronizes(root: Path) -> None:
    engine = _cuda_engine(root, block_size=16)
    runner = engine.engine.runner
    graphs = runner.graphs
    assert graphs is not None
    prompts = random_prompts(3, 20, 45, seed=12)
    blocks = [[1 + r + 3 * b for b in range(4)] for r in range(3)]
    _prefill(engine, [(p, 1 + r, blocks[r]) for r, p in enumerate(prompts)])
    host = runner.buffers.host_set(0)
    for step in range(6):
        _fill_decode(host, [(5 + r, len(p) + step, 1 + r, blocks[r]) for r, p in enumerate(prompts)])
        size = graphs.size_for(3, 1, max(len(p) for p in prompts) + step + 1)
        assert size == 4
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                replayed = graphs.replay(host, 3, 1, 3, size).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.inference_mode():
            # The same padded step again, eagerly, on the buffers the replay uploaded (rewriting the same rows).
            eager = runner.model(runner.buffers.batch(size, size, size, 1, graphs.max_context_len), runner.state)[:3]
        assert torch.equal(replayed, eager), f"decode step {step}"


def _fill_uniform(host: HostStep, requests: list[tuple[list[int], int, int, list[int]]]) -> None:
    """Equal-length queries: (tokens, first position, state slot, block ids) per request; every token a logits row."""
    host.cu_query_lens[0] = 0
    total = 0
    for index, (tokens, start, slot, blocks) in enumerate(requests):
        n = len(tokens)
        host.token_ids[total : total + n] = torch.tensor(tokens)
        host.token_slots[total : total + n] = slot
        host.positions[total : total + n] = torch.arange(start, start + n)
        host.logits_rows[total : total + n] = torch.arange(total, total + n)
        total += n
        host.cu_query_lens[index + 1] = total
        host.context_lens[index] = start + n
        host.state_slots[index] = slot
        host.block_table[index].zero_()
        host.block_table[index, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)


def test_pad_uniform_gives_placeholders_the_step_query_length() -> None:
    buffers = StepBuffers(16, 4, 4, 6, 32, ngram_context=0, device=torch.device("cpu"))
    host = buffers.host_set(0)
    _fill_uniform(host, [([9, 8, 7], 4, 1, [1]), ([6, 5, 4], 10, 2, [2])])
    buffers.pad_uniform(host, 2, 3, 6, 3)
    batch = buffers.upload(host, 9, 3, 9, 3, 32)
    assert batch.input_ids.tolist() == [9, 8, 7, 6, 5, 4, 0, 0, 0]
    assert batch.positions.tolist() == [4, 5, 6, 10, 11, 12, 0, 1, 2]
    assert batch.cu_query_lens.tolist() == [0, 3, 6, 9]
    assert batch.context_lens.tolist() == [7, 13, 3]
    assert batch.state_slots.tolist() == [1, 2, 0]
    assert batch.block_table.tolist()[2] == [0, 0, 0, 0]
    assert batch.logits_indices is not None and batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 0, 0, 0]


def test_placeholder_batch_of_multi_token_requests() -> None:
    buffers = StepBuffers(16, 4, 4, 6, 32, ngram_context=2, device=torch.device("cpu"))
    batch = buffers.placeholder_batch(3, 40, query_len=4)
    assert batch.num_tokens == 12 and batch.num_requests == 3 and batch.max_query_len == 4
    assert batch.positions.tolist() == [0, 1, 2, 3] * 3
    assert batch.context_lens.tolist() == [4, 4, 4]
    assert batch.cu_query_lens.tolist() == [0, 4, 8, 12]


@pytest.mark.gpu
@needs_cuda
def test_cuda_verify_graph_replay_equals_eager_forward_and_never_synchronizes(root: Path) -> None:
    engine = _cuda_engine(root, block_size=16, nextn=3)
    runner = engine.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.query_lens == (1, 4)
    prompts = random_prompts(3, 20, 45, seed=13)
    blocks = [[1 + r + 3 * b for b in range(5)] for r in range(3)]
    _prefill(engine, [(p, 1 + r, blocks[r]) for r, p in enumerate(prompts)])
    host = runner.buffers.host_set(0)
    for step in range(5):
        starts = [len(p) + 4 * step for p in prompts]
        _fill_uniform(host, [([5 + r, 6, 7, 8], s, 1 + r, blocks[r]) for r, s in enumerate(starts)])
        size = graphs.size_for(3, 4, max(starts) + 4)
        assert size == 4
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                replayed = graphs.replay(host, 3, 4, 12, size).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.inference_mode():
            eager = runner.model(runner.buffers.batch(16, size, 16, 4, graphs.max_context_len), runner.state)[:12]
        assert torch.equal(replayed, eager), f"verify step {step}"


@pytest.mark.gpu
@needs_cuda
def test_cuda_draft_graph_replay_equals_eager_draft_forward(root: Path) -> None:
    engine = _cuda_engine(root, block_size=16, nextn=3)
    runner = engine.engine.runner
    assert runner.speculator is not None and runner.speculator.graphs is not None
    graphs = runner.speculator.graphs
    prompts = random_prompts(3, 20, 45, seed=14)
    _prefill(engine, [(p, 1 + r, [1 + r + 3 * b for b in range(5)]) for r, p in enumerate(prompts)])
    device = torch.device("cuda")
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    positions = last[:, None] + 1 + torch.arange(3, device=device)[None, :]
    input_ids = torch.tensor([[11, 3, 3], [12, 3, 3], [13, 3, 3]], device=device)
    rows = torch.arange(3, device=device)
    slots = torch.tensor([1, 2, 3], device=device)
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            replayed = graphs.run(input_ids, positions, rows, slots, 50)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert replayed is not None
        replayed = replayed.clone()
        batch = runner.buffers.draft_batch(input_ids, positions, rows, slots, 50)
        eager = runner.model.draft_forward(batch, runner.state)
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_with_drafts_give_the_eager_greedy_tokens(root: Path) -> None:
    prompts = random_prompts(6, 3, 40, seed=15)
    graphed = _cuda_engine(root, nextn=3)
    runner = graphed.engine.runner
    assert runner.graphs is not None and runner.speculator is not None and runner.speculator.graphs is not None
    replays: list[int] = []
    drafts: list[int] = []
    step_replay, draft_run = runner.graphs.replay, runner.speculator.graphs.run

    def counted_replay(host: HostStep, num_requests: int, query_len: int, num_logits: int, size: int) -> torch.Tensor:
        replays.append(query_len)
        return step_replay(host, num_requests, query_len, num_logits, size)

    def counted_run(*args: object) -> torch.Tensor | None:
        hidden = draft_run(*args)  # type: ignore[arg-type]
        drafts.append(int(hidden is not None))
        return hidden

    runner.graphs.replay = counted_replay  # type: ignore[method-assign]
    runner.speculator.graphs.run = counted_run  # type: ignore[method-assign]
    with_graphs = graphed.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    eager = _cuda_engine(root, nextn=3, enforce_eager=True)
    without = eager.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in with_graphs] == [o.token_ids for o in without]
    assert 4 in replays, "no verify step replayed a graph"
    assert sum(drafts) >= 1, "no draft forward replayed a graph"
