"""Reference grouped GEMMs: the rows of each present expert through the reference ``mxfp4_gemm`` (stored MXFP4
weights) or ``dequantized_gemm`` (weights already dequantized, bit-identical when dequantized from the same bytes).

Loops over the experts that occur (a host synchronization; the reference is the oracle, not a fast path) and
checks that every expert id lies in ``[-1, E)``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from deepinfer_kernels.grouped_gemm import CodeOrder, GroupCodes
from deepinfer_kernels.reference.gemm import dequantized_gemm, mxfp4_gemm

__all__ = ["dequantized_grouped_gemm", "mxfp4_grouped_code_order", "mxfp4_grouped_gemm"]


def _per_expert(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    experts: int,
    out: torch.Tensor,
    gemm: Callable[[torch.Tensor, int, torch.Tensor], None],
    all_local: bool = False,
) -> None:
    """``out[rows of e] = gemm(x[rows of e], e)`` for every expert ``e`` present; zero rows for id -1 (which
    ``all_local`` rules out)."""
    lowest = 0 if all_local else -1
    bad = (expert_ids < lowest) | (expert_ids >= experts)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        allowed = f"0..{experts - 1} (every expert local)" if all_local else f"-1 (no local expert) or 0..{experts - 1}"
        raise ValueError(f"expert_ids[{row}] is {int(expert_ids[row])}; allowed: {allowed}")
    out.zero_()
    for expert in torch.unique(expert_ids[expert_ids >= 0]).tolist():
        rows = torch.nonzero(expert_ids == expert).squeeze(1)
        product = torch.empty((rows.numel(), out.shape[1]), dtype=out.dtype, device=out.device)
        gemm(x[rows], expert, product)
        out[rows] = product


def mxfp4_grouped_gemm(
    x: torch.Tensor | GroupCodes,
    expert_ids: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    derived: dict[Hashable, Any] | None = None,
    repeats: int = 1,
    all_local: bool = False,
) -> None:
    """``out[m] = bf16(x̂[m // repeats] · Ŵ[expert_ids[m]]ᵀ)``, zero where ``expert_ids[m] == -1``. ``derived`` (an
    ``ExpertRows``'s store) is left as it is: the reference derives nothing from the ids that it could keep;
    ``all_local`` (``ExpertRows.all_local``) makes an id of ``-1`` an error.

    Args:
        x: [M / repeats, K] bf16/fp32 activation, ``K % 32 == 0``, or its codes (multiplied as their values x̂, which
            quantize to themselves).
        expert_ids: [M] int64 in ``[-1, E)``.
        packed: [E, N, K/2] int8 (low nibble = even element).
        scale: [E, N, K/32] float8_e8m0fnu.
        out: [M, N] bf16; written (every row).

    Raises:
        ValueError: an expert id is outside ``[-1, E)``, or ``-1`` with ``all_local``.
    """
    if isinstance(x, GroupCodes):
        x = x.values()
    rows = x.repeat_interleave(repeats, dim=0) if repeats > 1 else x
    _per_expert(
        rows, expert_ids, packed.shape[0], out, lambda r, e, y: mxfp4_gemm(r, packed[e], scale[e], y), all_local
    )


def mxfp4_grouped_code_order(rows: int, packed: torch.Tensor, scale: torch.Tensor) -> CodeOrder | None:
    """None: the reference quantizes the activation values it is given (codes cost it a dequantization)."""
    return None


def dequantized_grouped_gemm(x: torch.Tensor, expert_ids: torch.Tensor, w_hat: torch.Tensor, out: torch.Tensor) -> None:
    """``out[m] = bf16(x̂[m] · Ŵ[expert_ids[m]]ᵀ)`` with the experts' weights already dequantized; zero where
    ``expert_ids[m] == -1``.

    Args:
        x: [M, K] bf16/fp32 activation, ``K % 32 == 0``.
        expert_ids: [M] int64 in ``[-1, E)``.
        w_hat: [E, N, K] fp32 or fp64, the exactly dequantized weights.
        out: [M, N] bf16; written (every row).

    Raises:
        ValueError: an expert id is outside ``[-1, E)``.
    """
    _per_expert(x, expert_ids, w_hat.shape[0], out, lambda rows, e, y: dequantized_gemm(rows, w_hat[e], y))
