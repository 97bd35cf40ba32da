"""Data-parallel helpers of the tiny-checkpoint trainer (tools/tiny_parallel.py): two worker processes on the CPU
end with the mean of their gradients and worker 0's broadcast values."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import tiny_parallel  # noqa: E402


def _worker(rank: int, workers: int, port: int, grads: list[torch.Tensor]) -> None:
    tiny_parallel.init_worker(rank, workers, port)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True), torch.zeros(1)]
    params[0].grad = grads[2 * rank].clone()
    params[1].grad = grads[2 * rank + 1].clone()  # params[2] has no gradient: it counts as zero
    tiny_parallel.average_gradients(params)
    torch.testing.assert_close(params[0].grad, (grads[0] + grads[2]) / 2, rtol=0, atol=1e-7)
    torch.testing.assert_close(params[1].grad, (grads[1] + grads[3]) / 2, rtol=0, atol=1e-7)
    torch.testing.assert_close(params[2].grad, torch.zeros(1))
    assert tiny_parallel.broadcast_int(17 + rank) == 17
    assert tiny_parallel.mean_float(float(rank)) == 0.5
    tiny_parallel.finish()


def test_two_workers_average_gradients_and_share_worker_zero_values() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((3,), (2, 2), (3,), (2, 2))]
    tiny_parallel.spawn(_worker, (grads,), 2)


def test_one_worker_runs_in_this_process_and_leaves_gradients_alone() -> None:
    param = torch.zeros(2, requires_grad=True)
    param.grad = torch.tensor([1.0, -2.0])
    seen: list[int] = []
    tiny_parallel.spawn(lambda rank, workers, port: seen.append(rank + workers), (), 1)
    tiny_parallel.average_gradients([param])
    assert seen == [1]
    torch.testing.assert_close(param.grad, torch.tensor([1.0, -2.0]))
