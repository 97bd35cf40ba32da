"""Branch streams (``deepinfer_kernels.branch_streams``): outside the mode or off CUDA ``fork`` calls its function at
once; inside it on a GPU the function runs on the device's side stream, the calling stream goes on without waiting,
and ``result()`` orders what follows after the branch (a slow branch's output is read complete), in eager calls and
in a captured CUDA graph; split-K GEMMs on the two streams keep separate tickets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _gpu_marks import compiled_triton_on_gpu

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.branch_streams import branch_streams, fork, prefetch, stream_lane
from deepinfer_kernels.testing import random_e4m3, random_normal, random_ue8m0

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("start", [fork, prefetch])
def test_off_cuda_the_branch_runs_at_once(enabled: bool, start: Any) -> None:
    calls: list[torch.Tensor] = []

    def branch(x: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(x)
        return x * scale

    x = torch.arange(4.0)
    with branch_streams(enabled):
        forked = start(x.device, branch, x, scale=3.0)
        assert len(calls) == 1  # ran before the call returned
        assert stream_lane(x.device) == 0
    assert torch.equal(forked.result(), x * 3.0)
    assert torch.equal(forked.result(), x * 3.0)


def _slow_sum(x: torch.Tensor, seen: list[torch.cuda.Stream]) -> torch.Tensor:
    seen.append(torch.cuda.current_stream(x.device))
    torch.cuda._sleep(20_000_000)  # ~10 ms of spinning: a missing join reads the output unwritten
    return x.sum(dim=1, keepdim=True) + x


@pytest.mark.gpu
@_NEEDS_CUDA
def test_the_branch_runs_on_the_side_stream_and_joins() -> None:
    device = torch.device("cuda")
    x = torch.randn(256, 512, device=device)
    expected = x.sum(dim=1, keepdim=True) + x
    main = torch.cuda.current_stream(device)
    seen: list[torch.cuda.Stream] = []
    with branch_streams():
        forked = fork(device, _slow_sum, x, seen)
        assert seen[0] != main and torch.cuda.current_stream(device) == main
        assert not seen[0].query()  # still sleeping: the caller was not made to wait
        beside = x * 2  # calling-stream work issued while the branch runs
        out = forked.result() - beside
    assert torch.equal(out, expected - x * 2)
    # The same side stream serves every fork of the device; prefetches run on a third stream.
    with branch_streams():
        fork(device, _slow_sum, x, seen).result()
        assert torch.equal(prefetch(device, _slow_sum, x, seen).result(), expected)
        lanes = [fork(device, stream_lane, device).result(), prefetch(device, stream_lane, device).result()]
    assert seen[1] == seen[0] and seen[2] not in (main, seen[0])
    assert lanes == [1, 2] and stream_lane(device) == 0


@pytest.mark.gpu
@_NEEDS_CUDA
def test_a_captured_graph_keeps_the_fork_and_the_join() -> None:
    device = torch.device("cuda")
    x = torch.randn(128, 256, device=device)
    seen: list[torch.cuda.Stream] = []

    def step() -> torch.Tensor:
        with branch_streams():
            forked = fork(device, _slow_sum, x, seen)
            beside = x * 2
            return forked.result() - beside

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.sum(dim=1, keepdim=True) + x - x * 2)


@compiled_triton_on_gpu
def test_split_k_launches_on_both_streams_keep_their_bits() -> None:
    """Split-K GEMVs launched on the calling stream and on the side stream overlap; each lane takes its own tickets
    (``cuda.gemm_operands.split_counters``), so every result has the bits of a launch alone and the tickets are zero
    again afterwards."""
    from deepinfer_kernels.cuda.gemm_operands import split_counters
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    device = torch.device("cuda")
    gemm = implementation("fp8_block_gemm", Backend.NVIDIA)
    cfg = BlockConfig(block_m=2, block_n=32, num_warps=4, num_stages=2, split_grid=True, gemv=True)
    n, k = 8192, 8192
    weights = [
        (random_e4m3((n, k), seed=seed).to(device), random_ue8m0((n // 32, k // 32), seed=seed + 1).to(device))
        for seed in (30, 40)
    ]
    x = random_normal((1, k), seed=50).to(device, torch.bfloat16)

    def product(w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
        gemm(x, w_q, w_scale, out, config=cfg)
        return out

    alone = [product(*w) for w in weights]
    with branch_streams():
        for _ in range(20):
            beside = fork(device, product, *weights[1])
            here = product(*weights[0])
            assert torch.equal(here, alone[0]) and torch.equal(beside.result(), alone[1])
        side = fork(device, split_counters, device, 0).result()
    torch.cuda.synchronize()
    assert not split_counters(device, 0).any() and not side.any()
    assert side.data_ptr() != split_counters(device, 0).data_ptr()
