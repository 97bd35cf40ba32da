"""Confidence-scheduled verification: how many drafts of each request a decode step verifies
(docs/design/speculative.md, "Confidence-scheduled verification").

The drafter's confidence head predicts, per draft position, the probability that the draft is accepted. The cumulative
product ``c₁, c₁c₂, …`` (the *acceptance estimate* of a position) is the expected number of tokens that position adds.
Verifying more rows costs forward time, read from the decode cost curve. Everything here is a pure function.

Stage A (``schedule_num_verified_drafts``, CPU, at schedule time): every (request, position) is a candidate slot whose
priority is its acceptance estimate. Slots are ranked by priority descending, ties by request index then position.
For each candidate total ``T = num_requests + k`` (adding the k best slots of the *budget* ranking) the step time is
``baseline_ms(G) + slope_ms·G + sampler_ms`` with ``G`` the smallest captured CUDA-graph size ``>= T`` (totals above
the largest graph are not considered) and the expected yield is ``num_requests + Σ top-k priorities``; the ``T`` with
the highest yield per millisecond wins (first maximum; ``k = 0`` is always a candidate). The ``T − num_requests``
verified slots are then the best of the *allocation* ranking (the freshest estimates; the budget ranking may use
older ones under asynchronous scheduling). Because estimates never increase with position, each request's verified
slots form a prefix, so the result is a draft count per request.

Stage B (``redistribute_verified_drafts``, device, under asynchronous scheduling): the total chosen by stage A is kept
(it fixed the CUDA graph) but its extra rows are re-assigned using the confidences produced by the step still in
flight; requests absent from that step get estimate 0.

Cost-curve inputs: ``DecodeCostCurve`` holds the profiled graph replay times
(docs/design/speculative.md, "Confidence-scheduled verification"); ``estimate_slope_ms`` and ``estimate_sampler_ms``
turn measured step times into the runtime corrections.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SLOPE_MIN_SAMPLES_PER_SIZE = 10
SAMPLER_WINDOW = 9
SAMPLER_MIN_SAMPLES = 5


@dataclass(frozen=True)
class DecodeCostCurve:
    """Decode step time model.

    Attributes:
        graph_sizes: captured decode CUDA-graph sizes (tokens), strictly increasing.
        baseline_ms: profiled replay time of each graph size, same length.
        slope_ms: per-token correction for context length (``estimate_slope_ms``), >= 0.
        sampler_ms: time of the sampling phase (verification and drafter forward, ``estimate_sampler_ms``), >= 0.
    """

    graph_sizes: tuple[int, ...]
    baseline_ms: tuple[float, ...]
    slope_ms: float = 0.0
    sampler_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.graph_sizes or len(self.graph_sizes) != len(self.baseline_ms):
            raise ValueError(
                f"graph_sizes ({len(self.graph_sizes)}) and baseline_ms ({len(self.baseline_ms)}) must be non-empty "
                "and of equal length"
            )
        if any(b <= a for a, b in zip(self.graph_sizes, self.graph_sizes[1:], strict=False)) or self.graph_sizes[0] < 1:
            raise ValueError(f"graph_sizes must be positive and strictly increasing, got {self.graph_sizes}")
        if any(not (t > 0 and math.isfinite(t)) for t in self.baseline_ms):
            raise ValueError(f"baseline_ms must be finite and > 0, got {self.baseline_ms}")
        if self.slope_ms < 0 or self.sampler_ms < 0:
            raise ValueError(f"slope_ms={self.slope_ms} and sampler_ms={self.sampler_ms} must be >= 0")

    def step_time_ms(self, num_tokens: int) -> float | None:
        """Predicted step time for ``num_tokens`` rows, or None above the largest graph."""
        index = bisect.bisect_left(self.graph_sizes, num_tokens)
        if index == len(self.graph_sizes):
            return None
        size = self.graph_sizes[index]
        return self.baseline_ms[index] + self.slope_ms * size + self.sampler_ms


def acceptance_estimates(confidences: Sequence[Sequence[float]]) -> list[list[float]]:
    """Cumulative products of per-position confidences: ``[c₁, c₁c₂, …]`` per request."""
    return [[math.prod(row[: j + 1]) for j in range(len(row))] for row in confidences]


def _ranked_slots(priorities: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    slots = [(p, request, position) for request, row in enumerate(priorities) for position, p in enumerate(row)]
    slots.sort(key=lambda slot: (-slot[0], slot[1], slot[2]))
    return slots


def schedule_num_verified_drafts(
    budget_priorities: Sequence[Sequence[float]],
    allocation_priorities: Sequence[Sequence[float]],
    cost: DecodeCostCurve | None,
) -> list[int]:
    """Stage A: drafts to verify per request (seqlen_q = 1 + result).

    Args:
        budget_priorities: per request, the acceptance estimate of each draft position held, used to choose the
            total (older estimates under asynchronous scheduling); values in [0, 1], non-increasing per request.
        allocation_priorities: same shape, the latest estimates, used to assign the chosen rows.
        cost: the decode cost curve, or None (no curve: verify every draft held).

    Returns:
        Number of drafts to verify for each request.

    Raises:
        ValueError: when the two priority lists differ in shape, or the requests alone exceed the largest graph.
    """
    shape = [len(row) for row in budget_priorities]
    if shape != [len(row) for row in allocation_priorities]:
        raise ValueError(
            f"budget_priorities {shape} and allocation_priorities {[len(r) for r in allocation_priorities]} "
            "must have the same number of positions per request"
        )
    if cost is None:
        return shape
    num_requests = len(shape)
    if cost.step_time_ms(num_requests) is None:
        raise ValueError(f"{num_requests} requests exceed the largest captured graph size {cost.graph_sizes[-1]}")
    budget = _ranked_slots(budget_priorities)
    best_extra, best_throughput, expected = 0, -1.0, float(num_requests)
    for extra in range(len(budget) + 1):
        if extra > 0:
            expected += budget[extra - 1][0]
        time_ms = cost.step_time_ms(num_requests + extra)
        if time_ms is None:
            break
        throughput = expected / time_ms
        if throughput > best_throughput:
            best_extra, best_throughput = extra, throughput
    counts = [0] * num_requests
    for _, request, _ in _ranked_slots(allocation_priorities)[:best_extra]:
        counts[request] += 1
    return counts


def redistribute_verified_drafts(
    confidences: torch.Tensor, in_previous_step: torch.Tensor, num_extra_rows: int
) -> torch.Tensor:
    """Stage B: re-assign a fixed number of verified-draft rows by the freshest confidences, on the device.

    Args:
        confidences: float32 [B, nextn], per-position confidences (in [0, 1]) from the step in flight.
        in_previous_step: bool [B], whether each request was in that step (others get estimate 0).
        num_extra_rows: total drafts to verify (stage A's total minus B), 0 … B·nextn.

    Returns:
        int64 [B], drafts to verify per request; they sum to ``num_extra_rows``.
    """
    num_requests, nextn = confidences.shape
    if not 0 <= num_extra_rows <= num_requests * nextn:
        raise ValueError(f"num_extra_rows={num_extra_rows} must be in [0, {num_requests * nextn}]")
    if in_previous_step.shape != (num_requests,):
        raise ValueError(f"in_previous_step must be [{num_requests}], got {list(in_previous_step.shape)}")
    estimates = torch.where(in_previous_step[:, None], torch.cumprod(confidences, dim=1), 0.0).flatten()
    # Stable descending sort: ties keep flat (request-major) order, so each request's picks are a prefix.
    order = torch.sort(estimates, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return (rank < num_extra_rows).view(num_requests, nextn).sum(dim=1)


def estimate_slope_ms(samples: Sequence[tuple[int, float]]) -> float:
    """Per-token context-length correction from recent decode steps.

    Args:
        samples: ``(graph_size, (measured_ms − baseline_ms(graph_size)) / graph_size)`` of recent steps (the caller
            keeps the last 5000).

    Returns:
        Median over graph sizes (with at least 10 samples) of each size's median, clipped at 0; 0 without data.
    """
    by_size: dict[int, list[float]] = {}
    for size, per_token_ms in samples:
        by_size.setdefault(size, []).append(per_token_ms)
    medians = [statistics.median(v) for v in by_size.values() if len(v) >= SLOPE_MIN_SAMPLES_PER_SIZE]
    return max(0.0, statistics.median(medians)) if medians else 0.0


def estimate_sampler_ms(same_batch_size_ms: Sequence[float], all_steps_ms: Sequence[float]) -> float:
    """Sampling-phase time: median of the last 9 measurements for this batch size (at least 5 needed), else of the
    last 9 over all steps, else 0.

    Args:
        same_batch_size_ms: measured sampling-phase times of steps with the same number of requests, oldest first.
        all_steps_ms: measured sampling-phase times of all steps, oldest first.
    """
    for history in (same_batch_size_ms, all_steps_ms):
        recent = list(history[-SAMPLER_WINDOW:])
        if len(recent) >= SAMPLER_MIN_SAMPLES:
            return statistics.median(recent)
    return 0.0
