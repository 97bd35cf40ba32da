"""CUDA graphs of uniform step forwards and of DSpark draft forwards: capture by padded size, replay on the runner's
persistent buffers.

Step graphs. A step in which every request computes the same number of tokens ``q`` (decode steps, ``q = 1``; verify
steps where every request checks ``nextn`` drafts, ``q = nextn + 1``) and which has no prompt-logprob rows is replayed.
A uniform forward of the model has static shapes and never synchronizes with the host when its `ForwardBatch` gives
``max_query_len = q`` and a fixed `max_context_len` bound, which sizes the indexer
(`deepinfer_model.state.StepMetadata.is_uniform`); so one capture per (size, ``q``) serves every such step. Prefill,
mixed and non-uniform verify steps (drafts cut short near ``max_tokens``, confidence-scheduled lengths) run eagerly.
CPU engines, FP32-precision engines and expert-parallel ranks never capture (`DeepseekV41ForCausalLM.supports_graphs`).

Sizes are in requests: the powers of two below the interval, every multiple of the interval below the maximum, then
the maximum (`graph_sizes`; interval `DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`, maximum `max_num_seqs`); for ``q > 1``
only the sizes whose ``size · q`` tokens fit the step buffers. A step of R requests replays the smallest graph G ≥ R
after `StepBuffers.pad_uniform` filled requests R … G − 1 with placeholders of ``q`` tokens. Graphs are captured
largest first into one shared memory pool; every graph reads the same device buffers (`StepBuffers.batch`), so a
replay only needs the usual upload first.

A graph's logits output is overwritten by the next replay of any step graph; the runner launches a step's sampling on
the same stream before it launches the next forward, so stream order protects it.

Draft graphs (`DraftGraphs`). The drafter forward of N requests (blocks of ``nextn`` tokens) is replayed from the
smallest captured size ≥ N (spaced by `DEEPINFER_DFLASH_CUDAGRAPH_BATCH_SIZE_INTERVAL`), its inputs copied into static
buffers and padded with placeholder blocks (state slot 0, positions 0 …). They use a memory pool of their own, so a
draft replay never overwrites the step graph's logits that the verification is still reading.
"""

from __future__ import annotations

import torch

from deepinfer_engine.input_batch import HostStep, StepBuffers
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.state import ModelState

__all__ = ["DraftGraphs", "StepGraphs", "capture_graphs", "graph_sizes"]


def graph_sizes(max_size: int, interval: int) -> tuple[int, ...]:
    """Graph sizes in requests (docs/design/scheduler.md, "CUDA graphs"), ascending.

    Args:
        max_size: the largest size (`max_num_seqs`), ≥ 1.
        interval: the spacing of large sizes, ≥ 1 (capped at `max_size`).

    Returns:
        e.g. max 20, interval 8 → (1, 2, 4, 8, 16, 20).
    """
    if max_size < 1 or interval < 1:
        raise ValueError(f"graph sizes need max_size >= 1 and interval >= 1, got {max_size} and {interval}")
    interval = min(interval, max_size)
    sizes = {max_size, *range(interval, max_size, interval)}
    power = 1
    while power < interval:
        sizes.add(power)
        power *= 2
    return tuple(sorted(sizes))


def _check_sizes(sizes: tuple[int, ...], buffers: StepBuffers) -> tuple[int, ...]:
    if not sizes or max(sizes) > min(buffers.max_num_requests, buffers.max_num_tokens):
        raise ValueError(
            f"graph sizes {sizes} must be non-empty and fit the step buffers ({buffers.max_num_requests} "
            f"requests, {buffers.max_num_tokens} tokens)"
        )
    return tuple(sorted(sizes))


