"""The batch-invariant CPU forward: a model entry point decorated with ``batch_invariant_on_cpu`` runs under
``deepinfer_kernels.batch_invariant.batch_invariant_ops`` when its model was built with ``batch_invariant=True`` and
its weights are on the CPU, so every request's logits are bit-identical whatever else runs in the step
(docs/design/numerics.md, "Batch invariance"). Off, or on another device, the entry point runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

from deepinfer_kernels.batch_invariant import batch_invariant_ops

__all__ = ["batch_invariant_on_cpu"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _InvariantModel(Protocol):
    batch_invariant: bool

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


_Self = TypeVar("_Self", bound=_InvariantModel)


def batch_invariant_on_cpu(method: Callable[Concatenate[_Self, _P], _R]) -> Callable[Concatenate[_Self, _P], _R]:
    """Wrap a model method so it runs batch-invariant when ``self.batch_invariant`` is set and the model is on the
    CPU (see the module docstring)."""

    @wraps(method)
    def wrapped(self: _Self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        on_cpu = next(self.parameters()).device.type == "cpu"
        with batch_invariant_ops(self.batch_invariant and on_cpu):
            return method(self, *args, **kwargs)

    return wrapped
