"""Triton RMSNorm: one program per row, FP32 sum of squares, ρ in FP64 from it, FP32 product, one rounding; and
RMSNorm + FP8 quantization in one kernel (docs/design/kernels.md, "rms_norm_fp8")."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import fp8_token_groups, to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch

__all__ = ["rms_norm", "rms_norm_fp8"]

_GROUP: tl.constexpr = tl.constexpr(32)


@triton.jit
def _normed_row(x_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    # Normalizes row program_id(0) and stores it rounded to out's dtype; returns the row index.
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < hidden
    x = tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x * x, axis=0)
    # eps holds an FP32 value; the mean square and rsqrt are done in FP64 so ρ is correctly rounded.
    mean_sq = sum_sq.to(tl.float64) / hidden + eps
    rho = (1.0 / tl.sqrt(mean_sq)).to(tl.float32)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = to_output_dtype((x * rho) * weight, out_ptr)
    tl.store(out_ptr + row * stride_out + offsets, y, mask=mask)
    return row


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    await_inputs(PDL)
    _normed_row(x_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK)


@triton.jit
def _rms_norm_fp8_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    weight_ptr,
    out_ptr,
    q_ptr,
    scale_ptr,
    hidden,
    eps,
    stride_x,
    stride_out,
    stride_q,
    stride_scale,
    qd_ptr,
    BLOCK: tl.constexpr,
    DEINTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):
    # The FP8 copy quantizes the rounded output as the separate quantizer would read it: the row is stored, then read
    # back in the quantizer's [groups, 32] shape after a barrier. Reshaping the normalized values in registers instead
    # lets Triton pick another layout for the whole row, which changes the order of the sum of squares (the output then
    # differed in the last bit from rms_norm's on the H200).
    await_inputs(PDL)
    row = _normed_row(x_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_out, BLOCK)
    tl.debug_barrier()
    columns = tl.arange(0, BLOCK // _GROUP)[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    in_row = columns < hidden
    y = tl.load(out_ptr + row * stride_out + columns, mask=in_row, other=0.0).to(tl.float32)
    codes, scale_bytes = fp8_token_groups(y)
    tl.store(q_ptr + row * stride_q + columns, codes, mask=in_row)
    if DEINTERLEAVED:
        # The same codes, each group even columns first, reordered in registers so the store stays contiguous
        # (docs/design/kernels.md, "Codes into the grouped GEMM").
        paired = tl.permute(tl.reshape(codes, (BLOCK // _GROUP, _GROUP // 2, 2)), (0, 2, 1))
        tl.store(qd_ptr + row * stride_q + columns, tl.reshape(paired, (BLOCK // _GROUP, _GROUP)), mask=in_row)
    group_index = tl.arange(0, BLOCK // _GROUP)
    tl.store(scale_ptr + row * stride_scale + group_index, scale_bytes, mask=group_index * _GROUP < hidden)


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
        x,
        weight,
        out,
        hidden,
        eps_fp32,
        x.stride(0),
        out.stride(0),
        BLOCK=triton.next_power_of_2(hidden),
        **dependent_launch(x.device),
    )


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_deinterleaved: torch.Tensor | None = None,
) -> None:
    """Triton RMSNorm + per-token-group FP8 quantization of its rounded output in one kernel (contract of
    ``reference.norm.rms_norm_fp8``; ``out`` bitwise equal to :func:`rms_norm`, ``q``/``scale`` to the quantizer of
    ``cuda.quant`` on ``out``).

    Args:
        x: [num_rows, hidden_size] bf16 or fp32, contiguous, ``hidden_size % 32 == 0``.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square (used as FP32).
        out: [num_rows, hidden_size], x's dtype; written.
        q: [num_rows, hidden_size] float8_e4m3fn; written.
        scale: [num_rows, hidden_size / 32] float8_e8m0fnu; written.
        q_deinterleaved: optional, ``q``'s codes de-interleaved per group (``q``'s shape and strides); written.
    """
    check_launchable(x=x, weight=weight, out=out, q=q, scale=scale)
    if q_deinterleaved is not None:
        check_launchable(q_deinterleaved=q_deinterleaved)
        if q_deinterleaved.stride() != q.stride():
            raise ValueError(f"q_deinterleaved must have q's strides {q.stride()}, got {q_deinterleaved.stride()}")
    num_rows, hidden = x.shape
    eps_fp32 = float(torch.tensor(eps, dtype=torch.float32))
    _rms_norm_fp8_kernel[(num_rows,)](
        x,
        weight,
        out,
        q.view(torch.uint8),
        scale.view(torch.uint8),
        hidden,
        eps_fp32,
        x.stride(0),
        out.stride(0),
        q.stride(0),
        scale.stride(0),
        q.view(torch.uint8) if q_deinterleaved is None else q_deinterleaved.view(torch.uint8),
        BLOCK=triton.next_power_of_2(hidden),
        DEINTERLEAVED=q_deinterleaved is not None,
        **dependent_launch(x.device),
    )
