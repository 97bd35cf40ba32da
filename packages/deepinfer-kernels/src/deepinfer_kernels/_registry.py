"""Per-op implementation table and the one-time choice of implementation.

Every op registers a reference implementation (plain PyTorch, the numerical truth) and, where one
exists, an ``nvidia`` (Triton) and an ``ascend`` (torch_npu) implementation. Registration is explicit:
each backend package has a ``register(registry)`` function that lists its functions by hand; nothing is
found by scanning names. A backend package is imported only when that backend is first needed, so
importing ``deepinfer_kernels`` never imports Triton or torch_npu.

Resolution happens once per (op, device type): the first call of :func:`resolve` picks the implementation
for :func:`deepinfer_kernels.platform.current_accelerator` and caches it. A fast backend serves tensors on its
own device (nvidia: ``cuda``, ascend: ``npu``); tensors elsewhere — CPU tensors on any machine — are served by the
reference, which is the CPU fallback path the nox sessions of the model and engine packages run on machines without
the hardware. (Kernel tests reach the Triton kernels on CPU tensors in Triton's interpreter, and the Ascend
implementations through the torch_npu test double, with :func:`implementation`.) If the accelerator's backend has
no implementation of an op, the reference is used and one INFO line is logged for that op.
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from deepinfer_kernels.platform import Accelerator, clear_accelerator_cache, current_accelerator

__all__ = ["Backend", "OpRegistry", "backend_for", "implementation", "reset", "resolve"]

logger = logging.getLogger("deepinfer_kernels")

Impl = Callable[..., Any]


class Backend(enum.Enum):
    """A family of implementations. ``REFERENCE`` is always complete."""

    REFERENCE = "reference"
    NVIDIA = "nvidia"
    ASCEND = "ascend"


# The package whose ``register(registry)`` lists each backend's implementations.
_BACKEND_PACKAGES: dict[Backend, str] = {
    Backend.REFERENCE: "deepinfer_kernels.reference",
    Backend.NVIDIA: "deepinfer_kernels.cuda",
    Backend.ASCEND: "deepinfer_kernels.ascend",
}

_ACCELERATOR_TO_BACKEND: dict[Accelerator, Backend] = {
    Accelerator.NVIDIA: Backend.NVIDIA,
    Accelerator.ASCEND: Backend.ASCEND,
    Accelerator.CPU: Backend.REFERENCE,
}


# The device type whose tensors each fast backend computes on.
_BACKEND_DEVICE_TYPE: dict[Backend, str] = {Backend.NVIDIA: "cuda", Backend.ASCEND: "npu"}


def backend_for(accelerator: Accelerator) -> Backend:
    """The implementation family used on ``accelerator``."""
    return _ACCELERATOR_TO_BACKEND[accelerator]


class OpRegistry:
    """Implementations per (op, backend), loaded lazily per backend, resolved once per op."""

    def __init__(self, accelerator: Callable[[], Accelerator] = current_accelerator) -> None:
        self._accelerator = accelerator
        self._impls: dict[str, dict[Backend, Impl]] = {}
        self._loaded: set[Backend] = set()
        self._resolved: dict[tuple[str, str | None], Impl] = {}
        self._load_lock = threading.RLock()

    def register(self, op: str, backend: Backend, impl: Impl) -> None:
        """Record ``impl`` as ``backend``'s implementation of ``op``.

        Raises:
            TypeError: ``backend`` is not a :class:`Backend` or ``impl`` is not callable.
            ValueError: ``op`` already has an implementation for ``backend``, or a fast backend registers an op
                that has no reference implementation.
        """
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a Backend ({[b.value for b in Backend]}), got {backend!r}")
        if not callable(impl):
            raise TypeError(f"implementation of op {op!r} for backend {backend.value!r} is not callable: {impl!r}")
        per_backend = self._impls.setdefault(op, {})
        if backend in per_backend:
            raise ValueError(f"op {op!r} already has a {backend.value!r} implementation")
        if backend is not Backend.REFERENCE and Backend.REFERENCE not in per_backend:
            raise ValueError(
                f"op {op!r} has no reference implementation; register the reference before a {backend.value!r} one"
            )
        per_backend[backend] = impl

    def _load(self, backend: Backend) -> None:
        if backend in self._loaded:
            return
        # Two threads resolving their first op at once (e.g. a checkpoint writer and a test) must not both
        # register the backend; re-entrant because a fast backend loads the reference first.
        with self._load_lock:
            if backend in self._loaded:
                return
            if backend is not Backend.REFERENCE:
                self._load(Backend.REFERENCE)
            module = importlib.import_module(_BACKEND_PACKAGES[backend])
            module.register(self)
            self._loaded.add(backend)

    def _known_ops(self) -> list[str]:
        return sorted(op for op, impls in self._impls.items() if Backend.REFERENCE in impls)

    def implementation(self, op: str, backend: Backend) -> Impl:
        """``backend``'s own implementation of ``op``, with no fallback (for tests and benchmarks).

        Raises:
            ValueError: ``op`` is unknown, or ``backend`` has no implementation of it.
        """
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a Backend ({[b.value for b in Backend]}), got {backend!r}")
        self._load(backend)
        impls = self._impls.get(op)
        if impls is None or Backend.REFERENCE not in impls:
            raise ValueError(f"unknown op {op!r}; known ops: {self._known_ops()}")
        impl = impls.get(backend)
        if impl is None:
            available = sorted(b.value for b in impls)
            raise ValueError(f"op {op!r} has no {backend.value!r} implementation; it has: {available}")
        return impl

    def resolve(self, op: str, device_type: str | None = None) -> Impl:
        """The implementation of ``op`` for the current accelerator and ``device_type``, chosen once and cached.

        Args:
            op: the op name.
            device_type: ``torch.device.type`` of the op's tensors; None means the accelerator's own device.
                Tensors not on the fast backend's device are served by the reference.

        Falls back to the reference (logging one INFO line for this op) when the accelerator's backend has
        no implementation of ``op``.

        Raises:
            ValueError: ``op`` is unknown.
        """
        cached = self._resolved.get((op, device_type))
        if cached is not None:
            return cached
        backend = backend_for(self._accelerator())
        if device_type is not None and _BACKEND_DEVICE_TYPE.get(backend, device_type) != device_type:
            backend = Backend.REFERENCE
        self._load(backend)
        impls = self._impls.get(op)
        if impls is None or Backend.REFERENCE not in impls:
            raise ValueError(f"unknown op {op!r}; known ops: {self._known_ops()}")
        impl = impls.get(backend)
        if impl is None:
            logger.info("deepinfer_kernels: op %r has no %r implementation; using the reference", op, backend.value)
            impl = impls[Backend.REFERENCE]
        self._resolved[(op, device_type)] = impl
        return impl

    def clear_resolution_cache(self) -> None:
        """Forget every per-op choice so the next :meth:`resolve` decides again."""
        self._resolved.clear()


_REGISTRY = OpRegistry()


def resolve(op: str, device_type: str | None = None) -> Impl:
    """The process-wide registry's implementation of ``op`` for the current accelerator and ``device_type``."""
    return _REGISTRY.resolve(op, device_type)


def implementation(op: str, backend: Backend) -> Impl:
    """The process-wide registry's ``backend`` implementation of ``op``, without fallback."""
    return _REGISTRY.implementation(op, backend)


def reset() -> None:
    """Forget the resolved accelerator and every per-op choice (for tests that change the environment)."""
    clear_accelerator_cache()
    _REGISTRY.clear_resolution_cache()