class StepGraphs:
    """The captured uniform-step forwards of one runner.

    Args:
        model: the model (local experts, on a CUDA device).
        state: its cache pools.
        buffers: the runner's persistent buffers (at least `max(sizes)` requests and tokens).
        sizes: graph sizes in requests.
        max_context_len: the context bound every graph is captured with (≥ any step's longest context).
        query_lens: the tokens per request captured (1 for decode; also ``nextn + 1`` with drafting).
    """

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        buffers: StepBuffers,
        sizes: tuple[int, ...],
        max_context_len: int,
        query_lens: tuple[int, ...] = (1,),
    ) -> None:
        self.model = model
        self.state = state
        self.buffers = buffers
        self.sizes = _check_sizes(sizes, buffers)
        self.query_lens = tuple(sorted(set(query_lens)))
        if not self.query_lens or self.query_lens[0] < 1:
            raise ValueError(f"query lengths must be >= 1, got {query_lens}")
        self.max_context_len = max_context_len
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every (size, query length) that fits the buffers, largest first, into one memory pool (a warm-up
        forward precedes each capture)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.buffers.device)
        shapes = [(size, q) for q in self.query_lens for size in self.sizes if size * q <= self.buffers.max_num_tokens]
        with torch.inference_mode():
            for size, q in sorted(shapes, key=lambda shape: shape[0] * shape[1], reverse=True):
                batch = self.buffers.placeholder_batch(size, self.max_context_len, q)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.model(batch, self.state)  # warm-up: lazy caches and kernel selection happen outside
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model(batch, self.state)
                self._graphs[(size, q)] = (graph, logits)
        torch.cuda.synchronize(self.buffers.device)

    def size_for(self, num_requests: int, query_len: int, max_context_len: int) -> int | None:
        """The smallest captured size holding `num_requests` requests of `query_len` tokens, or None (eager)."""
        if max_context_len > self.max_context_len:
            return None
        return next((size for size in self.sizes if size >= num_requests and (size, query_len) in self._graphs), None)

    def replay(self, host: HostStep, num_requests: int, query_len: int, num_logits: int, size: int) -> torch.Tensor:
        """Pad the filled uniform step to `size` requests, upload it and replay that graph.

        Args:
            host: the step's filled host buffers (`query_len` tokens per request).
            num_requests: R, real requests.
            query_len: q, tokens per request.
            num_logits: logits rows the step needs (`host.logits_rows[:num_logits]`, at most R · q).
            size: a size from `size_for`.

        Returns:
            [num_logits, V] fp32 logits, a view of the graph's output (valid until the next replay).
        """
        tokens = size * query_len
        self.buffers.pad_uniform(host, num_requests, query_len, num_logits, size)
        self.buffers.upload(host, tokens, size, tokens, query_len, self.max_context_len)
        graph, logits = self._graphs[(size, query_len)]
        graph.replay()
        return logits[:num_logits]

    def close(self) -> None:
        """Release every graph (before process-group teardown)."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()


class DraftGraphs:
    """The captured DSpark draft forwards of one runner (see the module docstring).

    Args:
        model: the model (with DSpark blocks, local experts, on a CUDA device).
        state: its cache pools.
        buffers: the runner's persistent buffers (their block table is what draft blocks read).
        sizes: graph sizes in requests.
        block_len: tokens per draft block (`nextn`).
        max_context_len: the context bound every graph is captured with.
    """

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        buffers: StepBuffers,
        sizes: tuple[int, ...],
        block_len: int,
        max_context_len: int,
    ) -> None:
        self.model = model
        self.state = state
        self.buffers = buffers
        self.sizes = _check_sizes(sizes, buffers)
        self.block_len = block_len
        self.max_context_len = max_context_len
        largest, device = self.sizes[-1], buffers.device
        self._input_ids = torch.zeros((largest, block_len), dtype=torch.int64, device=device)
        self._positions = torch.zeros((largest, block_len), dtype=torch.int64, device=device)
        self._batch_rows = torch.zeros(largest, dtype=torch.int64, device=device)
        self._state_slots = torch.zeros(largest, dtype=torch.int64, device=device)
        self._placeholder_positions = torch.arange(block_len, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _batch(self, size: int) -> ForwardBatch:
        """The draft batch over the first `size` static rows (what a graph of that size reads)."""
        return self.buffers.draft_batch(
            self._input_ids[:size],
            self._positions[:size],
            self._batch_rows[:size],
            self._state_slots[:size],
            self.max_context_len,
        )

    def capture(self) -> None:
        """Capture every size, largest first, into a memory pool of their own."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.buffers.device)
        self._fill(0, self.sizes[-1])
        with torch.inference_mode():
            for size in reversed(self.sizes):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.model.draft_forward(self._batch(size), self.state)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    # Built inside the capture: the batch's derived tensors (context lengths, block-table rows) are
                    # then recomputed from the static inputs at every replay instead of frozen at capture.
                    hidden = self.model.draft_forward(self._batch(size), self.state)
                self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.buffers.device)

    def _fill(self, start: int, end: int) -> None:
        """Placeholder blocks in rows `start … end − 1`: token 0 at positions 0 …, state slot 0, block-table row 0
        (draft blocks attend only their ring and their own keys; their writes land in slot 0)."""
        self._input_ids[start:end] = 0
        self._positions[start:end] = self._placeholder_positions
        self._batch_rows[start:end] = 0
        self._state_slots[start:end] = 0

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch_rows: torch.Tensor,
        state_slots: torch.Tensor,
        max_context_len: int,
    ) -> torch.Tensor | None:
        """Replay the draft forward of N blocks (arguments as `StepBuffers.draft_batch`), or None when no captured
        size holds them (run eagerly then).

        Returns:
            [N · block_len, H] pre-norm hidden of the slots, a view of the graph's output (valid until the next
            draft replay).
        """
        n = input_ids.shape[0]
        size = next((s for s in self.sizes if s >= n and s in self._graphs), None)
        if size is None or max_context_len > self.max_context_len or input_ids.shape[1] != self.block_len:
            return None
        self._input_ids[:n] = input_ids
        self._positions[:n] = positions
        self._batch_rows[:n] = batch_rows
        self._state_slots[:n] = state_slots
        self._fill(n, size)
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden[: n * self.block_len]

    def close(self) -> None:
        """Release every graph."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()


def capture_graphs(
    model: DeepseekV41ForCausalLM,
    state: ModelState,
    buffers: StepBuffers,
    sizes: tuple[tuple[int, ...], tuple[int, ...]],
    max_model_len: int,
    nextn: int,
) -> tuple[StepGraphs, DraftGraphs | None]:
    """Capture a runner's graphs: decode steps, and with drafting (`nextn` > 0) full verify steps and draft forwards.

    Args:
        sizes: the step graphs' sizes and the draft graphs' sizes.

    Returns:
        ``(step graphs, draft graphs or None)``.
    """
    bound = max_model_len + 2
    step_sizes, draft_sizes = sizes
    steps = StepGraphs(model, state, buffers, step_sizes, bound, (1, nextn + 1) if nextn else (1,))
    steps.capture()
    if not nextn:
        return steps, None
    drafts = DraftGraphs(model, state, buffers, draft_sizes, nextn, bound + nextn)
    drafts.capture()
    return steps, drafts
