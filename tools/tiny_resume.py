"""Resumable training of the tiny checkpoint: a run split over several invocations (say, device calls of 10 min).

With ``--state DIR --stop-after SECONDS`` the trainer stops at the first step boundary after that many seconds and
saves what the rest of the run depends on; the same command run again continues from there, and the finished run
writes the same checkpoint as an uninterrupted one. Worker 0 saves the values and the optimizer state (identical on
every worker); every worker saves its own data-stream and draft-slot random states.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SHARED = "shared.pt"


class Suspended(Exception):
    """Raised by a training phase that saved its state and stopped (``--stop-after``)."""


@dataclass(frozen=True)
class SavedState:
    """One worker's view of a saved run: ``phase`` ("target" or "draft") and the ``step`` it resumes at."""

    phase: str
    step: int
    values: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    stream: tuple
    generator: torch.Tensor


def _worker_file(directory: Path, rank: int) -> Path:
    return directory / f"worker{rank}.pt"


def load(directory: Path | None, rank: int, device: str) -> SavedState | None:
    """The state saved in ``directory`` for worker ``rank``, or None when there is none (a fresh run)."""
    if directory is None or not (directory / SHARED).exists():
        return None
    if not _worker_file(directory, rank).exists():
        raise FileNotFoundError(f"{directory} holds no state of worker {rank}: resume with the same --workers")
    shared = torch.load(directory / SHARED, map_location=device, weights_only=False)
    own = torch.load(_worker_file(directory, rank), map_location="cpu", weights_only=False)
    return SavedState(shared["phase"], shared["step"], shared["values"], shared["optimizer"], *own)


def save(
    directory: Path,
    rank: int,
    phase: str,
    step: int,
    values: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    stream: random.Random,
    generator: torch.Generator,
) -> None:
    """Save worker ``rank``'s part of the state at a step boundary (module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save((stream.getstate(), generator.get_state()), _worker_file(directory, rank))
    if rank == 0:
        shared = {
            "phase": phase,
            "step": step,
            "values": {k: v.detach() for k, v in values.items()},
            "optimizer": optimizer.state_dict(),
        }
        torch.save(shared, directory / f"{SHARED}.tmp")
        (directory / f"{SHARED}.tmp").replace(directory / SHARED)  # a stop mid-write leaves the older state
