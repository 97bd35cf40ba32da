"""Starting the processes of a parallel world: one process per rank.

Two entry points:
    - `init_distributed(rank, world_size, master_addr, master_port, ...)` joins the torch.distributed world from an
      already running process. It is torchrun-compatible: the caller passes what torchrun (or the user) provides;
      environment variables such as RANK / WORLD_SIZE / MASTER_ADDR are read by the engine's envs module, never here.
    - `spawn(fn, world_size, args=...)` starts `world_size` fresh processes (multiprocessing "spawn"), joins each to a
      world on a free localhost port and runs `fn(rank, world_size, *args)` in it. Tests and single-host `LLM(...)`
      use it. An exception in any rank is re-raised in the parent.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["destroy_distributed", "find_free_port", "init_distributed", "spawn"]

_BACKENDS = ("gloo", "nccl", "hccl")


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    timeout_s: float = 14400.0,
) -> None:
    """Join the torch.distributed world over TCP rendezvous at `master_addr:master_port`.

    Args:
        rank: this process's global rank, in [0, world_size).
        world_size: number of processes in the world (>= 1).
        master_addr: host of rank 0's rendezvous store.
        master_port: TCP port of the rendezvous store, in [1, 65535].
        backend: default backend of the world: "gloo" (CPU), "nccl" (NVIDIA) or "hccl" (Ascend).
        timeout_s: collective timeout in seconds (> 0).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_distributed() -> None:
    """Leave the torch.distributed world if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_rank(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    master_port: int,
    backend: str,
    timeout_s: float,
    args: tuple[object, ...],
) -> None:
    """Body of one spawned process: join the world, run `fn`, leave the world."""
    init_distributed(rank, world_size, "127.0.0.1", master_port, backend, timeout_s)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_distributed()


def spawn(
    fn: Callable[..., object],
    world_size: int,
    args: tuple[object, ...] = (),
    backend: str = "gloo",
    timeout_s: float = 60.0,
    master_port: int | None = None,
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` new processes that form one world on localhost.

    Args:
        fn: a picklable (module-level) function; its return value is dropped.
        world_size: number of processes (>= 1).
        args: extra picklable arguments passed to every rank.
        backend: default backend of the world ("gloo", "nccl" or "hccl").
        timeout_s: collective timeout in seconds; a rank stuck in a collective fails after it.
        master_port: rendezvous port; a free one is picked when None.

    Raises:
        torch.multiprocessing.ProcessRaisedException: when a rank raised (carries that rank's traceback).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = find_free_port() if master_port is None else master_port
    mp.start_processes(
        _run_rank,
        args=(fn, world_size, port, backend, timeout_s, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
