"""Which accelerator the kernels run on, decided once per process.

This module owns backend detection. It is one of the two places in DeepInfer allowed to read the
environment (the other is ``deepinfer_engine.envs``), and it reads only two variables:

- ``DEEPINFER_ACCELERATOR``: ``nvidia``, ``ascend`` or ``cpu``; unset or empty means auto-detect
  (a visible CUDA device → ``nvidia``; an importable ``torch_npu`` with an NPU → ``ascend``; else ``cpu``).
- ``TRITON_INTERPRET``: ``1`` runs Triton kernels in Triton's interpreter on CPU tensors. The ``nvidia``
  target without a CUDA device is only valid in that mode (used by tests on machines without a GPU).

Nothing here runs at import time. :func:`current_accelerator` resolves on first call and caches the
result; :func:`clear_accelerator_cache` exists so tests can change the environment and resolve again.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os

import torch

__all__ = [
    "ACCELERATOR_ENV_VAR",
    "Accelerator",
    "clear_accelerator_cache",
    "current_accelerator",
    "requested_accelerator",
    "triton_interpreter_enabled",
]

ACCELERATOR_ENV_VAR = "DEEPINFER_ACCELERATOR"
_TRITON_INTERPRET_ENV_VAR = "TRITON_INTERPRET"


class Accelerator(enum.Enum):
    """The device family whose fast kernels are used; ``CPU`` means the PyTorch reference only."""

    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CPU = "cpu"


def _allowed_values() -> str:
    return ", ".join(repr(a.value) for a in Accelerator)


@functools.cache
def triton_interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set, i.e. Triton kernels run on CPU tensors in the interpreter."""
    return os.environ.get(_TRITON_INTERPRET_ENV_VAR, "") == "1"


def _npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except (ImportError, OSError):
        # torch_npu raises ImportError (or OSError from the loader) when CANN libraries are missing.
        return False
    npu = getattr(torch_npu, "npu", None)
    is_available = getattr(npu, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _check_nvidia() -> None:
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise RuntimeError(
            f"{ACCELERATOR_ENV_VAR}=nvidia needs Triton, which is not importable ({exc}). "
            "Install deepinfer-kernels with the 'nvidia' extra, or set "
            f"{ACCELERATOR_ENV_VAR}=cpu to use the PyTorch reference kernels."
        ) from exc
    if torch.cuda.is_available() or triton_interpreter_enabled():
        return
    raise RuntimeError(
        f"{ACCELERATOR_ENV_VAR}=nvidia but no CUDA device is visible. Run on a machine with an NVIDIA GPU, "
        f"or set {_TRITON_INTERPRET_ENV_VAR}=1 to run the Triton kernels on CPU tensors in Triton's "
        f"interpreter (slow; for tests), or set {ACCELERATOR_ENV_VAR}=cpu to use the PyTorch reference kernels."
    )


def _check_ascend() -> None:
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError) as exc:
        raise RuntimeError(
            f"{ACCELERATOR_ENV_VAR}=ascend but torch_npu is not importable ({exc}). Install deepinfer-kernels "
            "with the 'ascend' extra on a machine with the CANN toolkit (torch_npu needs its libraries at import "
            f"time), or set {ACCELERATOR_ENV_VAR}=cpu to use the PyTorch reference kernels."
        ) from exc


def requested_accelerator() -> Accelerator | None:
    """The accelerator ``DEEPINFER_ACCELERATOR`` asks for, or None when unset (auto-detect); no availability check.

    Raises:
        ValueError: the variable holds a value other than nvidia, ascend or cpu.
    """
    raw = os.environ.get(ACCELERATOR_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        return Accelerator(raw.lower())
    except ValueError:
        raise ValueError(
            f"{ACCELERATOR_ENV_VAR}={raw!r} is not a known accelerator; allowed values are {_allowed_values()} "
            "(or leave it unset to auto-detect)."
        ) from None


@functools.cache
def current_accelerator() -> Accelerator:
    """Resolve the accelerator once from ``DEEPINFER_ACCELERATOR`` (or auto-detection) and cache it.

    Returns:
        The resolved :class:`Accelerator`.

    Raises:
        ValueError: ``DEEPINFER_ACCELERATOR`` holds a value other than nvidia, ascend or cpu.
        RuntimeError: the requested accelerator cannot run here (the message says how to fix it).
    """
    accelerator = requested_accelerator()
    if accelerator is None:
        if torch.cuda.is_available():
            return Accelerator.NVIDIA
        if _npu_available():
            return Accelerator.ASCEND
        return Accelerator.CPU
    if accelerator is Accelerator.NVIDIA:
        _check_nvidia()
    elif accelerator is Accelerator.ASCEND:
        _check_ascend()
    return accelerator


def clear_accelerator_cache() -> None:
    """Forget the resolved accelerator and interpreter flag so the next call reads the environment again.

    For tests that change ``DEEPINFER_ACCELERATOR``; library code never calls it.
    """
    current_accelerator.cache_clear()
    triton_interpreter_enabled.cache_clear()
