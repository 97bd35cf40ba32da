"""Reference batch-invariant matmul (docs/design/numerics.md, "Batch invariance"): FP64 products and sums, one
rounding."""

from __future__ import annotations

import torch

__all__ = ["invariant_matmul"]


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = round(a[i] @ b[i])``, evaluated in FP64 (exact products of BF16/FP16 inputs; for FP32 inputs an
    error far below an FP32 ulp), rounded once to ``out``'s dtype.

    Args:
        a: [B, M, K] bf16/fp16/fp32.
        b: [B, K, N] bf16/fp16/fp32.
        out: [B, M, N] bf16/fp16/fp32; written.
    """
    out.copy_(torch.bmm(a.double(), b.double()))
