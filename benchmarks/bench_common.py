"""Helpers shared by the benchmark scripts of this folder: result paths, argument parsing, device labels, random
prompts, wall-clock timing, a soft time budget and the git commit a run measured."""

from __future__ import annotations

import pathlib
import random
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

__all__ = [
    "MIN_TOKEN_ID",
    "RESULTS",
    "Deadline",
    "device_label",
    "git_commit",
    "int_list",
    "median_wall_s",
    "random_prompts",
]

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MIN_TOKEN_ID = 3  # keeps BOS / EOS / PAD out of random prompts


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (an argparse `type`)."""
    return [int(part) for part in text.split(",") if part.strip()]


def device_label(device: str) -> str:
    """ "cpu", or the CUDA device's name in lower case without "nvidia" (e.g. "h200"): the results files' suffix."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower().replace("nvidia", "").strip()
    return "-".join(name.split())


def random_prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly from [MIN_TOKEN_ID, vocab), reproducible by `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(length)] for _ in range(num)]


def git_commit() -> str | None:
    """The commit checked out in this repository, with ``+dirty`` when tracked files differ from it (a copy of a
    working tree, such as a device machine's, may carry an older commit than the code it runs), or None outside a git
    checkout."""
    try:
        head = _git("rev-parse", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if head and changed else head or None


def _git(*args: str) -> str:
    here = pathlib.Path(__file__).resolve().parent
    return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, check=True).stdout.strip()


def median_wall_s(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall seconds of `fn` over `repeats` calls after `warmup` untimed ones; on CUDA each timed call is
    bracketed by a device synchronization, so the figure includes host launch cost."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Deadline:
    """Soft time budget: a part that would start after it is skipped (and says so)."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, part: str, expected_s: float = 0.0) -> bool:
        """Whether `part`, expected to take `expected_s`, would still end within the budget."""
        if self.elapsed() + expected_s < self.seconds:
            return True
        print(
            f"[skip] {part}: {self.elapsed():.0f} s elapsed + {expected_s:.0f} s expected is past the --deadline-s "
            f"budget of {self.seconds:.0f} s"
        )
        return False
