"""The batch-invariant forward: a model entry point decorated with ``batch_invariant_forward`` runs under
``deepinfer_kernels.batch_invariant.batch_invariant_ops`` when its model was built with ``batch_invariant=True`` and
its weights are on the CPU or a CUDA device, so every request's logits are bit-identical whatever else runs in the
step (docs/design/numerics.md, "Batch invariance"). On the CPU the mode evaluates products, sums and transcendentals
in FP64; on CUDA it routes products to a fixed-tile Triton GEMM, reductions to FP64, and pins the Triton kernels'
tiles. Off, or on another device (Ascend), the entry point runs unchanged. The mode is active while CUDA graphs are
captured (the engine captures by calling the decorated ``forward``), so the graphs hold the invariant kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

from deepinfer_kernels.batch_invariant import batch_invariant_ops

__all__ = ["batch_invariant_forward"]

_INVARIANT_DEVICES = ("cpu", "cuda")

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _InvariantModel(Protocol):
    batch_invariant: bool

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


_Self = TypeVar("_Self", bound=_InvariantModel)


def batch_invariant_forward(method: Callable[Concatenate[_Self, _P], _R]) -> Callable[Concatenate[_Self, _P], _R]:
    """Wrap a model method so it runs batch-invariant when ``self.batch_invariant`` is set and the model is on the
    CPU or a CUDA device (see the module docstring)."""

    @wraps(method)
    def wrapped(self: _Self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        supported = next(self.parameters()).device.type in _INVARIANT_DEVICES
        with batch_invariant_ops(self.batch_invariant and supported):
            return method(self, *args, **kwargs)

    return wrapped
