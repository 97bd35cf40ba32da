"""Confidence-scheduled verification policy on hand-made confidences and cost curves."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_sampling.speculative import (
    DecodeCostCurve,
    acceptance_estimates,
    estimate_sampler_ms,
    estimate_slope_ms,
    redistribute_verified_drafts,
    schedule_num_verified_drafts,
)


def test_acceptance_estimates_are_cumulative_products():
    estimates = acceptance_estimates([[0.5, 0.5, 0.2], [1.0, 0.9], []])
    assert estimates[0] == pytest.approx([0.5, 0.25, 0.05])
    assert estimates[1] == pytest.approx([1.0, 0.9])
    assert estimates[2] == []


def test_step_time_uses_the_smallest_graph_that_fits():
    cost = DecodeCostCurve(graph_sizes=(4, 8, 16), baseline_ms=(10.0, 12.0, 20.0), slope_ms=0.5, sampler_ms=1.0)
    assert cost.step_time_ms(1) == 10.0 + 0.5 * 4 + 1.0
    assert cost.step_time_ms(4) == 10.0 + 0.5 * 4 + 1.0
    assert cost.step_time_ms(5) == 12.0 + 0.5 * 8 + 1.0
    assert cost.step_time_ms(17) is None


def test_without_a_cost_curve_every_held_draft_is_verified():
    assert schedule_num_verified_drafts([[0.9, 0.1], [0.0, 0.0], []], [[0.9, 0.1], [0.0, 0.0], []], None) == [2, 2, 0]


def test_hand_computed_choice_with_graph_steps():
    # 2 requests. Totals 2..4 run graph 4 (10 ms), 5..8 graph 8 (20 ms).
    # Yield per ms: k=0 2/10, k=1 2.9/10, k=2 3.7/10 (best), k=3 4.3/20, ... so the two best slots (both request 0).
    cost = DecodeCostCurve(graph_sizes=(4, 8), baseline_ms=(10.0, 20.0))
    priorities = [[0.9, 0.8, 0.5], [0.6, 0.1, 0.0]]
    assert schedule_num_verified_drafts(priorities, priorities, cost) == [2, 0]


def test_flat_cost_verifies_every_draft_with_positive_estimate():
    cost = DecodeCostCurve(graph_sizes=(64,), baseline_ms=(10.0,))
    priorities = [[0.9, 0.4, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]]
    # Equal time for every total: only slots that add expected tokens raise the yield (first maximum wins).
    assert schedule_num_verified_drafts(priorities, priorities, cost) == [2, 1, 0]


def test_expensive_tokens_verify_nothing():
    cost = DecodeCostCurve(graph_sizes=(2, 4, 8), baseline_ms=(1.0, 100.0, 200.0))
    priorities = [[0.99, 0.98], [0.97, 0.9]]
    assert schedule_num_verified_drafts(priorities, priorities, cost) == [0, 0]


def test_totals_above_the_largest_graph_are_not_considered():
    cost = DecodeCostCurve(graph_sizes=(2, 3), baseline_ms=(10.0, 10.0))
    priorities = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    assert schedule_num_verified_drafts(priorities, priorities, cost) == [1, 0]
    with pytest.raises(ValueError, match="largest captured graph"):
        schedule_num_verified_drafts([[0.5]] * 4, [[0.5]] * 4, cost)


def test_budget_chooses_the_total_and_allocation_distributes_it():
    cost = DecodeCostCurve(graph_sizes=(4, 8), baseline_ms=(10.0, 40.0))
    budget = [[0.9, 0.9], [0.1, 0.1]]  # older estimates: two slots are worth it
    allocation = [[0.1, 0.1], [0.9, 0.8]]  # fresher estimates: request 1 deserves them
    assert schedule_num_verified_drafts(budget, allocation, cost) == [0, 2]


def test_ties_go_to_the_lower_request_index():
    cost = DecodeCostCurve(graph_sizes=(3, 4), baseline_ms=(10.0, 100.0))
    assert schedule_num_verified_drafts([[0.5], [0.5]], [[0.5], [0.5]], cost) == [1, 0]


def test_mismatched_priority_shapes_are_rejected():
    with pytest.raises(ValueError, match="same number of positions"):
        schedule_num_verified_drafts([[0.5, 0.4]], [[0.5]], None)


def test_random_schedules_pick_the_best_total_and_prefixes():
    rng = random.Random(0)
    for _ in range(50):
        num_requests, nextn = rng.randint(1, 6), rng.randint(1, 5)
        estimates = acceptance_estimates([[rng.random() for _ in range(nextn)] for _ in range(num_requests)])
        sizes = tuple(sorted(rng.sample(range(num_requests, num_requests * (nextn + 1) + 2), 3)))
        cost = DecodeCostCurve(sizes, tuple(sorted(rng.uniform(5, 50) for _ in sizes)), slope_ms=rng.uniform(0, 0.3))
        counts = schedule_num_verified_drafts(estimates, estimates, cost)
        assert all(0 <= c <= nextn for c in counts)
        total = num_requests + sum(counts)
        time_ms = cost.step_time_ms(total)
        assert time_ms is not None
        chosen_yield = (num_requests + sum(sum(row[:c]) for row, c in zip(estimates, counts, strict=True))) / time_ms
        flat = sorted((p for row in estimates for p in row), reverse=True)
        for extra in range(len(flat) + 1):
            other_time = cost.step_time_ms(num_requests + extra)
            if other_time is not None:
                assert (num_requests + sum(flat[:extra])) / other_time <= chosen_yield + 1e-12


def test_redistribute_by_fresh_confidences():
    confidences = torch.tensor([[0.9, 0.9], [0.5, 1.0], [0.99, 0.99]])
    in_previous = torch.tensor([True, True, False])
    # Estimates: request 0 → 0.9, 0.81; request 1 → 0.5, 0.5; request 2 (not in the previous step) → 0, 0.
    assert redistribute_verified_drafts(confidences, in_previous, 0).tolist() == [0, 0, 0]
    assert redistribute_verified_drafts(confidences, in_previous, 3).tolist() == [2, 1, 0]
    assert redistribute_verified_drafts(confidences, in_previous, 4).tolist() == [2, 2, 0]
    assert redistribute_verified_drafts(confidences, in_previous, 5).tolist() == [2, 2, 1]
    with pytest.raises(ValueError, match="num_extra_rows"):
        redistribute_verified_drafts(confidences, in_previous, 7)


def test_redistribution_keeps_the_total_and_gives_prefixes():
    g = torch.Generator().manual_seed(0)
    confidences = torch.rand(16, 5, generator=g)
    confidences[3] = 0.5  # ties inside one request
    in_previous = torch.rand(16, generator=g) < 0.8
    for extra in range(0, 81, 7):
        counts = redistribute_verified_drafts(confidences, in_previous, extra)
        assert int(counts.sum()) == extra and bool((counts <= 5).all())
        estimates = torch.where(in_previous[:, None], torch.cumprod(confidences, 1), 0.0)
        picked = torch.arange(5)[None, :] < counts[:, None]
        if picked.any() and (~picked).any():
            assert estimates[picked].min() >= estimates[~picked].max()


def test_slope_estimate():
    assert estimate_slope_ms([]) == 0.0
    samples = [(8, 0.1)] * 9 + [(16, 0.3)] * 10 + [(32, 0.5)] * 12 + [(64, 0.2)] * 10
    # Size 8 has too few samples; medians of the rest are 0.3, 0.5, 0.2 → 0.3.
    assert estimate_slope_ms(samples) == pytest.approx(0.3)
    assert estimate_slope_ms([(8, -0.4)] * 10) == 0.0


def test_sampler_time_estimate():
    same = [9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 100.0]
    assert estimate_sampler_ms(same, []) == 5.0  # last 9: 1..8, 100 → median 5
    assert estimate_sampler_ms([1.0, 2.0], [3.0, 3.0, 4.0, 5.0, 6.0]) == 4.0
    assert estimate_sampler_ms([1.0], [2.0]) == 0.0


def test_cost_curve_validation():
    with pytest.raises(ValueError, match="equal length"):
        DecodeCostCurve(graph_sizes=(1, 2), baseline_ms=(1.0,))
    with pytest.raises(ValueError, match="strictly increasing"):
        DecodeCostCurve(graph_sizes=(2, 2), baseline_ms=(1.0, 1.0))
    with pytest.raises(ValueError, match="baseline_ms"):
        DecodeCostCurve(graph_sizes=(2,), baseline_ms=(0.0,))
    with pytest.raises(ValueError, match="slope_ms"):
        DecodeCostCurve(graph_sizes=(2,), baseline_ms=(1.0,), slope_ms=-1.0)
