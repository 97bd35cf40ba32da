"""FP8 block GEMM entry points beside the dense one of ``cuda.gemm``, all on its kernels and split-K reduction
(docs/design/kernels.md, "Grouped FP8 GEMM", "GEMMs on a quantized activation"):

- ``fp8_block_grouped_gemm``: the attention's grouped output projection with an FP32 output, which the next FP8
  GEMM quantizes directly (docs/design/numerics.md, "Attention output rounding");
- ``fp8_block_gemm_quantized``: the dense GEMM on an activation a producer has already quantized (codes and scales
  in the format of ``quantize_fp8_per_token_group``), so the GEMM launches no quantizer.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.cuda.gemm import fp8_block_activation_launch, fp8_block_launch
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

__all__ = ["fp8_block_gemm_quantized", "fp8_block_grouped_gemm"]


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
