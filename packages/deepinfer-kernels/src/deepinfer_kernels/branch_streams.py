"""Independent branches of a forward on side CUDA streams (docs/design/kernels.md, "Branch streams").

A decode step at small batch is a chain of short kernels that leave most of the GPU idle: a 4 µs router on a few
multiprocessors, a GEMV that streams a 3 MB weight. Work that does not depend on what runs beside it can run
concurrently with it on another stream. ``fork(device, fn, *args)`` starts ``fn(*args)`` on the device's side stream
(short branches: the shared expert beside the router and routed experts, the window keys beside the query
projection) and ``prefetch(device, fn, *args)`` on its prefetch stream (work started a whole block ahead: the next
Engram layer's projection), so that a short branch never queues behind a long one. Both return a ``Forked``;
``Forked.result()`` makes the calling stream wait for the branch and returns its value. The kernels and their inputs
are the same either way, so the results are the same bits; only their overlap changes.

Inside ``branch_streams()`` on a CUDA device the branches run on those streams; elsewhere (off, CPU, Ascend, the
Triton interpreter's CPU tensors) ``fn`` is called at once and ``result()`` returns its value.

Memory: a branch stream waits for everything enqueued before the fork, so the memory its work allocates may reuse any
block freed before the fork; the arguments stay referenced by the ``Forked`` until ``result()``, so no block the
branch reads is handed to other work on the calling stream while the branch may still read it. A captured CUDA graph
records the fork and the join as edges (the branch stream joins the capture by its wait on the capturing stream), so
every branch must be joined before the capture ends.

Kernels that keep state between launches on a device (the split-K tickets of ``cuda.gemm_operands.split_counters``)
keep one copy per stream lane (``stream_lane``: 0 for every stream but the branch streams, which are 1 and 2):
launches of different lanes may overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, ParamSpec, TypeVar

import torch

from deepinfer_kernels.mode_flag import ModeFlag

__all__ = [
    "Forked",
    "branch_streams",
    "branch_streams_active",
    "branch_streams_requested",
    "fork",
    "prefetch",
    "stream_lane",
]

_BRANCH_STREAMS = ModeFlag("branch_streams")
_SIDE, _PREFETCH = 1, 2
_LANES: dict[tuple[int, int], torch.cuda.Stream] = {}

_P = ParamSpec("_P")
_R = TypeVar("_R")


def branch_streams_requested() -> bool:
    """Whether the calling code runs inside ``branch_streams()`` (``fork`` also checks the device)."""
    return _BRANCH_STREAMS.requested()


def branch_streams_active(device: torch.device) -> bool:
    """Whether ``fork`` and ``prefetch`` start branches on streams of ``device`` (inside the mode, on CUDA)."""
    return _BRANCH_STREAMS.requested() and device.type == "cuda"


def branch_streams(enabled: bool = True) -> AbstractContextManager[None]:
    """Run the body's ``fork`` and ``prefetch`` branches on the branch streams (a no-op when ``enabled`` is false; see
    the module docstring)."""
    return _BRANCH_STREAMS.scope(enabled)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def stream_lane(device: torch.device) -> int:
    """The lane of the current stream of ``device``: 1 or 2 on its side or prefetch stream (a branch is running),
    else 0."""
    if device.type != "cuda" or not _LANES:
        return 0
    current, index = torch.cuda.current_stream(device), _index(device)
    return next((lane for lane in (_SIDE, _PREFETCH) if _LANES.get((index, lane)) == current), 0)


def _lane_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    key = (_index(device), lane)
    stream = _LANES.get(key)
    if stream is None:
        stream = _LANES[key] = torch.cuda.Stream(key[0])
    return stream


class Forked(Generic[_R]):
    """The value of a forked branch; ``result()`` joins it into the calling stream (once) and returns it."""

    def __init__(
        self, value: _R, joined_by: torch.cuda.Stream | None, branch: torch.cuda.Stream | None, keep: Any
    ) -> None:
        self._value = value
        self._main = joined_by
        self._branch = branch
        self._keep = keep  # the branch's arguments, alive until the join (module docstring, "Memory")

    def result(self) -> _R:
        """The branch's value, after the calling stream has been made to wait for the branch's work."""
        if self._main is not None and self._branch is not None:
            self._main.wait_stream(self._branch)
            self._main = self._branch = None
            self._keep = None
        return self._value


def _fork(
    lane: int, device: torch.device, fn: Callable[..., _R], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Forked[_R]:
    if not branch_streams_active(device):
        return Forked(fn(*args, **kwargs), None, None, None)
    main = torch.cuda.current_stream(device)
    branch = _lane_stream(device, lane)
    branch.wait_stream(main)
    with torch.cuda.stream(branch):
        value = fn(*args, **kwargs)
    return Forked(value, main, branch, (args, kwargs))


def fork(device: torch.device, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> Forked[_R]:
    """Start ``fn(*args, **kwargs)`` on the side stream, beside the work that follows on ``device`` (module
    docstring).

    ``fn`` must read only its arguments and state that nothing before the join writes, and the caller must not read
    what ``fn`` writes before ``result()``.
    """
    return _fork(_SIDE, device, fn, args, kwargs)


def prefetch(device: torch.device, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> Forked[_R]:
    """``fork`` on the prefetch stream: for work started well before its result is needed, so that the side
    stream's short branches do not queue behind it."""
    return _fork(_PREFETCH, device, fn, args, kwargs)
