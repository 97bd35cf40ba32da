"""Reference emulation of the quantized GEMMs (docs/design/numerics.md, "Activation quantization", "GEMM accumulation").

The activation is quantized per token and 32-column group to e4m3 (docs/design/numerics.md, "Activation quantization"),
both operands are dequantized exactly, and the product is accumulated in FP64, rounded to FP32 and then to bf16. FP64
accumulation makes this the most accurate result an FP32-accumulating kernel can approach; kernels (whose accumulation
order is not reproducible) are compared with it by tolerance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer_kernels.reference import quant, rope

__all__ = [
    "bf16_gemm",
    "dequantized_gemm",
    "fp8_block_gemm",
    "fp8_block_gemm_quantized",
    "fp8_block_grouped_gemm",
    "mxfp4_gemm",
    "rotated_fp8_block_grouped_gemm",
    "rotated_fp32_copy",
]

_GROUP = 32


def _quantized_activation(x: torch.Tensor) -> torch.Tensor:
    """The quantized activation ``x̂`` as FP32: [num_rows, K] → [num_rows, K]."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, cols // _GROUP), dtype=torch.float8_e8m0fnu, device=x.device)
    quant.quantize_fp8_per_token_group(x, q, scale)
    return _dequantized_activation(q, scale)


def _dequantized_activation(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_hat = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    quant.dequantize_fp8_per_token_group(q, scale, x_hat)
    return x_hat


def _fp8_block_weight(w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    w_hat = torch.empty(w_q.shape, dtype=torch.float32, device=w_q.device)
    quant.dequantize_fp8_block(w_q, w_scale, w_hat)
    return w_hat


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x · Wᵀ`` for a BF16 weight: an FP32 GEMM over the widened operands (exact products for a BF16 x, FP32
    sums), rounded once into ``out``. FP32, not FP64, sums: the model's FP32 products (the router's logits, the LM
    head) are specified so (docs/design/numerics.md, "GEMM accumulation").

    Args:
        x: [num_rows, K] bf16/fp32.
        weight: [N, K] bf16.
        out: [num_rows, N] bf16/fp32; written.
    """
    out.copy_(x.float() @ weight.float().t())


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
    dequantized_gemm(x, _fp8_block_weight(w_q, w_scale), out)


def fp8_block_gemm_quantized(
    q: torch.Tensor, q_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """:func:`fp8_block_gemm` on an activation given as its quantized codes and scales: ``out = bf16(x̂ · Ŵᵀ)`` with
    ``x̂ = dequantize_fp8_per_token_group(q, q_scale)``.

    Args:
        q: [num_rows, K] float8_e4m3fn.
        q_scale: [num_rows, K/32] float8_e8m0fnu.
        w_q: [N, K] float8_e4m3fn.
        w_scale: [ceil(N/32), K/32] float8_e8m0fnu.
        out: [num_rows, N] bf16; written.
    """
    x_hat = _dequantized_activation(q, q_scale).double()
    out.copy_((x_hat @ _fp8_block_weight(w_q, w_scale).double().t()).float())


def fp8_block_grouped_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor) -> None:
    """Grouped ``out[:, g·N/G …] = fp32(x̂[:, g·K …] · Ŵ_gᵀ)``, Ŵ_g the weight's rows ``g·N/G … (g+1)·N/G − 1``; x̂ is
    quantized per token and 32 columns over the whole row (the same groups as per slice, K being a multiple of 32).

    Args:
        x: [num_rows, G·K] bf16/fp32 activation.
        w_q: [N, K] float8_e4m3fn, ``N/G`` a multiple of 32.
        w_scale: [N/32, K/32] float8_e8m0fnu.
        out: [num_rows, N] fp32; written.
    """
    rows, k = x.shape[0], w_q.shape[1]
    groups = x.shape[1] // k
    x_hat = _quantized_activation(x).double().view(rows, groups, k)
    w_hat = _fp8_block_weight(w_q, w_scale).double().view(groups, -1, k)
    out.copy_(torch.einsum("mgk,gnk->mgn", x_hat, w_hat).reshape(rows, -1).float())


def rotated_fp32_copy(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: Callable[..., None] = rope.apply_rope
) -> torch.Tensor:
    """x [T, H, D] as an FP32 copy [T, H·D] whose heads' last ``2 · cos.shape[1]`` columns ``rotate`` (a backend's
    ``apply_rope(x, cos, sin, out)``, the reference's by default) rotated in place."""
    rotated = x.to(torch.float32, copy=True)
    tail = rotated[..., x.shape[2] - 2 * cos.shape[1] :]
    rotate(tail, cos, sin, tail)
    return rotated.view(x.shape[0], -1)


def rotated_fp8_block_grouped_gemm(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """:func:`fp8_block_grouped_gemm` of x [T, H, D] with each head's last ``2 · cos.shape[1]`` columns rotated by
    :func:`reference.rope.apply_rope` into an FP32 copy first; out [T, N] fp32, written."""
    fp8_block_grouped_gemm(rotated_fp32_copy(x, cos, sin), w_q, w_scale, out)


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
