"""Confidence-scheduled verification in the scheduler: how many drafts each decoding request verifies this step
(docs/design/speculative.md, "Confidence-scheduled verification").

With `DEEPINFER_ENABLE_MTP_VARLEN` the scheduler asks `plan_verified_drafts` before it serves its running requests.
Every decoding request (one known token left to compute) is a candidate with the drafts it may verify
(`step_plan.num_allowed_drafts`); the priority of its draft j is the acceptance estimate c₁·…·c_j (the cumulative
product of the drafter's confidences, the probability that drafts 1 … j all survive). The policy
(`deepinfer_sampling.speculative.schedule_num_verified_drafts`) picks the number of extra rows that maximizes
expected emitted tokens per millisecond on the decode cost curve, and hands them to the best estimates; each request's
picks form a prefix of its drafts.

Which confidences: a request whose last sampling step is committed verifies the drafts it holds, so their own
confidences are used. A request whose sampling step is still in flight (asynchronous scheduling) verifies drafts the
host has not seen; the confidences of its previous drafts stand in for them (the reference's CPU stage does the same),
and before any are known every draft gets 1. Prompt chunks in the same step are not part of the choice.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from operator import mul

from deepinfer_engine.config import SchedulerConfig
from deepinfer_engine.request import Request, RequestStatus
from deepinfer_engine.step_plan import num_allowed_drafts, num_remaining
from deepinfer_sampling.speculative import DecodeCostCurve, schedule_num_verified_drafts

__all__ = ["acceptance_priorities", "plan_verified_drafts"]


def acceptance_priorities(request: Request, num_allowed: int) -> list[float]:
    """The acceptance estimate of each of the request's first `num_allowed` drafts (see the module docstring)."""
    confidences = list(request.draft_confidences)
    if request.num_output_placeholders and not confidences:
        confidences = [1.0] * num_allowed
    return list(accumulate(confidences[:num_allowed], mul))


def plan_verified_drafts(requests: Iterable[Request], config: SchedulerConfig, cost: DecodeCostCurve) -> dict[str, int]:
    """Drafts to verify this step per decoding request id (requests not listed are not limited).

    Args:
        requests: the running requests.
        config: the scheduler's limits.
        cost: the decode cost curve (step time by verified tokens).
    """
    ids: list[str] = []
    priorities: list[list[float]] = []
    for request in requests:
        if request.status is not RequestStatus.RUNNING or num_remaining(request) != 1:
            continue
        allowed = num_allowed_drafts(request, config)
        if allowed is None:
            continue  # not planned this step
        ids.append(request.request_id)
        priorities.append(acceptance_priorities(request, max(allowed, 0)))
    if not ids:
        return {}
    counts = schedule_num_verified_drafts(priorities, priorities, cost)
    return dict(zip(ids, counts, strict=True))
