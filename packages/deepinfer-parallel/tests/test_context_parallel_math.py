"""Balanced CP split and the gather back to token order, on one process."""

from __future__ import annotations

import pytest
import torch

from deepinfer_parallel.context_parallel import (
    balanced_block_size,
    balanced_split,
    gather_local_tokens,
    restore_token_order,
)


def test_mirrored_blocks_hand_checked():
    split = balanced_split([10], cp_size=2)
    assert balanced_block_size(10, 2) == 3
    assert split.token_index.tolist() == [[0, 1, 2, 9, 0, 0], [3, 4, 5, 6, 7, 8]]
    assert split.valid.tolist() == [[True, True, True, True, False, False], [True] * 6]
    assert split.positions.tolist() == [[0, 1, 2, 9, -1, -1], [3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_lens", [[16], [13, 1, 0, 7], [3], []])
def test_every_token_lands_on_exactly_one_rank_and_round_trips(cp_size, seq_lens):
    split = balanced_split(seq_lens, cp_size)
    num_tokens = sum(seq_lens)
    owned = split.token_index[split.valid]
    assert sorted(owned.tolist()) == list(range(num_tokens))
    x = torch.randn(num_tokens, 3, generator=torch.Generator().manual_seed(0))
    local = torch.cat([gather_local_tokens(x, split, rank) for rank in range(cp_size)])
    assert local.shape == (cp_size * split.num_local_tokens, 3)
    assert bool((local[~split.valid.reshape(-1)] == 0).all())
    # torch.equal: assert_bitwise_equal cannot take empty tensors yet.
    assert torch.equal(restore_token_order(local, split), x)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_causal_work_is_balanced(cp_size):
    # Causal attention cost of a query ~ its position + 1; the mirrored pairing equalises it exactly when the
    # length fills all blocks.
    split = balanced_split([64 * cp_size], cp_size)
    work = ((split.positions + 1) * split.valid).sum(dim=1)
    assert work.min() == work.max()
    # Rank r holds blocks r and 2cp-1-r.
    block = balanced_block_size(64 * cp_size, cp_size)
    for rank in range(cp_size):
        starts = split.positions[rank, ::block].tolist()
        assert starts == [rank * block, (2 * cp_size - 1 - rank) * block]


def test_split_rejects_bad_sizes():
    with pytest.raises(ValueError, match="cp_size must be >= 1, got 0"):
        balanced_split([4], 0)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        balanced_split([4, -1], 2)
