"""Matrix products whose row results do not depend on the row count, for accelerator tensors
(docs/design/numerics.md, "Batch invariance").

``invariant_matmul`` is the public op (the nvidia backend runs one fixed-tile Triton GEMM, the reference FP64);
``invariant_product`` evaluates one aten product op (``mm``, ``mm.dtype``, ``bmm``, ``addmm``, ``baddbmm``, ``mv``,
``dot`` and their in-place / ``out=`` overloads) through it, for ``deepinfer_kernels.batch_invariant``'s dispatch mode.
The bias of ``addmm`` / ``baddbmm`` is added to the FP32 product elementwise, then the sum is rounded once.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["PRODUCT_OPS", "invariant_matmul", "invariant_product"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# aten products evaluated by ``invariant_product`` (overload packet names without the in-place suffix).
PRODUCT_OPS: frozenset[str] = frozenset({"mm", "bmm", "addmm", "baddbmm", "mv", "dot"})


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a @ b`` for [M, K] @ [K, N] or batched [B, M, K] @ [B, K, N], with FP32 accumulation in an order fixed by
    (N, K) alone, rounded once to ``out_dtype`` (default: the promoted input dtype).

    Raises:
        TypeError: an input is not a tensor or not bf16/fp16/fp32, or ``out_dtype`` is none of those.
        ValueError: ranks or inner sizes disagree, or the inputs are on different devices.
    """
    check_tensor("a", a)
    check_tensor("b", b)
    check_dtype("a", a.dtype, _DTYPES)
    check_dtype("b", b.dtype, _DTYPES)
    dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    check_dtype("out_dtype", dtype, _DTYPES)
    check_same_device(a=a, b=b)
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"a and b must both be 2-D or both 3-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    if a3.shape[0] != b3.shape[0] or a3.shape[2] != b3.shape[1]:
        raise ValueError(f"shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied")
    out = torch.empty((a3.shape[0], a3.shape[1], b3.shape[2]), dtype=dtype, device=a.device)
    _registry.resolve("invariant_matmul", a.device.type)(a3, b3, out)
    return out if batched else out[0]


def invariant_product(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    """Evaluate the aten product ``func`` (its packet named in :data:`PRODUCT_OPS`) with :func:`invariant_matmul`;
    the result has ``dtype`` and is written into the op's ``out=`` / ``self`` argument where it has one."""
    name = func.overloadpacket.__name__.removesuffix("_")
    if name in ("addmm", "baddbmm"):
        bias, a, b = args[:3]
        product = invariant_matmul(a, b, torch.float32)
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        scaled = product if alpha == 1 else product * alpha
        # beta == 0 ignores the bias, NaNs included (PyTorch's contract).
        result = scaled if beta == 0 else scaled + (bias.float() if beta == 1 else bias.float() * beta)
        result = result.to(dtype)
    elif name == "mv":
        result = invariant_matmul(args[0], args[1][:, None], dtype)[:, 0]
    elif name == "dot":
        result = invariant_matmul(args[0][None], args[1][:, None], dtype)[0, 0]
    else:
        result = invariant_matmul(args[0], args[1], dtype)
    target = _written_tensor(func, args, kwargs)
    if target is None:
        return result
    target.copy_(result)
    return target


def _written_tensor(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The argument ``func`` writes (``self`` of an in-place overload, ``out=``), or None."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = kwargs.get(argument.name) if argument.kwarg_only or index >= len(args) else args[index]
            if isinstance(value, torch.Tensor):
                return value
    return None
