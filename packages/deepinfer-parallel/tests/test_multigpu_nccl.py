"""The same code paths on CUDA tensors over NCCL (one process per GPU): EP, EPLB, CP, collectives.

Runs on two GPUs (marked multigpu) and as a world of one on a single GPU (marked gpu: the NCCL path of world size 1);
each is skipped without enough CUDA devices. Each rank checks its own results against single-process math
and raises on a mismatch, which `spawn` re-raises here.
"""

from __future__ import annotations

import pytest
import torch
from cp_attention import causal_mask, masked_attention, packed_metadata
from ep_moe import moe_through_dispatcher

from deepinfer_kernels.testing import assert_bitwise_equal, assert_close
from deepinfer_parallel.config import EplbConfig, ParallelConfig
from deepinfer_parallel.context_parallel import all_gather_to_token_order, balanced_split, gather_local_tokens
from deepinfer_parallel.eplb.policy import rebalance_experts
from deepinfer_parallel.eplb.rebalance import apply_placement
from deepinfer_parallel.eplb.stats import ExpertLoadWindow
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement, map_to_physical
from deepinfer_parallel.groups import ParallelGroups
from deepinfer_parallel.launcher import spawn

HIDDEN, TOP_K, NUM_LOGICAL = 16, 3, 6
# fp32 on GPU: TF32 is off for these einsums/matmuls (set below), so only summation order differs.
ATOL = 1e-4


def _moe_reference(hidden, topk_ids, topk_weights, weights):
    out = torch.zeros_like(hidden)
    for j in range(topk_ids.shape[1]):
        out += topk_weights[:, j : j + 1] * torch.einsum("nh,nho->no", hidden, weights[topk_ids[:, j]])
    return out


def _close(name, actual, expected):
    assert_close(actual, expected, rtol=0.0, atol=ATOL, message=name)


def _nccl_worker(rank, world_size):
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    config = ParallelConfig(world_size=world_size, data_parallel_size=world_size, expert_parallel_size=world_size)
    groups = ParallelGroups.build(config, rank)
    groups.warm_up(device)
    ep = groups.expert_parallel
    layout = config.expert_layout(NUM_LOGICAL, min_redundant_experts=2)
    gen = torch.Generator().manual_seed(0)
    weights = (torch.randn(NUM_LOGICAL, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5).to(device)
    tokens = []
    for r in range(world_size):
        n = [37, 0, 5, 11][r % 4]
        scores = torch.rand(n, NUM_LOGICAL, generator=gen) + torch.tensor([0.0, 0.0, 0.0, 3.0, 0.0, 2.0])
        topk_weights, topk_ids = scores.topk(TOP_K, dim=1)
        tokens.append(tuple(t.to(device) for t in (torch.randn(n, HIDDEN, generator=gen), topk_ids, topk_weights)))
    hidden, topk_ids, topk_weights = tokens[rank]
    expected = _moe_reference(hidden, topk_ids, topk_weights, weights)

    # Expert parallel dispatch/combine with redundant experts, then EPLB moves weights and outputs stay the same.
    placement = ExpertPlacement.initial(layout, 1, device)
    local_weights = [weights[placement.local_logical_experts(0, ep.rank)].clone()]

    dispatcher = AllToAllDispatcher(ep, layout.num_local_experts)
    window = ExpertLoadWindow(layout, 1, EplbConfig(window_size=1, step_interval=1), device)
    physical = map_to_physical(topk_ids, placement, 0, token_offset=ep.rank)
    window.record(0, ep.rank, dispatcher.dispatch(hidden, physical, topk_weights).num_tokens_per_local_expert)
    window.end_step(placement.physical_to_logical)
    _close("ep moe", moe_through_dispatcher(hidden, physical, topk_weights, local_weights[0], dispatcher), expected)
    new_p2l = rebalance_experts(window.sum_over_ranks(ep).cpu(), layout.num_redundant_experts, ep.size)
    apply_placement([local_weights], placement, new_p2l, ep, num_p2p_groups=2)
    assert_bitwise_equal(local_weights[0], weights[placement.local_logical_experts(0, ep.rank)], message="eplb weights")
    physical = map_to_physical(topk_ids, placement, 0, token_offset=ep.rank)
    after = moe_through_dispatcher(hidden, physical, topk_weights, local_weights[0], dispatcher)
    _close("ep moe after eplb", after, expected)

    # Context parallel over the same ranks: causal attention over the gathered keys, gathered back to token order.
    seq_lens = [13, 1, 8]
    split = balanced_split(seq_lens, groups.world.size)
    q, k, v = (torch.randn(sum(seq_lens), 2, 8, generator=gen).to(device) for _ in range(3))
    ql, kl, vl = (gather_local_tokens(x, split, groups.world.rank) for x in (q, k, v))
    k_all, v_all = (all_gather_to_token_order(x, split, groups.world) for x in (kl, vl))
    request, position = packed_metadata(seq_lens)
    me = groups.world.rank
    q_req, q_pos = split.request_index[me], split.positions[me]
    out_local, _ = masked_attention(ql, k_all, v_all, causal_mask(q_req, q_pos, request, position).to(device))
    out = all_gather_to_token_order(out_local.contiguous(), split, groups.world)
    full, _ = masked_attention(q, k, v, causal_mask(request, position, request, position).to(device))
    _close("context parallel", out, full)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_nccl_paths_world_of_one():
    spawn(_nccl_worker, 1, backend="nccl", timeout_s=120.0)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_paths_on_two_gpus():
    spawn(_nccl_worker, 2, backend="nccl", timeout_s=120.0)
