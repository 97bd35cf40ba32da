"""Triton RMSNorm: one program per row, FP32 sum of squares, ρ in FP64 from it, FP32 product, one rounding."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import check_launchable

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < hidden
    x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x * x, axis=0)
    # eps holds an FP32 value; the mean square and rsqrt are done in FP64 so ρ is correctly rounded.
    mean_sq = sum_sq.to(tl.float64) / hidden + eps
    rho = (1.0 / tl.sqrt(mean_sq)).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = (x * rho) * weight
    tl.store(out_ptr + row * stride_out + offsets, to_output_dtype(y, out_ptr), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """Triton RMSNorm (numerics as ``reference.norm.rms_norm``; the FP32 sum order differs).

    Args:
        x: [num_rows, hidden_size] bf16 or fp32, contiguous.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square (used as FP32).
        out: [num_rows, hidden_size], x's dtype; written.
    """
    check_launchable(x=x, weight=weight, out=out)
    num_rows, hidden = x.shape
    eps_fp32 = float(torch.tensor(eps, dtype=torch.float32))
    _rms_norm_kernel[(num_rows,)](
        x, weight, out, hidden, eps_fp32, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(hidden)
    )
