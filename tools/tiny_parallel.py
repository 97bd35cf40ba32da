"""Data-parallel training of the tiny checkpoint: several worker processes share one device, each on its own sequences.

A training step of the reference model is bound by per-operation overhead on the host (hundreds of small kernels
for a 10 M parameter model), so one process leaves a GPU mostly idle. Several processes on the same device each
run the forward and backward of their own sequence, then average their gradients (a Gloo all-reduce of one flat
host buffer) and take the same optimizer step, so their values stay identical. With one worker the averaging is
skipped and training is the plain single-process loop.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(worker: Callable[..., None], args: tuple, workers: int) -> None:
    """Run ``worker(rank, workers, port, *args)`` in ``workers`` processes (in this one when ``workers`` is 1)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    port = free_port()
    if workers == 1:
        worker(0, 1, port, *args)
        return
    mp.spawn(worker, args=(workers, port, *args), nprocs=workers, join=True)


def init_worker(rank: int, workers: int, port: int) -> None:
    """Join the process group of ``spawn`` (nothing to join for a single worker)."""
    if workers == 1:
        return
    torch.set_num_threads(1)  # the host cores are shared by the workers
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=workers)


def average_gradients(params: Sequence[torch.Tensor]) -> None:
    """Replace every gradient by its mean over the workers (one all-reduce; a missing gradient counts as zero)."""
    if not dist.is_initialized():
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).cpu()
    dist.all_reduce(flat)
    flat = flat.to(params[0].device) / dist.get_world_size()
    offset = 0
    for param in params:
        size = param.numel()
        param.grad = flat[offset : offset + size].view_as(param)
        offset += size


def broadcast_int(value: int) -> int:
    """Worker 0's ``value`` on every worker."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device="cpu")
    dist.broadcast(tensor, 0)
    return int(tensor.item())


def mean_float(value: float) -> float:
    """The mean of ``value`` over the workers (for logging)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device="cpu")
    dist.all_reduce(tensor)
    return float(tensor.item()) / dist.get_world_size()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
