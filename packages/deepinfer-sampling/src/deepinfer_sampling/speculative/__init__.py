"""Speculative decoding on the sampling side: verification of draft tokens and the confidence-scheduled policy."""

from deepinfer_sampling.speculative.policy import (
    DecodeCostCurve,
    acceptance_estimates,
    estimate_sampler_ms,
    estimate_slope_ms,
    redistribute_verified_drafts,
    schedule_num_verified_drafts,
)
from deepinfer_sampling.speculative.verify import (
    DRAFT_PROB_PENALTY,
    RowLayout,
    VerificationOutput,
    row_layout,
    verify_greedy,
    verify_rejection,
)

__all__ = [
    "DRAFT_PROB_PENALTY",
    "DecodeCostCurve",
    "RowLayout",
    "VerificationOutput",
    "acceptance_estimates",
    "estimate_sampler_ms",
    "estimate_slope_ms",
    "redistribute_verified_drafts",
    "row_layout",
    "schedule_num_verified_drafts",
    "verify_greedy",
    "verify_rejection",
]
