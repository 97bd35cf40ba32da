"""EPLB load window and transfer planning on one process (no communication)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_parallel.config import EplbConfig, ExpertLayoutConfig
from deepinfer_parallel.eplb.rebalance import ExpertTransfer, plan_transfers
from deepinfer_parallel.eplb.stats import ExpertLoadWindow
from deepinfer_parallel.groups import RankGroup


def test_window_folds_physical_counts_into_logical_experts_and_forgets_old_steps():
    layout = ExpertLayoutConfig(num_logical_experts=3, num_redundant_experts=1, expert_parallel_size=2)
    window = ExpertLoadWindow(layout, num_layers=1, config=EplbConfig(window_size=2, step_interval=2))
    p2l = torch.tensor([[0, 1, 2, 0]])  # slot 3 replicates expert 0
    for step in range(3):
        window.record(0, 0, torch.tensor([1, 2]) * (step + 1))
        window.record(0, 1, torch.tensor([3, 4]) * (step + 1))
        window.end_step(p2l)
    assert window.num_counted_steps == 3
    # Steps 2 and 3 remain, oldest first; expert 0 = slot 0 + slot 3.
    assert window.logical_load().tolist() == [[[10, 4, 6]], [[15, 6, 9]]]
    assert torch.equal(window.sum_over_ranks(RankGroup.single()), window.logical_load())


def test_discarded_steps_are_not_counted():
    layout = ExpertLayoutConfig(2, 0, 1)
    window = ExpertLoadWindow(layout, num_layers=1, config=EplbConfig(window_size=3))
    window.record(0, 0, torch.tensor([5, 5]))
    window.discard_step()
    window.record(0, 0, torch.tensor([1, 0]))
    window.end_step(torch.tensor([[0, 1]]))
    assert window.logical_load().tolist() == [[[1, 0]]]


def test_rearrangement_schedule_first_at_a_quarter_interval_then_every_interval():
    layout = ExpertLayoutConfig(2, 0, 1)
    window = ExpertLoadWindow(layout, num_layers=1, config=EplbConfig(window_size=8, step_interval=8))
    due = []
    for _ in range(20):
        window.end_step(torch.tensor([[0, 1]]))
        due.append(window.rearrangement_due())
    assert [i + 1 for i, d in enumerate(due) if d] == [2, 10, 18]
    disabled = ExpertLoadWindow(layout, num_layers=1, config=EplbConfig(window_size=8, step_interval=0))
    disabled.end_step(torch.tensor([[0, 1]]))
    assert not disabled.rearrangement_due()


def test_record_rejects_wrong_count_shape():
    window = ExpertLoadWindow(ExpertLayoutConfig(4, 0, 2), num_layers=1, config=EplbConfig())
    with pytest.raises(ValueError, match=r"must be \[2\]"):
        window.record(0, 0, torch.tensor([1, 2, 3]))


def test_transfers_assign_receivers_to_senders_in_blocks_then_round_robin():
    # 6 ranks, 2 slots each. Expert 9 is held by ranks 0 and 1 and wanted by every rank: receivers 2, 3, 4, 5 go
    # in blocks of floor(4 / 2) = 2: ranks 2, 3 from rank 0; ranks 4, 5 from rank 1.
    old = [9, 0, 1, 9, 2, 3, 4, 5, 6, 7, 8, 10]
    new = [9, 0, 9, 1, 9, 2, 9, 4, 9, 6, 9, 10]
    transfers = [t for t in plan_transfers(old, new, 6) if t.logical_expert == 9]
    assert transfers == [
        ExpertTransfer(9, 0, 0, 2),
        ExpertTransfer(9, 0, 0, 3),
        ExpertTransfer(9, 1, 1, 4),
        ExpertTransfer(9, 1, 1, 5),
    ]
    # Three receivers, two senders: one block each (floor(3 / 2) = 1), the remainder from the first sender.
    new = [9, 0, 9, 1, 9, 2, 9, 4, 9, 6, 8, 10]
    transfers = [t for t in plan_transfers(old, new, 6) if t.logical_expert == 9]
    assert [(t.src_rank, t.dst_rank) for t in transfers] == [(0, 2), (1, 3), (0, 4)]


def test_local_moves_need_no_transfer():
    assert plan_transfers([0, 1, 2, 3], [1, 0, 3, 2], 2) == []


def test_transfers_reject_an_expert_nobody_holds():
    with pytest.raises(ValueError, match="logical expert 4 is wanted by ranks"):
        plan_transfers([0, 1, 2, 3], [0, 1, 2, 4], 2)
