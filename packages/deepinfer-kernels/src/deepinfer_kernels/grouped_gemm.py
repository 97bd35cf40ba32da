"""Public grouped MXFP4 GEMM for MoE experts: each row multiplied by its own expert's weight
(docs/design/numerics.md, "GEMM accumulation").

Row ``m`` of the result is exactly what ``mxfp4_gemm(x[m:m+1], packed[e], scale[e])`` returns for
``e = expert_ids[m]``; rows with ``expert_ids[m] == -1`` (no local expert) are zero.

Expert ids are checked only where checking is free of a host synchronization: the reference implementation (CPU
tensors, or any device without a fast kernel) raises ValueError for ids outside ``[-1, E)``. The Triton kernel does
not check them, because that would stall the host and break CUDA graph capture; there any id outside ``[0, E)``
yields a zero row, like ``-1``.

``dequantized_grouped_gemm`` is the same product over experts whose weights the caller already holds exactly
dequantized (reference only; see ``deepinfer_kernels.gemm.dequantized_gemm``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["ExpertRows", "dequantized_grouped_gemm", "mxfp4_grouped_gemm"]


class ExpertRows:
    """The expert ids of a grouped GEMM's rows, passed to every grouped GEMM over the same rows (a MoE's ``w13`` and
    ``w2``) so that what a backend derives from the ids alone is derived once: the nvidia backend keeps its
    expert-sorted tile tables in :attr:`derived` and the next call reuses them (docs/design/kernels.md, "GEMM tiles
    and split-K"). Build one per set of ids and do not change ``ids`` afterwards.

    Attributes:
        ids: [M] int64 expert id of each row.
        all_local: the caller knows that every id names a held expert (none is ``-1``, as when every expert is
            local and the ids come straight from the router): backends then write no zero rows, which on the nvidia
            backend saves a launch per GEMM. The reference checks it.
        derived: what backends derived from ``ids``, by a key of their own.
    """

    def __init__(self, ids: torch.Tensor, all_local: bool = False) -> None:
        self.ids = ids
        self.all_local = all_local
        self.derived: dict[Hashable, Any] = {}


_ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
_GROUP = 32


def _check_rows(x: torch.Tensor, expert_ids: torch.Tensor, k: int, described: str, repeats: int = 1) -> None:
    check_dtype("x", x.dtype, _ACTIVATION_DTYPES)
    check_dtype("expert_ids", expert_ids.dtype, (torch.int64,))
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns but {described} has reduction dimension {k}")
    if k % _GROUP:
        raise ValueError(f"the reduction dimension ({k}) must be a multiple of {_GROUP}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int (product rows per row of x), got {repeats!r}")
    if tuple(expert_ids.shape) != (x.shape[0] * repeats,):
        raise ValueError(
            f"expert_ids must have shape ({x.shape[0] * repeats},) (one id per row of x times repeats={repeats}), "
            f"got {tuple(expert_ids.shape)}"
        )


def _run(
    op: str, x: torch.Tensor, expert_ids: torch.Tensor, n: int, *weights: torch.Tensor, **options: Any
) -> torch.Tensor:
    # Every backend writes every row (zeros for ids of no local expert): no zero-fill here.
    out = torch.empty((expert_ids.shape[0], n), dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0 or x.shape[1] == 0:
        return out.zero_()  # a product over K = 0 is zero
    _registry.resolve(op, x.device.type)(x.contiguous(), expert_ids.contiguous(), *weights, out, **options)
    return out


def mxfp4_grouped_gemm(
    x: torch.Tensor,
    expert_ids: torch.Tensor | ExpertRows,
    packed: torch.Tensor,
    scale: torch.Tensor,
    repeats: int = 1,
) -> torch.Tensor:
    """``y[m] = bf16(x̂[m // repeats] · Ŵ[expert_ids[m]]ᵀ)``: x quantized per token and 32 columns
    (docs/design/numerics.md, "Activation quantization"), weights MXFP4 (docs/design/numerics.md, "Weight formats").

    Sync-free on the nvidia backend (safe inside CUDA graph capture); see the module docstring for how expert ids
    outside ``[-1, E)`` are treated per backend.

    Args:
        x: [M / repeats, K] bf16 or fp32, ``K % 32 == 0``.
        expert_ids: [M] int64 in ``[-1, E)``; ``-1`` means the row belongs to no local expert. An
            :class:`ExpertRows` over them lets the GEMMs that share the rows share what is derived from the ids.
        packed: [E, N, K/2] int8 or uint8 (low nibble = even element), same device.
        scale: [E, N, K/32] float8_e8m0fnu, same device.
        repeats: product rows per row of x: a MoE's top-k rows of a token (``repeats = k``, the token's rows in rank
            order) read the token itself, with no copy of it per choice.

    Returns:
        [M, N] bf16; rows with ``expert_ids == -1`` are zero.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: shapes disagree, tensors are on different devices, or (reference only) an id is out of range or
            ``-1`` under ``ExpertRows(all_local=True)``.
    """
    derived, all_local = None, False
    if isinstance(expert_ids, ExpertRows):
        derived, all_local, expert_ids = expert_ids.derived, expert_ids.all_local, expert_ids.ids
    for name, value in (("x", x), ("expert_ids", expert_ids), ("packed", packed), ("scale", scale)):
        check_tensor(name, value)
    check_dtype("packed", packed.dtype, (torch.int8, torch.uint8))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    if packed.dim() != 3:
        raise ValueError(f"packed must be 3-D [E, N, K/2], got shape {tuple(packed.shape)}")
    experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    _check_rows(x, expert_ids, k, f"packed {tuple(packed.shape)}", repeats)
    if tuple(scale.shape) != (experts, n, k // _GROUP):
        raise ValueError(
            f"scale must have shape {(experts, n, k // _GROUP)} for packed {tuple(packed.shape)}, "
            f"got {tuple(scale.shape)}"
        )
    check_same_device(x=x, expert_ids=expert_ids, packed=packed, scale=scale)
    weights = (packed.contiguous().view(torch.int8), scale.contiguous())
    return _run("mxfp4_grouped_gemm", x, expert_ids, n, *weights, derived=derived, repeats=repeats, all_local=all_local)


def dequantized_grouped_gemm(x: torch.Tensor, expert_ids: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """``y[m] = bf16(x̂[m] · Ŵ[expert_ids[m]]ᵀ)`` with the experts' weights given exactly dequantized.

    ``dequantized_grouped_gemm(x, ids, Ŵ)`` with ``Ŵ[e] = dequantize_mxfp4(packed[e], scale[e])`` equals the
    reference ``mxfp4_grouped_gemm(x, ids, packed, scale)`` bit for bit. Reference only: it synchronizes with the
    host and raises ValueError for ids outside ``[-1, E)``.

    Args:
        x: [M, K] bf16 or fp32, ``K % 32 == 0``.
        expert_ids: [M] int64 in ``[-1, E)``; ``-1`` means the row belongs to no local expert.
        w_hat: [E, N, K] fp32 or fp64, same device.

    Returns:
        [M, N] bf16; rows with ``expert_ids == -1`` are zero.

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: shapes disagree, tensors are on different devices, or an id is out of range.
    """
    for name, value in (("x", x), ("expert_ids", expert_ids), ("w_hat", w_hat)):
        check_tensor(name, value)
    check_dtype("w_hat", w_hat.dtype, (torch.float32, torch.float64))
    if w_hat.dim() != 3:
        raise ValueError(f"w_hat must be 3-D [E, N, K], got shape {tuple(w_hat.shape)}")
    _check_rows(x, expert_ids, w_hat.shape[2], f"w_hat {tuple(w_hat.shape)}")
    check_same_device(x=x, expert_ids=expert_ids, w_hat=w_hat)
    return _run("dequantized_grouped_gemm", x, expert_ids, w_hat.shape[1], w_hat.contiguous())
