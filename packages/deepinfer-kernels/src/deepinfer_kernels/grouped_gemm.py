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

A producer that can quantize the activation itself (``swiglu_clamped_fp8``) hands the GEMM :class:`GroupCodes` in the
order that ``mxfp4_grouped_code_order`` names, and the GEMM's own quantization launch is left out
(docs/design/kernels.md, "Codes into the grouped GEMM").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, Literal

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor
from deepinfer_kernels.quant import dequantize_fp8_per_token_group

__all__ = [
    "CodeOrder",
    "ExpertRows",
    "GroupCodes",
    "dequantized_grouped_gemm",
    "mxfp4_grouped_code_order",
    "mxfp4_grouped_gemm",
]

CodeOrder = Literal["columns", "deinterleaved"]


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


@dataclasses.dataclass(frozen=True)
class GroupCodes:
    """An activation already quantized per token and 32 columns (docs/design/numerics.md, "Activation
    quantization"), for ``mxfp4_grouped_gemm``: quantizing these values again gives the same codes' values, so the
    product is the one of :meth:`values`, and a backend that reads codes in :attr:`order` takes them as they are.

    Attributes:
        q: [M, K] float8_e4m3fn codes.
        scale: [M, K/32] float8_e8m0fnu.
        order: ``"columns"``, or ``"deinterleaved"``: each group's codes stored even columns first, then odd ones.
    """

    q: torch.Tensor
    scale: torch.Tensor
    order: CodeOrder = "columns"

    def contiguous(self) -> GroupCodes:
        return GroupCodes(self.q.contiguous(), self.scale.contiguous(), self.order)

    def values(self) -> torch.Tensor:
        """x̂ [M, K] fp32 in column order (exact)."""
        q = self.q
        if self.order == "deinterleaved":
            rows, width = q.shape
            pairs = q.view(torch.uint8).view(rows, width // _GROUP, 2, _GROUP // 2).transpose(2, 3)
            q = pairs.reshape(rows, width).view(torch.float8_e4m3fn)
        return dequantize_fp8_per_token_group(q, self.scale)


def _check_codes(codes: GroupCodes) -> None:
    check_tensor("x.q", codes.q)
    check_tensor("x.scale", codes.scale)
    check_dtype("x.q", codes.q.dtype, (torch.float8_e4m3fn,))
    check_dtype("x.scale", codes.scale.dtype, (torch.float8_e8m0fnu,))
    if codes.order not in ("columns", "deinterleaved"):
        raise ValueError(f"x.order must be 'columns' or 'deinterleaved', got {codes.order!r}")
    if codes.q.dim() != 2 or codes.q.shape[1] % _GROUP:
        raise ValueError(f"x.q must be 2-D [M, K] with K a multiple of {_GROUP}, got shape {tuple(codes.q.shape)}")
    expected = (codes.q.shape[0], codes.q.shape[1] // _GROUP)
    if tuple(codes.scale.shape) != expected:
        raise ValueError(
            f"x.scale must have shape {expected} for x.q {tuple(codes.q.shape)}, got {tuple(codes.scale.shape)}"
        )
    check_same_device(**{"x.q": codes.q, "x.scale": codes.scale})


def _check_rows(
    x: torch.Tensor, expert_ids: torch.Tensor, k: int, described: str, repeats: int = 1, codes: bool = False
) -> None:
    if not codes:  # GroupCodes' codes are checked by _check_codes
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
    op: str, x: torch.Tensor | GroupCodes, expert_ids: torch.Tensor, n: int, *weights: torch.Tensor, **options: Any
) -> torch.Tensor:
    rows = x.q if isinstance(x, GroupCodes) else x
    # Every backend writes every row (zeros for ids of no local expert): no zero-fill here.
    out = torch.empty((expert_ids.shape[0], n), dtype=torch.bfloat16, device=rows.device)
    if out.numel() == 0 or rows.shape[1] == 0:
        return out.zero_()  # a product over K = 0 is zero
    x = x.contiguous()
    _registry.resolve(op, rows.device.type)(x, expert_ids.contiguous(), *weights, out, **options)
    return out


def mxfp4_grouped_gemm(
    x: torch.Tensor | GroupCodes,
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
        x: [M / repeats, K] bf16 or fp32, ``K % 32 == 0``; or :class:`GroupCodes` of such rows, already quantized.
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
    if isinstance(x, GroupCodes):
        _check_codes(x)
    else:
        check_tensor("x", x)
    rows = x.q if isinstance(x, GroupCodes) else x
    for name, value in (("expert_ids", expert_ids), ("packed", packed), ("scale", scale)):
        check_tensor(name, value)
    check_dtype("packed", packed.dtype, (torch.int8, torch.uint8))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    if packed.dim() != 3:
        raise ValueError(f"packed must be 3-D [E, N, K/2], got shape {tuple(packed.shape)}")
    experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    _check_rows(rows, expert_ids, k, f"packed {tuple(packed.shape)}", repeats, codes=isinstance(x, GroupCodes))
    if tuple(scale.shape) != (experts, n, k // _GROUP):
        raise ValueError(
            f"scale must have shape {(experts, n, k // _GROUP)} for packed {tuple(packed.shape)}, "
            f"got {tuple(scale.shape)}"
        )
    check_same_device(x=rows, expert_ids=expert_ids, packed=packed, scale=scale)
    weights = (packed.contiguous().view(torch.int8), scale.contiguous())
    return _run("mxfp4_grouped_gemm", x, expert_ids, n, *weights, derived=derived, repeats=repeats, all_local=all_local)


def mxfp4_grouped_code_order(rows: int, packed: torch.Tensor, scale: torch.Tensor) -> CodeOrder | None:
    """The order of the codes that ``mxfp4_grouped_gemm`` of ``rows`` product rows over these experts reads when it
    quantizes its activation itself, so that a producer can hand it :class:`GroupCodes` in that order instead; None
    where it reads the activation's values (the reference, and the nvidia backend's sorted-copy tiles of a prefill),
    so that the producer hands it those.

    Args:
        rows: M, the product's rows (a MoE's tokens times its top-k for ``w13``).
        packed: [E, N, K/2] int8 or uint8, the experts' weights as passed to ``mxfp4_grouped_gemm``.
        scale: [E, N, K/32] float8_e8m0fnu.
    """
    check_tensor("packed", packed)
    check_tensor("scale", scale)
    if packed.dim() != 3 or tuple(scale.shape) != (*packed.shape[:2], packed.shape[2] * 2 // _GROUP):
        raise ValueError(
            f"packed [E, N, K/2] and scale [E, N, K/32] disagree: {tuple(packed.shape)}, {tuple(scale.shape)}"
        )
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise ValueError(f"rows must be a non-negative int, got {rows!r}")
    order: CodeOrder | None = _registry.resolve("mxfp4_grouped_code_order", packed.device.type)(rows, packed, scale)
    return order


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
