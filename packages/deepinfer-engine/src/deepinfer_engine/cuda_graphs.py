"""CUDA graphs of decode forwards: capture by padded size, replay on the runner's persistent buffers.

Only pure decode steps are replayed (every request computes one token, no prompt-logprob rows); prefill and mixed
steps run eagerly. A decode forward of the model has static shapes and never synchronizes with the host when its
`ForwardBatch` says `max_query_len == 1` (`deepinfer_model.state.StepMetadata.is_decode`) and gives a fixed
`max_context_len` bound, which sizes the indexer; so one capture per size serves every step of that size. CPU
engines, FP32-precision engines and expert-parallel ranks never capture (`DeepseekV41ForCausalLM.supports_graphs`).

Sizes are in tokens (= requests for decode): the powers of two below the interval, every multiple of the interval
below the maximum, then the maximum (`graph_sizes`; interval `DEEPINFER_CUDAGRAPH_BATCH_SIZE_INTERVAL`, maximum
`max_num_seqs`). A step of R requests replays the smallest graph G ≥ R after `StepBuffers.pad_decode` filled rows
R … G − 1 with placeholder requests. Graphs are captured largest first into one shared memory pool; every graph reads
the same device buffers (`StepBuffers.batch`), so a replay only needs the usual upload first.

A graph's logits output [G, V] is overwritten by the next replay of any graph; the runner launches a step's sampling
on the same stream before it launches the next forward, so stream order protects it.
"""

from __future__ import annotations

import torch

from deepinfer_engine.input_batch import HostStep, StepBuffers
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.state import ModelState

__all__ = ["DecodeGraphs", "graph_sizes"]


def graph_sizes(max_size: int, interval: int) -> tuple[int, ...]:
    """Decode graph sizes (docs/design/scheduler.md, "CUDA graphs"), ascending.

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


class DecodeGraphs:
    """The captured decode forwards of one runner.

    Args:
        model: the model (local experts, on a CUDA device).
        state: its cache pools.
        buffers: the runner's persistent buffers (at least `max(sizes)` requests and tokens).
        sizes: graph sizes.
        max_context_len: the context bound every graph is captured with (≥ any step's longest context).
    """

    def __init__(
        self,
        model: DeepseekV41ForCausalLM,
        state: ModelState,
        buffers: StepBuffers,
        sizes: tuple[int, ...],
        max_context_len: int,
    ) -> None:
        if not sizes or max(sizes) > min(buffers.max_num_requests, buffers.max_num_tokens):
            raise ValueError(
                f"graph sizes {sizes} must be non-empty and fit the step buffers ({buffers.max_num_requests} "
                f"requests, {buffers.max_num_tokens} tokens)"
            )
        self.model = model
        self.state = state
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes))
        self.max_context_len = max_context_len
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (a warm-up forward precedes each capture)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.buffers.device)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                batch = self.buffers.placeholder_batch(size, self.max_context_len)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.model(batch, self.state)  # warm-up: lazy caches and kernel selection happen outside
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.model(batch, self.state)
                self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.buffers.device)

    def size_for(self, num_requests: int, max_context_len: int) -> int | None:
        """The smallest captured size holding `num_requests` decode requests, or None (run eagerly)."""
        if max_context_len > self.max_context_len:
            return None
        return next((size for size in self.sizes if size >= num_requests and size in self._graphs), None)

    def replay(self, host: HostStep, num_requests: int, num_logits: int, size: int) -> torch.Tensor:
        """Pad the filled decode step to `size`, upload it and replay that graph.

        Args:
            host: the step's filled host buffers (one token per request).
            num_requests: R, real requests (= tokens).
            num_logits: logits rows the step needs (`host.logits_rows[:num_logits]`).
            size: a size from `size_for`.

        Returns:
            [num_logits, V] fp32 logits, a view of the graph's output (valid until the next replay).
        """
        self.buffers.pad_decode(host, num_requests, num_logits, size)
        self.buffers.upload(host, size, size, size, 1, self.max_context_len)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:num_logits]

    def close(self) -> None:
        """Release every graph (before process-group teardown)."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
