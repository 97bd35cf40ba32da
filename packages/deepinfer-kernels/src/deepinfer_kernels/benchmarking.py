"""Timing of GPU ops for the benchmark scripts (library code; only CUDA is timed).

:func:`cuda_time_ms` runs the op once outside any capture (compilation, lazy caches), then, where the op can be
captured, replays a CUDA graph of it so that Python launch cost is excluded; ops that synchronize with the host cannot
be captured and are timed eagerly. The figure is the median of CUDA-event timings.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["cuda_time_ms"]


def _median_event_ms(run: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_time_ms(
    fn: Callable[[], object], *, warmup: int = 5, repeats: int = 50, capture: bool = True
) -> tuple[float, bool]:
    """Median milliseconds per call of ``fn`` on the current CUDA device.

    Args:
        fn: the op, with its inputs bound.
        warmup: untimed calls before timing.
        repeats: timed calls (>= 1).
        capture: try to time CUDA-graph replays of ``fn``.

    Returns:
        (median ms, whether the timed calls were graph replays).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    fn()
    torch.cuda.synchronize()
    if capture:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:  # the op synchronizes with the host: time it eagerly
            torch.cuda.synchronize()
        else:
            return _median_event_ms(graph.replay, warmup, repeats), True
    return _median_event_ms(fn, warmup, repeats), False
