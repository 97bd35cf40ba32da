"""Shared tolerance for the quantized-GEMM kernel tests (Triton vs the FP64-accumulating reference).

Both results are the same exact products ``x̂_i · ŵ_i`` summed and rounded to bf16; they differ only in how the sum
is accumulated: the reference sums in FP64 (exact for these inputs) and rounds to FP32 then bf16, the kernel sums in
FP32 in its own order and rounds to bf16. With ``S = Σ|x̂_i · ŵ_i|`` the FP32 sum is within ``K·2^−24·S`` of the
exact one (the recursive-summation bound), and the two bf16 roundings add at most one bf16 ulp of the reference:

    |y − y_ref| ≤ ulp_bf16(y_ref) + K · 2^−24 · S

The Triton interpreter (NumPy FP32 matmul) meets this with every element bitwise equal on the interpreter test
shapes; on a GPU, elements whose FP32 sum lands near a bf16 rounding boundary differ by one ulp.

The ``group_fp8`` decoding sums each 32-column group on Hopper's FP8 tensor cores, whose accumulator keeps 13
mantissa bits (FP22, truncating): a group's sum of 32 exact products is then within ``31 · 2^−13 · S_g`` of the exact
one (recursive summation with unit 2^−13), hence ``group_accumulation = 2^−8`` over the groups (``Σ S_g = S``). On
inputs whose group sums fit 13 bits that term is zero and the FP32 bound above holds as it is.
"""

from __future__ import annotations

import torch

import deepinfer_kernels as dk

__all__ = ["abs_product", "assert_gemm_close", "deinterleaved", "dequantized_activation", "group_codes"]


def dequantized_activation(x: torch.Tensor) -> torch.Tensor:
    """The quantized activation x̂ as FP64 on x's device, [M, K]."""
    q, scale = dk.quantize_fp8_per_token_group(x)
    return dk.dequantize_fp8_per_token_group(q, scale, out_dtype=torch.float32).double()


def deinterleaved(q: torch.Tensor) -> torch.Tensor:
    """Codes [M, K] with each 32-column group stored even columns first, then odd ones (``GroupCodes`` order
    ``"deinterleaved"``), as uint8."""
    rows, width = q.shape
    return q.view(torch.uint8).view(rows, width // 32, 16, 2).transpose(2, 3).reshape(rows, width)


def group_codes(x: torch.Tensor, order: dk.CodeOrder) -> dk.GroupCodes:
    """``x`` quantized per token and 32 columns, in ``order``."""
    q, scale = dk.quantize_fp8_per_token_group(x)
    if order == "deinterleaved":
        q = deinterleaved(q).view(torch.float8_e4m3fn)
    return dk.GroupCodes(q, scale, order)


def abs_product(x_hat: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """``S = |x̂|·|Ŵ|ᵀ`` in FP64: [M, K] × [N, K] → [M, N]."""
    return x_hat.double().abs() @ w_hat.double().abs().t()


def assert_gemm_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    magnitude: torch.Tensor,
    k: int,
    significant_bits: int = 8,
    group_accumulation: float = 0.0,
    what: str = "the kernel",
) -> None:
    """Assert ``|actual − expected| ≤ ulp(expected) + (K·2^−24 + group_accumulation)·S`` elementwise (on the CPU, in
    FP64).

    Args:
        actual: [M, N] bf16 (or fp32) from the kernel.
        expected: [M, N] bf16 (or fp32) from the reference.
        magnitude: [M, N] ``S`` from :func:`abs_product`.
        k: the reduction length K.
        significant_bits: of the output format, for its ulp: 8 for bf16, 24 for an FP32 output (whose single
            rounding then adds one FP32 ulp to the accumulation bound).
        group_accumulation: relative error of the MMA's per-group sums (``2^−8`` for ``group_fp8``; module docstring).
    """
    a, e = actual.double().cpu(), expected.double().cpu()
    if a.shape != e.shape or not torch.equal(torch.isfinite(a), torch.isfinite(e)):
        raise AssertionError(f"shapes {tuple(a.shape)} vs {tuple(e.shape)} or non-finite positions differ")
    _, exponent = torch.frexp(e)
    ulp = torch.pow(2.0, exponent.double() - significant_bits)  # frexp's mantissa is in [0.5, 1)
    bound = ulp + (k * 2.0**-24 + group_accumulation) * magnitude.double().cpu()
    diff = torch.where(torch.isfinite(e), (a - e).abs(), 0.0)
    bad = diff > bound
    if bool(bad.any()):
        m, n = torch.nonzero(bad)[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements exceed the bound; first at ({m}, {n}): "
            f"actual {a[m, n].item()!r}, expected {e[m, n].item()!r}, bound {bound[m, n].item()!r}"
        )
