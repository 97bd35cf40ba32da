"""A pool of CPU ranks (one process each) that stay joined to one gloo world across tests.

Starting a process and importing torch costs seconds, so every world size gets one pool per test session; each
test sends a module-level function that all ranks run as `fn(rank, world_size, *args)`. A failing or hanging job
tears the pool down (its world may hold unmatched collectives) and the next test gets a fresh one.

This lives in its own module (not conftest.py) so the ranks can import `_serve` by an unambiguous name.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from deepinfer_parallel.launcher import destroy_distributed, find_free_port, init_distributed

_COLLECTIVE_TIMEOUT_S = 30.0
_START_TIMEOUT_S = 120.0


def _serve(rank: int, world_size: int, port: int, jobs: Any, results: Any) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world_size, "127.0.0.1", port, "gloo", _COLLECTIVE_TIMEOUT_S)
    results.put((rank, True, "ready"))
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


class RankPool:
    """`world_size` spawned ranks joined to one gloo world on a free localhost port."""

    def __init__(self, world_size: int) -> None:
        # A fork server imports torch once and forks every rank from that clean, single-threaded process, so
        # ranks start in well under a second instead of each re-importing torch.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "deepinfer_parallel", "parallel_rank_pool"])
        self.world_size = world_size
        self.healthy = True
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = find_free_port()
        self._procs = [
            ctx.Process(target=_serve, args=(rank, world_size, port, self._jobs[rank], self._results), daemon=True)
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(_START_TIMEOUT_S)

    def _collect(self, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        payloads: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(payloads) + len(failures) < self.world_size:
            remaining = deadline - time.monotonic()
            if failures:
                # The other ranks may be stuck in a collective the failed rank never entered; give them a moment.
                remaining = min(remaining, 5.0)
            try:
                rank, ok, payload = self._results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            (payloads if ok else failures)[rank] = payload
        if failures or len(payloads) < self.world_size:
            self.close()
            missing = sorted(set(range(self.world_size)) - set(payloads) - set(failures))
            report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items()))
            raise AssertionError(f"ranks failed: {sorted(failures)}, no answer from: {missing}\n{report}")
        return [payloads[rank] for rank in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """Run fn(rank, world_size, *args) on every rank; returns the per-rank results in rank order."""
        if not self.healthy:
            raise RuntimeError("this rank pool was closed after a failure")
        for jobs in self._jobs:
            jobs.put((fn, args))
        return self._collect(timeout_s)

    def close(self) -> None:
        """Stop the ranks (politely, then by terminating the processes this pool started)."""
        if not self.healthy:
            return
        self.healthy = False
        for jobs in self._jobs:
            jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=5.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5.0)
