"""Context-parallel prefill of a small causal attention over real gloo CP groups == the single-rank result."""

from __future__ import annotations

import pytest
import torch
from cp_attention import causal_mask, masked_attention, packed_metadata

from deepinfer_kernels.testing import assert_close
from deepinfer_parallel.comm import all_gather_into
from deepinfer_parallel.config import ParallelConfig
from deepinfer_parallel.context_parallel import all_gather_to_token_order, balanced_split, gather_local_tokens
from deepinfer_parallel.groups import ParallelGroups

SEQ_LENS = [13, 1, 8, 0, 5]
HEADS, DIM = 2, 8
# fp32; the split result differs from one softmax only by summation order (~1e-7 relative).
ATOL = 1e-5


def _inputs():
    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(SEQ_LENS)
    return tuple(torch.randn(num_tokens, HEADS, DIM, generator=gen) for _ in range(3))


def _cp_prefill_worker(rank, world_size):
    config = ParallelConfig(world_size=world_size, context_parallel_size=world_size, expert_parallel_size=1)
    groups = ParallelGroups.build(config, rank)
    cp, cp_rank = groups.context_parallel, groups.cp_rank
    split = balanced_split(SEQ_LENS, cp.size)
    q, k, v = _inputs()
    q_local, k_local, v_local = (gather_local_tokens(x, split, cp_rank) for x in (q, k, v))
    # Gather every rank's K/V rows (fixed-size: padding included) and attend to all of them under the causal mask,
    # as the model's attention does with the key tokens of a split step.
    k_all = all_gather_into(k_local.new_empty((cp.size * split.num_local_tokens, HEADS, DIM)), k_local, cp)
    v_all = all_gather_into(v_local.new_empty((cp.size * split.num_local_tokens, HEADS, DIM)), v_local, cp)
    key_request, key_position = split.request_index.reshape(-1), split.positions.reshape(-1)
    mask = causal_mask(split.request_index[cp_rank], split.positions[cp_rank], key_request, key_position)
    out_local, _ = masked_attention(q_local, k_all, v_all, mask)
    out = all_gather_to_token_order(out_local.contiguous(), split, cp)

    request, position = packed_metadata(SEQ_LENS)
    expected, _ = masked_attention(q, k, v, causal_mask(request, position, request, position))
    assert_close(out, expected, rtol=0.0, atol=ATOL, message=f"rank {rank}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_prefill_matches_single_rank(run_ranks, world_size):
    run_ranks(world_size, _cp_prefill_worker)
