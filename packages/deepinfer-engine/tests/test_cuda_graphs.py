"""Decode CUDA graphs: graph sizes, placeholder padding of the step buffers, when graphs are (not) used, and on CUDA
(gpu-marked) capture/replay equality with the eager forward, no host synchronization in a replay, and greedy output
with graphs equal to output without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm, random_prompts

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.cuda_graphs import DecodeGraphs, graph_sizes
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
    buffers.pad_decode(host, 2, 2, 4)
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
        DecodeGraphs(runner.model, runner.state, runner.buffers, (1, 2, 64), 64)


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
        size = graphs.size_for(3, max(len(p) for p in prompts) + step + 1)
        assert size == 4
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                replayed = graphs.replay(host, 3, 3, size).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with torch.inference_mode():
            # The same padded step again, eagerly, on the buffers the replay uploaded (rewriting the same rows).
            eager = runner.model(runner.buffers.batch(size, size, size, 1, graphs.max_context_len), runner.state)[:3]
        assert torch.equal(replayed, eager), f"decode step {step}"
