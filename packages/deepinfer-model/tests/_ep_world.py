"""Run a function on every rank of a fresh CPU gloo world (one process per rank) and collect the results.

Ranks are forked from a fork server that imported torch and the model once, so a world of 4 starts in about a
second. Each call forms a new world on a free localhost port; a rank that raises fails the call with its traceback,
and ranks that do not answer in time are terminated. Under the ascend target without an NPU the parent runs with the
torch_npu test double in ``sys.modules``; a rank process cannot inherit that, so each rank installs its own double.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from deepinfer_kernels.testing_npu_double import NpuDouble, install_npu_double
from deepinfer_parallel.launcher import destroy_distributed, find_free_port, init_distributed

_PRELOAD = ["torch", "torch.distributed", "deepinfer_parallel", "deepinfer_model.deepseek_v41", "_ep_world"]
_COLLECTIVE_TIMEOUT_S = 30.0


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any, npu_double: bool
) -> None:
    torch.set_num_threads(1)
    with install_npu_double() if npu_double else contextlib.nullcontext():
        try:
            init_distributed(rank, world_size, "127.0.0.1", port, "gloo", _COLLECTIVE_TIMEOUT_S)
            try:
                # Plain pickle bytes: the queue's own pickler would pass tensors as shared-memory handles that die
                # with this process, which may exit before the parent reads them.
                result = pickle.dumps(fn(rank, world_size, *args))
                # Rank 0 holds the world's store: a rank still forming a group when rank 0 left lost it ("Connection
                # reset by peer" in gloo's group setup, seen in CI), so every rank waits for the others first.
                torch.distributed.barrier()
                out.put((rank, True, result))
            finally:
                destroy_distributed()
        except BaseException:
            out.put((rank, False, traceback.format_exc()))


def run_world(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """``[fn(rank, world_size, *args) for every rank]``, each rank in its own process of one gloo world.

    ``fn`` must be a module-level function of an importable module; ``args`` must be picklable.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    out = ctx.Queue()
    port = find_free_port()
    npu_double = isinstance(sys.modules.get("torch_npu"), NpuDouble)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, out, npu_double), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if failures:
                # Peers of a failed rank may wait in a collective it never entered.
                remaining = min(remaining, 5.0)
            try:
                rank, ok, payload = out.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            (results if ok else failures)[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if not failures and len(results) == world_size else 0.5)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
    if failures or len(results) < world_size:
        silent = sorted(set(range(world_size)) - set(results) - set(failures))
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
        raise AssertionError(f"ranks failed: {sorted(failures)}, no answer from: {silent}\n{report}")
    return [pickle.loads(results[rank]) for rank in range(world_size)]
