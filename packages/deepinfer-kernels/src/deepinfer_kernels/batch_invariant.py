"""Batch-invariant evaluation of PyTorch's CPU ops: a row's result does not depend on the other rows of its tensor.

PyTorch's CPU kernels give one row different last bits depending on the shape it sits in: a BLAS blocks its sums by
the row count, a reduction over a single long row is split across threads while many short rows are not, and
elementwise transcendental functions take a vectorized path for some shapes and a scalar one (another ``exp``
approximation) for others (docs/design/numerics.md, "Batch invariance"). Inside ``batch_invariant_ops()`` every
such op — products, sums, softmax and transcendentals, listed in ``INVARIANT_OPS`` — on BF16/FP16/FP32 inputs is
evaluated in FP64 and rounded once to the dtype it would have returned:

- products of BF16, FP8 or FP4-derived values are exact in FP64 and their sums are exact too unless the terms span
  more than about 37 binades, so the rounded sum does not depend on the summation order (with FP32 operands the FP64
  error is some 2^-29 of an FP32 ulp: two orders round apart only that close to an FP32 rounding boundary);
- FP64 ``exp``, ``sigmoid``, ``cos``, ... are accurate to an FP64 ulp on either path, so the FP32 value they round to
  is the correctly rounded one whatever the path (barring values within an FP64 ulp of an FP32 rounding boundary).

Every other op (elementwise ``+ − × ÷``, ``sqrt``, comparisons, ``max``, ``sort``, gathers, casts) is exactly rounded
already and runs unchanged. FP64 inputs run unchanged.

On accelerator tensors (CUDA) the mode routes differently: products (``PRODUCT_OPS``, and ``matmul``, ``einsum``,
``linear`` decomposed into them) run through ``invariant_products.invariant_matmul`` — one fixed-tile Triton GEMM
with FP32 accumulation in a K order fixed by (N, K) alone — because FP64 GEMMs would cost far more than the step; the
reductions (``REDUCTION_OPS``) take the FP64 route above; elementwise transcendentals run unchanged (a CUDA
elementwise kernel computes every element with the same device function, whatever the shape). The mode also sets
:func:`invariant_kernels`, which makes the Triton kernels of the nvidia backend choose one tile configuration and
key split for every batch (the quantized GEMMs, sparse attention). A dispatch mode runs on the host, so inside
``torch.cuda.graph`` capture the kernels it launches are what the graph records, and replays need no Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import reduce
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer_kernels.invariant_products import PRODUCT_OPS, invariant_product

__all__ = [
    "COMPOSITE_PRODUCT_OPS",
    "INVARIANT_OPS",
    "REDUCTION_OPS",
    "BatchInvariantOps",
    "batch_invariant_ops",
    "invariant_kernels",
]

# Ops whose CPU result for a row depends on the shape around it, by aten name, in three groups: products
# (``PRODUCT_OPS`` and the composites below), reductions, transcendentals. Their in-place (``exp_``) and out= overloads
# are covered too. Composite ops (matmul, einsum, softmax, linear) are listed as well: under inference mode they reach
# the dispatch mode before decomposing; on an accelerator the product composites are decomposed inside the mode.
COMPOSITE_PRODUCT_OPS: frozenset[str] = frozenset({"matmul", "einsum", "linear"})
REDUCTION_OPS: frozenset[str] = frozenset(
    {
        "sum",
        "mean",
        "cumsum",
        "logsumexp",
        "softmax",
        "_softmax",
        "log_softmax",
        "_log_softmax",
        "linalg_vector_norm",
        "norm",
    }
)
_TRANSCENDENTAL_OPS: frozenset[str] = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log2",
        "log1p",
        "sigmoid",
        "tanh",
        "silu",
        "softplus",
        "gelu",
        "erf",
        "sin",
        "cos",
        "polar",
        "rsqrt",
        "pow",
    }
)
INVARIANT_OPS: frozenset[str] = PRODUCT_OPS | COMPOSITE_PRODUCT_OPS | REDUCTION_OPS | _TRANSCENDENTAL_OPS

# Set while a ``batch_invariant_ops`` body runs; read by the nvidia kernels' launchers when they choose tiles.
_INVARIANT_KERNELS: ContextVar[bool] = ContextVar("deepinfer_invariant_kernels", default=False)


def invariant_kernels() -> bool:
    """Whether the calling code runs inside ``batch_invariant_ops``: kernels must then use one tile configuration
    and reduction split whatever the batch (docs/design/numerics.md, "Batch invariance")."""
    return _INVARIANT_KERNELS.get()


_NARROW = (torch.float32, torch.bfloat16, torch.float16)
_COMPLEX_OF = {torch.float32: torch.complex64, torch.float16: torch.complex32}


_INVARIANT_NAMES: dict[Any, str | None] = {}


def _op_name(func: Any) -> str | None:
    """The overload's packet name without the in-place suffix when it is one of ``INVARIANT_OPS``, else None."""
    known = _INVARIANT_NAMES.get(func, "")
    if known == "":
        name = func.overloadpacket.__name__.removesuffix("_")
        known = _INVARIANT_NAMES[func] = name if name in INVARIANT_OPS else None
    return known


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments: aten schemas nest them in lists and tuples, and the keyword arguments come
    as a dict (a plain walk instead of ``torch.utils._pytree``, whose tree walks were the largest part of the mode's
    own cost on small tensors in a profile of the CPU recipe tests)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts (the containers kept)."""
    if isinstance(value, (tuple, list)):
        items = [_map(fn, item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _map(fn, item) for key, item in value.items()}
    return fn(value)


def _on_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return all(t.device.type == "cpu" for t in _tensors((args, kwargs)))


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _NARROW:
        return value.double()
    if isinstance(value, torch.Tensor) and value.dtype == torch.complex64:
        return value.to(torch.complex128)
    if isinstance(value, torch.dtype) and value in _NARROW:
        return torch.float64
    return value


def _result_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The floating dtype the op would have returned, or None when it has no narrow floating input."""
    requested = [v for v in (*args, kwargs.get("dtype")) if isinstance(v, torch.dtype)]
    if requested:
        return requested[0]
    dtypes = [t.dtype for t in _tensors((args, kwargs)) if t.dtype.is_floating_point]
    if not dtypes or not any(d in _NARROW for d in dtypes):
        return None
    return reduce(torch.promote_types, dtypes)


