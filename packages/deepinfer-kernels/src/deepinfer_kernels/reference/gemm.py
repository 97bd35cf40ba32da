"""Reference emulation of the quantized GEMMs (docs/design/numerics.md, "Activation quantization", "GEMM accumulation").

The activation is quantized per token and 32-column group to e4m3 (docs/design/numerics.md, "Activation quantization"),
both operands are dequantized exactly, and the product is accumulated in FP64, rounded to FP32 and then to bf16. FP64
accumulation makes this the most accurate result an FP32-accumulating kernel can approach; kernels (whose accumulation
order is not reproducible) are compared with it by tolerance.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.reference import quant

__all__ = ["dequantized_gemm", "fp8_block_gemm", "mxfp4_gemm"]

_GROUP = 32


def _quantized_activation(x: torch.Tensor) -> torch.Tensor:
    """The quantized activation ``x̂`` as FP32: [num_rows, K] → [num_rows, K]."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, cols // _GROUP), dtype=torch.float8_e8m0fnu, device=x.device)
    quant.quantize_fp8_per_token_group(x, q, scale)
    x_hat = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    quant.dequantize_fp8_per_token_group(q, scale, x_hat)
    return x_hat


def dequantized_gemm(x: torch.Tensor, w_hat: torch.Tensor, out: torch.Tensor) -> None:
    """``out = bf16(x̂ · Ŵᵀ)`` for a weight given as its exact dequantized values: the product both quantized GEMMs
    below end in.

    Args:
        x: [num_rows, K] bf16/fp32 activation, ``K % 32 == 0``.
        w_hat: [N, K] fp32 or fp64, the exactly dequantized weight.
        out: [num_rows, N] bf16; written.
    """
    out.copy_((_quantized_activation(x).double() @ w_hat.double().t()).float())


def fp8_block_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = bf16(x̂ · Ŵᵀ)`` for an FP8 32×32-block weight.

    Args:
        x: [num_rows, K] bf16/fp32 activation, ``K % 32 == 0``.
        w_q: [N, K] float8_e4m3fn.
        w_scale: [ceil(N/32), K/32] float8_e8m0fnu.
        out: [num_rows, N] bf16; written.
    """
    w_hat = torch.empty(w_q.shape, dtype=torch.float32, device=w_q.device)
    quant.dequantize_fp8_block(w_q, w_scale, w_hat)
    dequantized_gemm(x, w_hat, out)


def mxfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = bf16(x̂ · Ŵᵀ)`` for an MXFP4 weight (FP8 activation × FP4 weight).

    Args:
        x: [num_rows, K] bf16/fp32 activation, ``K % 32 == 0``.
        packed: [N, K/2] int8 (low nibble = even element).
        scale: [N, K/32] float8_e8m0fnu.
        out: [num_rows, N] bf16; written.
    """
    w_hat = torch.empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.float32, device=packed.device)
    quant.dequantize_mxfp4(packed, scale, w_hat)
    dequantized_gemm(x, w_hat, out)
