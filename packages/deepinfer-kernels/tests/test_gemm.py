"""Quantized GEMM references: equal to quantize-then-multiply with the public ops, close to the bf16 product."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import abs_product, assert_gemm_close, dequantized_activation

import deepinfer_kernels as dk
from deepinfer_kernels.testing import assert_bitwise_equal, cosine_difference, random_normal


def _composed(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    q, scale = dk.quantize_fp8_per_token_group(x)
    x_hat = dk.dequantize_fp8_per_token_group(q, scale)
    return (x_hat.double() @ w_hat.double().t()).float().to(torch.bfloat16)


def _check_composed(y: torch.Tensor, x: torch.Tensor, w_hat: torch.Tensor) -> None:
    """The reference (CPU) is bit-exact with the composition; Triton on CUDA sums in FP32 (see _gemm_support)."""
    expected = _composed(x, w_hat)
    if y.device.type == "cpu":
        assert_bitwise_equal(y, expected)
    else:
        assert_gemm_close(y, expected, abs_product(dequantized_activation(x), w_hat), x.shape[-1])


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 1, 32), (5, 70, 96), (3, 33, 64)])
def test_fp8_block_gemm(op_device: str, rows: int, n: int, k: int) -> None:
    x = random_normal((rows, k), seed=rows + n, dtype=torch.bfloat16, device=op_device)
    w = random_normal((n, k), seed=k, std=0.05, device=op_device)
    w_q, w_scale = dk.quantize_fp8_block(w)
    y = dk.fp8_block_gemm(x, w_q, w_scale)
    assert y.shape == (rows, n) and y.dtype == torch.bfloat16
    _check_composed(y, x, dk.dequantize_fp8_block(w_q, w_scale))
    exact = x.double() @ w.double().t()
    # e4m3 keeps 3 mantissa bits: each factor is within 2^−4 (relative) of its input, so each product within ~2^−3.
    bound = 2.0**-7 * exact.abs() + 0.14 * (x.double().abs() @ w.double().abs().t())
    assert torch.all((y.double() - exact).abs() <= bound)
    if rows * n >= 64:
        assert cosine_difference(y.cpu(), exact.cpu()) < 2e-3


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 1, 32), (5, 70, 96)])
def test_mxfp4_gemm(op_device: str, rows: int, n: int, k: int) -> None:
    x = random_normal((rows, k), seed=rows * n, dtype=torch.bfloat16, device=op_device)
    w = random_normal((n, k), seed=k + 1, device=op_device)
    packed, scale = dk.quantize_mxfp4(w)
    y = dk.mxfp4_gemm(x, packed, scale)
    _check_composed(y, x, dk.dequantize_mxfp4(packed, scale))
    w_hat = dk.dequantize_mxfp4(packed, scale).double()
    exact = x.double() @ w_hat.t()
    bound = 2.0**-7 * exact.abs() + 0.07 * (x.double().abs() @ w_hat.abs().t())  # only x is quantized here
    assert torch.all((y.double() - exact).abs() <= bound)


def test_gemms_by_hand(op_device: str) -> None:
    x = torch.ones(1, 32, dtype=torch.bfloat16, device=op_device)  # amax 1 → exact in e4m3 at scale 2^−8
    w_q = torch.full((1, 32), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn).to(op_device)  # all 1.0
    w_scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu).to(op_device)  # ×2
    assert dk.fp8_block_gemm(x, w_q, w_scale).item() == 64.0
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8).view(torch.int8).to(op_device)  # codes 2, 2 → 1.0
    assert dk.mxfp4_gemm(x, packed, w_scale).item() == 64.0


def test_leading_dims_empty_and_validation(op_device: str) -> None:
    w_q, w_scale = dk.quantize_fp8_block(random_normal((8, 64), seed=1, device=op_device))
    x = random_normal((2, 3, 64), seed=2, dtype=torch.bfloat16, device=op_device)
    y = dk.fp8_block_gemm(x, w_q, w_scale)
    assert y.shape == (2, 3, 8)
    assert_bitwise_equal(y.view(6, 8), dk.fp8_block_gemm(x.view(6, 64), w_q, w_scale))
    assert dk.fp8_block_gemm(x[:0], w_q, w_scale).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="x has 48 columns"):
        dk.fp8_block_gemm(x[..., :48], w_q, w_scale)
    with pytest.raises(ValueError, match="w_scale must have shape"):
        dk.fp8_block_gemm(x, w_q, w_scale[:, :1])
    with pytest.raises(TypeError, match=r"x has dtype torch\.float16"):
        dk.fp8_block_gemm(x.half(), w_q, w_scale)
    packed, scale = dk.quantize_mxfp4(random_normal((8, 64), seed=3, device=op_device))
    with pytest.raises(ValueError, match="scale must have shape"):
        dk.mxfp4_gemm(x, packed, scale[:4])


def test_bf16_gemm_shapes_dtypes_and_validation(op_device: str) -> None:
    weight = random_normal((8, 48), seed=4, dtype=torch.bfloat16, device=op_device)
    x = random_normal((2, 3, 48), seed=5, dtype=torch.bfloat16, device=op_device)
    y = dk.bf16_gemm(x, weight)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float32
    exact = x.double() @ weight.double().t()
    bound = 48 * 2.0**-24 * (x.double().abs() @ weight.double().abs().t())
    assert bool(((y.double() - exact).abs() <= bound).all())
    assert_bitwise_equal(dk.bf16_gemm(x, weight, torch.bfloat16), dk.bf16_gemm(x, weight, torch.bfloat16))
    assert dk.bf16_gemm(x, weight, torch.bfloat16).dtype == torch.bfloat16
    assert dk.bf16_gemm(x[:0], weight).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="x has 32 columns"):
        dk.bf16_gemm(x[..., :32], weight)
    with pytest.raises(TypeError, match=r"weight has dtype torch\.float32"):
        dk.bf16_gemm(x, weight.float())
    with pytest.raises(TypeError, match="out_dtype"):
        dk.bf16_gemm(x, weight, torch.float16)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        dk.bf16_gemm(x, weight[None])


def test_dequantized_gemm_equals_the_reference_gemms_bitwise() -> None:
    x = random_normal((5, 96), seed=21, dtype=torch.bfloat16)
    w_q, w_scale = dk.quantize_fp8_block(random_normal((70, 96), seed=22, std=0.05))
    w_hat = dk.dequantize_fp8_block(w_q, w_scale)
    expected = dk.fp8_block_gemm(x, w_q, w_scale)
    assert_bitwise_equal(dk.dequantized_gemm(x, w_hat), expected)
    assert_bitwise_equal(dk.dequantized_gemm(x, w_hat.double()), expected)
    packed, scale = dk.quantize_mxfp4(random_normal((70, 96), seed=23))
    assert_bitwise_equal(dk.dequantized_gemm(x, dk.dequantize_mxfp4(packed, scale)), dk.mxfp4_gemm(x, packed, scale))
    assert dk.dequantized_gemm(x[:0], w_hat).shape == (0, 70)
    with pytest.raises(TypeError, match=r"w_hat has dtype torch\.bfloat16"):
        dk.dequantized_gemm(x, w_hat.bfloat16())
    with pytest.raises(ValueError, match="x has 64 columns"):
        dk.dequantized_gemm(x[:, :64], w_hat)
    with pytest.raises(ValueError, match="w_hat must be 2-D"):
        dk.dequantized_gemm(x, w_hat[None])