class BatchInvariantOps(TorchDispatchMode):
    """Dispatch mode that evaluates ``INVARIANT_OPS`` in FP64 and rounds once on CPU tensors, and routes products to
    a fixed-tile GEMM and reductions to FP64 on accelerator tensors (see the module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here runs under torch.compile; without this PyTorch wraps every dispatch in a Dynamo guard (a few
        # microseconds per op, and seconds to import Dynamo on first use).
        return False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name is None:
            return func(*args, **kwargs)
        dtype = _result_dtype(args, kwargs)
        if dtype is None or dtype == torch.float64:
            return func(*args, **kwargs)
        if not _on_cpu(args, kwargs):
            if name in COMPOSITE_PRODUCT_OPS:
                # Decompose with the mode active again, so the mm / bmm / addmm it reduces to come back here.
                with self:
                    return func.decompose(*args, **kwargs)
            if name in PRODUCT_OPS:
                return invariant_product(func, args, kwargs, dtype)
            if name not in REDUCTION_OPS:
                return func(*args, **kwargs)
        wide_args, wide_kwargs = _map(_widen, (args, kwargs))
        result = func(*wide_args, **wide_kwargs)
        written = _written_arguments(func, args, kwargs, wide_args, wide_kwargs)
        for narrow, wide in written:
            narrow.copy_(wide)
        originals = {id(wide): narrow for narrow, wide in written}
        return _map(lambda r: _narrow(r, dtype, originals), result)


def _narrow(value: Any, dtype: torch.dtype, originals: dict[int, torch.Tensor]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) in originals:
        return originals[id(value)]
    if value.dtype == torch.complex128:
        return value.to(_COMPLEX_OF.get(dtype, torch.complex128))
    if value.dtype == torch.float64:
        return value.to(dtype)
    return value


def _written_arguments(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], wide_args: tuple[Any, ...], wide_kwargs: dict[str, Any]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(caller's tensor, widened copy) of every argument the op writes: ``self`` of in-place ops, ``out=``."""
    pairs = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or index >= len(args):
            narrow, wide = kwargs.get(argument.name), wide_kwargs.get(argument.name)
        else:
            narrow, wide = args[index], wide_args[index]
        if isinstance(narrow, torch.Tensor) and isinstance(wide, torch.Tensor) and narrow is not wide:
            pairs.append((narrow, wide))
    return pairs


@contextmanager
def batch_invariant_ops(enabled: bool = True) -> Iterator[None]:
    """Run the body with ``BatchInvariantOps`` and :func:`invariant_kernels` set (a no-op when ``enabled`` is
    false)."""
    if not enabled:
        yield
        return
    token = _INVARIANT_KERNELS.set(True)
    try:
        with BatchInvariantOps():
            yield
    finally:
        _INVARIANT_KERNELS.reset(token)
