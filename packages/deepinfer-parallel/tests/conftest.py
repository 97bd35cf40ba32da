"""Fixtures for deepinfer-parallel tests: `run_ranks` runs a function on every rank of a CPU gloo world."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from parallel_rank_pool import RankPool


class _Pools:
    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.healthy:
            pool = RankPool(world_size)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def _rank_pools() -> Iterator[_Pools]:
    pools = _Pools()
    yield pools
    pools.close()


@pytest.fixture
def run_ranks(_rank_pools: _Pools) -> Callable[..., list[Any]]:
    """run_ranks(world_size, fn, *args) -> [fn(rank, world_size, *args) for every rank], run in parallel processes.

    `fn` must be a module-level function of a test module. Processes are spawned once per world size per session.
    """

    def run(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return _rank_pools.get(world_size).run(fn, *args)

    return run
