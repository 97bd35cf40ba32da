"""A kernels mode switched on for a block of code (``dependent_launches``, ``branch_streams``, ``vendor_attention``).

The mode is a context variable, so it follows the code that entered it (threads and tasks see their own) and is read
where a kernel is chosen or launched: a CUDA graph captured inside a mode records the mode's kernels. Off by default;
``scope(False)`` switches it off for an inner block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["ModeFlag"]


class ModeFlag:
    """One on/off kernels mode, named ``deepinfer_<name>`` in the context."""

    def __init__(self, name: str) -> None:
        self._var: ContextVar[bool] = ContextVar(f"deepinfer_{name}", default=False)

    def requested(self) -> bool:
        """Whether the calling code runs inside ``scope()`` with the mode on."""
        return self._var.get()

    @contextmanager
    def scope(self, enabled: bool = True) -> Iterator[None]:
        """Set the mode to ``enabled`` for the body, restoring the outer setting after it."""
        token = self._var.set(enabled)
        try:
            yield
        finally:
            self._var.reset(token)
