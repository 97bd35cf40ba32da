"""FP8 block GEMM entry points beside the dense one of ``cuda.gemm``, all on its kernels and split-K reduction
(docs/design/kernels.md, "Grouped FP8 GEMM", "GEMMs on a quantized activation"):

- ``fp8_block_grouped_gemm``: the attention's grouped output projection with an FP32 output, which the next FP8
  GEMM quantizes directly (docs/design/numerics.md, "Attention output rounding");
- ``rotated_fp8_block_grouped_gemm``: the grouped one after the de-rotation of each head's tail, which the tiles on
  ``x̂`` do inside the activation's quantization (no rotated FP32 copy written);
- ``fp8_block_gemm_quantized``: the dense GEMM on an activation a producer has already quantized (codes and scales
  in the format of ``quantize_fp8_per_token_group``), so the GEMM launches no quantizer.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.cuda.gemm import fp8_block_activation_launch, fp8_block_launch
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.cuda.rope import HeadRotation

__all__ = ["fp8_block_gemm_quantized", "fp8_block_grouped_gemm", "rotated_fp8_block_grouped_gemm"]


def fp8_block_grouped_gemm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, config: BlockConfig | None = None
) -> None:
    """Triton ``out[:, g·Ng …] = fp32(x̂[:, g·K …] · Ŵ_gᵀ)`` (contract of ``reference.gemm.fp8_block_grouped_gemm``).

    Args:
        x: [M, G·K] bf16/fp32, contiguous, ``K % 32 == 0``; G = ``x.shape[1] / K``.
        w_q: [N, K] float8_e4m3fn, contiguous; group g is rows ``g·N/G …``, ``N/G % 32 == 0``.
        w_scale: [N/32, K/32] float8_e8m0fnu, contiguous.
        out: [M, N] fp32, contiguous; written.
        config: tiles to use instead of ``gemm_tiles.block_config``'s (tuning).
    """
    check_launchable(x=x, w_q=w_q, w_scale=w_scale, out=out)
    fp8_block_activation_launch(x, w_q, w_scale, out, groups=x.shape[1] // w_q.shape[1], config=config)


def rotated_fp8_block_grouped_gemm(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    config: BlockConfig | None = None,
) -> None:
    """Triton :func:`fp8_block_grouped_gemm` of x [T, H, D] (bf16/fp32, contiguous) with each head's last
    ``2 · cos.shape[1]`` columns rotated in FP32 first (contract of ``reference.gemm.rotated_fp8_block_grouped_gemm``):
    tiles on ``x̂`` rotate inside its one quantize-and-dequantize launch, the others read an FP32 rotated copy; both
    are ``apply_rope``'s bits, so the result is that of the grouped GEMM on the rotated FP32 activation."""
    check_launchable(x=x, cos=cos, sin=sin, w_q=w_q, w_scale=w_scale, out=out)
    tokens, heads, width = x.shape
    fp8_block_activation_launch(
        x.view(tokens, heads * width), w_q, w_scale, out, groups=heads * width // w_q.shape[1], config=config,
        rotation=HeadRotation(cos, sin, width),
    )  # fmt: skip


def fp8_block_gemm_quantized(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    config: BlockConfig | None = None,
) -> None:
    """Triton ``out = bf16(x̂ · Ŵᵀ)`` for x̂ given as its codes and scales (contract of
    ``reference.gemm.fp8_block_gemm_quantized``).

    Args:
        q: [M, K] float8_e4m3fn codes, unit column stride.
        q_scale: [M, K/32] float8_e8m0fnu, unit column stride.
        w_q: [N, K] float8_e4m3fn, contiguous.
        w_scale: [ceil(N/32), K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written.
        config: tiles to use instead of ``gemm_tiles.block_config``'s (tuning).
    """
    check_launchable(q=q, q_scale=q_scale, w_q=w_q, w_scale=w_scale, out=out)
    fp8_block_launch(q.view(torch.uint8), q_scale.view(torch.uint8), w_q, w_scale, out, config=config)
