"""Errors raised while resolving, validating and loading a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

_SHOWN_PER_CATEGORY = 50


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, unreadable or malformed; the message names the file."""


class CoverageError(CheckpointError):
    """The checkpoint's tensors do not match the configuration's catalogue.

    Every problem is collected before raising, so one error reports all of them. The attributes hold the complete
    lists; the message shows up to 50 names per category plus the count.

    Attributes:
        missing: catalogue tensors the checkpoint lacks.
        unexpected: checkpoint tensors the catalogue does not contain.
        wrong_shape: ``"name: stored [..] expected [..]"`` lines.
        wrong_dtype: ``"name: stored X expected Y"`` lines.
        other: further rule violations (forbidden tensors, ambiguous names, misplaced Engram scales).
    """

    def __init__(
        self,
        missing: Sequence[str],
        unexpected: Sequence[str],
        wrong_shape: Sequence[str],
        wrong_dtype: Sequence[str],
        other: Sequence[str],
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.wrong_shape = list(wrong_shape)
        self.wrong_dtype = list(wrong_dtype)
        self.other = list(other)
        parts = []
        for title, items in (
            ("missing tensors", self.missing),
            ("unexpected tensors", self.unexpected),
            ("tensors with the wrong shape", self.wrong_shape),
            ("tensors with the wrong dtype", self.wrong_dtype),
            ("other problems", self.other),
        ):
            if items:
                shown = "\n  ".join(items[:_SHOWN_PER_CATEGORY])
                more = (
                    f"\n  ... and {len(items) - _SHOWN_PER_CATEGORY} more" if len(items) > _SHOWN_PER_CATEGORY else ""
                )
                parts.append(f"{len(items)} {title}:\n  {shown}{more}")
        super().__init__("checkpoint does not match the configuration:\n" + "\n".join(parts))

    @property
    def num_problems(self) -> int:
        return (
            len(self.missing) + len(self.unexpected) + len(self.wrong_shape) + len(self.wrong_dtype) + len(self.other)
        )
