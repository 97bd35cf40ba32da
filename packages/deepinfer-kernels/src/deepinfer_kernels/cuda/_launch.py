"""What every Triton launcher of the nvidia backend shares: the device check (CUDA tensors, or any tensors under
TRITON_INTERPRET=1) and the programmatic dependent launch (``deepinfer_kernels.dependent_launch``).

A kernel launched with ``**dependent_launch(device)`` takes the constexpr ``PDL`` and calls ``await_inputs(PDL)``
before it touches memory: with ``PDL`` set it may have started while the kernel before it still
runs, and the wait is what makes that kernel's writes visible (and its reads done) before this one reads or writes.
``tests/test_dependent_launch.py`` checks every launch and kernel of the package for this pattern. The one thing a
kernel may do before its wait is :func:`prefetch_rows` on a read-only operand (a weight), so that the operand's bytes
stream into L2 while the kernel before still runs (docs/design/kernels.md, "Dependent launches").
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dependent_launch import dependent_launches_requested
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = ["await_inputs", "check_launchable", "dependent_launch", "prefetch_rows"]

# 128-byte lines a row asks for per loop step of prefetch_rows: [rows, 8] addresses, one a thread for the mixes' 32-row
# fn tile on eight warps.
_LINES_PER_STEP: tl.constexpr = tl.constexpr(8)
# prefetch.global.L2 under a predicate (a masked lane asks for nothing); inline assembly must return a value.
_PREFETCH_L2: tl.constexpr = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }"
)


def check_launchable(**tensors: torch.Tensor) -> None:
    """Raise ValueError if a tensor cannot be used by a compiled Triton kernel.

    Under Triton's interpreter (``TRITON_INTERPRET=1``) every device is accepted (CPU tensors are the point);
    otherwise every tensor must be a CUDA tensor.
    """
    if triton_interpreter_enabled():
        return
    for name, tensor in tensors.items():
        if tensor.device.type != "cuda":
            raise ValueError(
                f"{name} is on {tensor.device}, but the nvidia backend runs Triton kernels on CUDA tensors; move the "
                "inputs to a CUDA device (or set TRITON_INTERPRET=1 to run the kernels on CPU tensors for testing)"
            )


@functools.cache
def _has_grid_dependency_control(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol is sm_90 PTX


def dependent_launch(device: torch.device) -> dict[str, bool]:
    """The launch options of a kernel on ``device``: ``PDL`` (the kernel's constexpr) and ``launch_pdl`` (Triton's
    launch attribute), both set inside ``dependent_launches()`` on a Hopper or later GPU outside the interpreter."""
    enabled = (
        dependent_launches_requested()
        and device.type == "cuda"
        and not triton_interpreter_enabled()
        and _has_grid_dependency_control(device.index if device.index is not None else torch.cuda.current_device())
    )
    return {"PDL": enabled, "launch_pdl": enabled}


@triton.jit
def await_inputs(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    # The first statement of every kernel: wait for the kernels before it, then let the next one launch.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows(ptr, rows, row_ok, stride, start, end, PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    # Before await_inputs only, and only on an operand no kernel of the step writes (a weight): asks L2 for elements
    # [start, end) of each row ``ptr + rows·stride`` (rows where row_ok), one prefetch per 128-byte line. Under a
    # dependent launch this program may be resident while the kernel before it still runs, so its tile's bytes stream
    # from memory then instead of after the wait. Without PDL nothing runs early, and nothing is asked.
    if PDL:
        LINE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
        lines = tl.arange(0, _LINES_PER_STEP) * LINE
        for first in range(start, end, _LINES_PER_STEP * LINE):
            columns = first + lines
            wanted = row_ok[:, None] & (columns < end)[None, :]
            tl.inline_asm_elementwise(
                _PREFETCH_L2,
                "=r,l,r",
                [ptr + rows[:, None] * stride + columns[None, :], wanted.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
