"""The FP8 block GEMM as one BF16 GEMM on exactly dequantized operands: decoding ``"dequant_bf16"``
(docs/design/kernels.md, "GEMM tiles and split-K").

Both operands go to BF16 by the Triton dequantizers of ``cuda.quant``: an e4m3 value has 4 significant bits and its
UE8M0 factor is a power of two, so ``x̂`` and ``Ŵ`` are BF16 numbers, exactly (the scale-byte assumption of
``cuda.gemm``). One cuBLAS BF16 GEMM with FP32 accumulation multiplies them and writes the output in its own dtype,
each element rounded once. cuBLAS may split K and, by default, add the partial sums in the output's dtype (BF16):
the GEMM runs with ``allow_bf16_reduced_precision_reduction`` off (``fp32_split_k_sums``), which keeps those sums
FP32, so no FP32 result has to be written, read and rounded by a copy after it (that copy took about 8 ms of an 8K
prefill on an H100). The products are exact and the sums FP32, so the contract is the other decodings' (only the FP32
summation order differs from the reference); unlike ``group_fp8`` no sum passes through the FP8 tensor cores'
13-bit accumulator.

What it costs beyond the GEMM: the weight is read as FP8 and written and read again as BF16 (5 bytes an element
instead of 1), which only many rows per weight (prefill) repay, and the two BF16 copies live for the call.
The activation's copy ``x̂`` is also the operand of the ``swap_bf16`` decoding (``cuda.swap_bf16``), which decodes
the weight in its own registers instead.
Under ``TRITON_INTERPRET=1`` (CPU tensors) the BF16 operands are widened to FP32 (exact) for an FP32 GEMM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer_kernels.cuda import quant
from deepinfer_kernels.cuda.rope import HeadRotation

__all__ = ["bf16_product", "dequantized_activation", "fp32_split_k_sums", "product_into", "quantized_value_activation"]


@contextlib.contextmanager
def fp32_split_k_sums() -> Iterator[None]:
    """cuBLAS GEMMs with BF16 output whose split-K partial sums are added in FP32, not BF16, for the block (the
    process-wide flag is restored after; the model runs on one host thread)."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = previous


def product_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` of BF16 operands (2-D, or 3-D batched) summed in FP32 and rounded once into ``out`` (bf16 or
    fp32, any strides: ATen hands cuBLAS a strided output as it is where its layout allows, else a copy of it)."""
    if a.device.type == "cuda" and out.dtype in (torch.float32, torch.bfloat16):
        product = torch.mm if a.dim() == 2 else torch.bmm
        if out.dtype == torch.float32:
            product(a, b, out_dtype=torch.float32, out=out)
        else:
            with fp32_split_k_sums():
                product(a, b, out=out)
    else:
        out.copy_(torch.matmul(a.float(), b.float()))


def dequantized_activation(q: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """``x̂`` [M, K] BF16 of the codes q [M, K] and scale bytes q_scale [M, K/32] (uint8, unit column strides)."""
    x_hat = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    quant.dequantize_fp8_per_token_group(q, q_scale, x_hat)
    return x_hat


def quantized_value_activation(x: torch.Tensor, rotation: HeadRotation | None = None) -> torch.Tensor:
    """``x̂`` [M, K] BF16 of the unquantized activation x [M, K] (bf16/fp32) from one quantize-and-dequantize launch
    (``quant.quantized_values``), its codes never stored (4 bytes an element moved instead of 6 for the quantizer
    and the dequantizer after it); with ``rotation``, of x with its heads' tails rotated in FP32 in the same launch."""
    x_hat = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    quant.quantized_values(x, x_hat, rotation=rotation)
    return x_hat


def bf16_product(x_hat: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, groups: int) -> None:
    """``out = x̂ · Ŵᵀ`` with ``Ŵ`` dequantized into a BF16 copy, one cuBLAS GEMM (x_hat [M, G·K] BF16, w_q [N, K]
    e4m3 and w_scale [N/32, K/32] UE8M0, out [M, N] bf16 or fp32; ``groups`` G > 1: weight rows ``g·N/G …``
    multiply columns ``g·K …`` of x_hat)."""
    (m, n), k = out.shape, w_q.shape[1]
    w_hat = torch.empty(w_q.shape, dtype=torch.bfloat16, device=w_q.device)
    quant.dequantize_fp8_block(w_q, w_scale, w_hat)
    if groups == 1:
        product_into(x_hat, w_hat.t(), out)
        return
    per_group = n // groups
    # [G, M, K] x [G, K, N/G] into [G, M, N/G]: strided views of the row-major copies and of out, no gather.
    product_into(
        x_hat.view(m, groups, k).transpose(0, 1),
        w_hat.view(groups, per_group, k).transpose(1, 2),
        out.view(m, groups, per_group).transpose(0, 1),
    )
