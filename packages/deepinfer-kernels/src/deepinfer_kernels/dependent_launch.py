"""Programmatic dependent launch (PDL) of the nvidia backend's Triton kernels (docs/design/kernels.md, "Dependent
launches").

On Hopper and later a kernel launched with the programmatic-serialization attribute may start while the kernel before
it on the stream is still running. Inside ``dependent_launches()`` every Triton kernel of the nvidia backend is
launched that way and, as its first statement, waits for the kernels before it (``griddepcontrol.wait``: their
writes are then visible) and lets the next kernel launch (``griddepcontrol.launch_dependents``). A kernel therefore
reads and writes nothing before everything before it has finished, exactly as without the attribute: results are
the same bits. What is gained is the next kernel's launch (its programs scheduled and waiting) overlapped with the
running one, for every pair of Triton kernels in a row (the decode step is some 600 kernels, most of them small).
The Gluon GEMMs take part the same way (their first statement is ``gluon_ring.await_gluon_inputs``); kernels of
other libraries (PyTorch, cuBLAS) launch as before and end the overlap.

The mode is a ``ModeFlag`` (a context variable), read when a kernel is launched, so a CUDA graph captured inside it
records the dependent launches. Off by default. Off on the CPU, in Triton's interpreter and on GPUs before Hopper.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from deepinfer_kernels.mode_flag import ModeFlag

__all__ = ["dependent_launches", "dependent_launches_requested"]

_DEPENDENT_LAUNCHES = ModeFlag("dependent_launches")


def dependent_launches_requested() -> bool:
    """Whether the calling code runs inside ``dependent_launches()`` (the launchers also check the device)."""
    return _DEPENDENT_LAUNCHES.requested()


def dependent_launches(enabled: bool = True) -> AbstractContextManager[None]:
    """Launch the nvidia backend's Triton kernels as programmatic dependent launches in the body (a no-op when
    ``enabled`` is false; see the module docstring)."""
    return _DEPENDENT_LAUNCHES.scope(enabled)
