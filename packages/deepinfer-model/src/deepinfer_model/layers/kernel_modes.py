"""The kernel modes of a model's forward: an entry point decorated with ``kernel_modes_forward`` runs under the
modes its model was built with.

- ``batch_invariant=True`` (weights on the CPU or a CUDA device): under
  ``deepinfer_kernels.batch_invariant.batch_invariant_ops``, so every request's logits are bit-identical whatever else
  runs in the step (docs/design/numerics.md, "Batch invariance"). On the CPU the mode evaluates products, sums and
  transcendentals in FP64; on CUDA it routes products to a fixed-tile Triton GEMM, reductions to FP64, and pins the
  Triton kernels' tiles. On another device (Ascend) the entry point runs unchanged.
- ``dependent_launch=True``: under ``deepinfer_kernels.dependent_launch.dependent_launches``, so the nvidia backend's
  Triton kernels start while the kernel before them finishes (the same bits; docs/design/kernels.md, "Dependent
  launches"). Elsewhere it changes nothing. ``dependent_launch_max_tokens=N`` does the same for the calls of at most
  N tokens only (the rows of the entry point's ``ForwardBatch`` or first tensor): the decode steps where launches,
  not kernels, are most of the time.
- ``branch_streams=True``: under ``deepinfer_kernels.branch_streams.branch_streams``, so on CUDA the forward's
  independent branches (the shared expert, the window keys, the next Engram projection) run on a side stream beside
  the work they do not depend on (the same bits; docs/design/kernels.md, "Branch streams"). Elsewhere it changes
  nothing.
- ``flashmla=True``: under ``deepinfer_kernels.vendor_attention.vendor_attention``, so on an SM90 device with the
  ``flash_mla`` module importable, prompt-sized attention calls run FlashMLA's sparse prefill kernel (not the same
  bits: docs/design/kernels.md, "FlashMLA sparse prefill"). Elsewhere it changes nothing.

The modes are active while CUDA graphs are captured (the engine captures by calling the decorated ``forward``), so
the graphs hold the kernels the modes choose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import wraps
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.branch_streams import branch_streams
from deepinfer_kernels.dependent_launch import dependent_launches
from deepinfer_kernels.vendor_attention import vendor_attention
from deepinfer_model.forward_batch import ForwardBatch

__all__ = ["kernel_modes_forward"]

_INVARIANT_DEVICES = ("cpu", "cuda")

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _ModalModel(Protocol):
    batch_invariant: bool
    dependent_launch: bool
    dependent_launch_max_tokens: int
    branch_streams: bool
    flashmla: bool

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


_Self = TypeVar("_Self", bound=_ModalModel)


def _call_tokens(args: tuple[object, ...]) -> int | None:
    # The tokens (rows) an entry point computes: its ForwardBatch's, else its first tensor's rows.
    first = args[0] if args else None
    if isinstance(first, ForwardBatch):
        return first.num_tokens
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    return None


def _dependent(model: _ModalModel, args: tuple[object, ...]) -> bool:
    if model.dependent_launch:
        return True
    tokens = _call_tokens(args) if model.dependent_launch_max_tokens > 0 else None
    return tokens is not None and tokens <= model.dependent_launch_max_tokens


def kernel_modes_forward(method: Callable[Concatenate[_Self, _P], _R]) -> Callable[Concatenate[_Self, _P], _R]:
    """Wrap a model method so it runs under the model's kernel modes (see the module docstring)."""

    @wraps(method)
    def wrapped(self: _Self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        supported = next(self.parameters()).device.type in _INVARIANT_DEVICES
        with (
            batch_invariant_ops(self.batch_invariant and supported),
            dependent_launches(_dependent(self, args)),
            branch_streams(self.branch_streams),
            vendor_attention(self.flashmla),
        ):
            return method(self, *args, **kwargs)

    return wrapped
