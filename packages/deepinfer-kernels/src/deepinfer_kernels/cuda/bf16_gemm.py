"""Products with a BF16 weight on the nvidia backend: ``out = x · Wᵀ`` with FP32 sums, rounded once into ``out``
(docs/design/kernels.md, "bf16_gemm").

One row times any weight (the routers, attention projections and heads of a batch-1 decode step), and two rows times
a weight of at most ``GEMV_MAX_WEIGHT_BYTES`` (not the heads), run the FMA GEMV of ``cuda.gemv``
(``bf16_gemv_kernel``): one launch that reads the weight once, adds its K chunks in chunk order (split-K: each tile's
last program) and rounds into ``out``'s dtype, a step in the dependent-launch chain like the Triton kernels around it.
cuBLAS's split-K GEMV took two launches for it (the GEMM and its reduction), and a BF16 output a third (the rounding
copy). More rows, larger weights at two rows, and every call inside ``batch_invariant_ops`` (whose products must all
run ``invariant_matmul``) run one cuBLAS GEMM with FP32 sums written in ``out``'s dtype
(``dequantized_gemm.product_into``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cuda._launch import check_launchable, dependent_launch
from deepinfer_kernels.cuda.dequantized_gemm import product_into
from deepinfer_kernels.cuda.gemm import gemv_rows
from deepinfer_kernels.cuda.gemm_operands import launch_grid, split_buffers
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, block_config, k_chunk
from deepinfer_kernels.cuda.gemv import bf16_gemv_kernel

__all__ = ["GEMV_MAX_ROWS", "GEMV_MAX_WEIGHT_BYTES", "bf16_gemm"]

# Rows up to which the FMA GEMV runs: as for the quantized GEMMs (cuda.gemm_tiles), each further row costs it a full
# pass of FMAs over the weight tile.
GEMV_MAX_ROWS = 2
# Two rows take the GEMV on weights up to this size. On an H100 (kernels_gemm-h100-s37-bf16-*.json) the LM head (1.32
# GB at the scaled preset) ran 429 µs in the GEMV's 8-column tile at one row against cuBLAS's 446, but 493 against 445
# at two rows, and the Markov head (66 MB) 27.7 against 27.7 at one row, 36.3 against 27.9 at two.
GEMV_MAX_WEIGHT_BYTES = 16 << 20


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: BlockConfig | None = None) -> None:
    """Triton / cuBLAS ``out = x · Wᵀ`` (contract of ``reference.gemm.bf16_gemm``).

    Args:
        x: [M, K] bf16/fp32, contiguous.
        weight: [N, K] bf16, contiguous.
        out: [M, N] bf16/fp32, contiguous; written.
        config: the GEMV tile to use instead of ``gemm_tiles.block_config``'s (tuning); the GEMV then runs at any M.
    """
    check_launchable(x=x, weight=weight, out=out)
    (m, n), k = out.shape, weight.shape[1]
    gemv = m == 1 or (m <= GEMV_MAX_ROWS and n * k * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES)
    if config is None and (not gemv or invariant_kernels()):
        if x.dtype == torch.bfloat16:
            product_into(x, weight.t(), out)
        else:
            out.copy_(x @ weight.float().t())
        return
    cfg = config or block_config("bf16_gemm", m, n, k)
    if not cfg.gemv:
        raise ValueError(f"bf16_gemm runs GEMV tiles (gemm_tiles.gemv_tile) only, got {cfg}")
    if cfg.split_grid and k <= k_chunk(n, k):
        cfg = replace(cfg, split_grid=False)  # one K chunk: no partial sums, no tickets (the same additions)
    rows = gemv_rows(m, cfg)
    grid, chunk = launch_grid(triton.cdiv(m, rows), n, k, cfg)
    partial, counters = split_buffers(m, n, cfg, grid, out.device)
    bf16_gemv_kernel[grid](
        x, weight, out, partial, counters, m, n, k, chunk, x.stride(0), weight.stride(0), out.stride(0),
        SPLIT_GRID=cfg.split_grid, ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dependent_launch(out.device),
    )  # fmt: skip
