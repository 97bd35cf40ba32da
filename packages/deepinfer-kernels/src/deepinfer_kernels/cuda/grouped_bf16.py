"""Grouped MXFP4 GEMM for many rows per expert (prefill) on BF16 operands: decoding ``"swap_bf16"``
(docs/design/kernels.md, "GEMM tiles and split-K").

One launch (``quant.quantized_values``) quantizes the activation as for every decoding and writes its exact
dequantization ``x̂`` as a BF16 copy in the expert-sorted row order of the tile tables, each 32-column group's columns
in the order the weight operand's decoding produces them (``gemm_operands.word_pair_columns``); the codes never reach
memory. A tile's rows are then consecutive rows of that copy, read without a gather or any decoding. The weight is
decoded per K step into scaled BF16 straight into the registers of the MMA's first operand
(``gemm_decodings.swapped_weight``, the ``swap_ab`` decoding's), and the tile ``[BLOCK_N, BLOCK_M] = Ŵ·x̂ᵀ`` sums the
whole K in the MMA's FP32 accumulator. So there is no per-group scaling, which ``group_fp8`` pays for with two FP32
operations per output and 32 columns (as many as the FP8 MMA's rate leaves room for), and every sum is FP32 (no 13-bit
FP8 group sums). Products are exact, so only the FP32 summation order differs from the reference. The cost: the BF16
copy (2 bytes per routed row and column, written once and read once per N tile) and BF16 instead of FP8 MMAs.

Under ``TRITON_INTERPRET=1`` the weight decodes to FP32 (``swapped_weight``) and the copy is widened to FP32 for the
dot: the same values.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda.gemm_decodings import swapped_weight, swapped_weight_pointers
from deepinfer_kernels.cuda.gemm_operands import dot_in_bf16, native_fp8, operand
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
from deepinfer_kernels.cuda.quant import quantized_values

__all__ = ["sorted_bf16_activation", "swap_bf16_launch"]


@triton.jit
def _swap_bf16_kernel(  # type: ignore[no-untyped-def]
    xs_ptr, packed_ptr, ws_ptr, out_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, num_experts, stride_xs, stride_pe, stride_p, stride_se, stride_s, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr,
    NATIVE: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    # Program (tile, N block): positions [tile_start, tile_end) of the sorted order, all of expert tile_expert (a spare
    # tile of the worst-case grid has an expert ≥ num_experts and exits). EVEN: N and K multiples of the tile's (the
    # model's shapes): the weight and activation loads need only the tile's row mask.
    expert = tl.load(tile_expert_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    positions = tl.load(tile_start_ptr + tl.program_id(0)) + tl.arange(0, BLOCK_M)
    in_tile = positions < tl.load(tile_end_ptr + tl.program_id(0))
    n_rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = n_rows < N
    w_ptrs, ws_ptrs = swapped_weight_pointers(
        packed_ptr + expert.to(tl.int64) * stride_pe, ws_ptr + expert.to(tl.int64) * stride_se, n_rows, stride_p,
        stride_s, BLOCK_K,
    )  # fmt: skip
    k = tl.arange(0, BLOCK_K)
    a_ptrs = xs_ptr + positions.to(tl.int64)[None, :] * stride_xs + k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = swapped_weight(w_ptrs, ws_ptrs, k0, K, n_mask, BLOCK_N, BLOCK_K, NATIVE, EVEN)
        if EVEN:
            a = tl.load(a_ptrs + k0, mask=in_tile[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs + k0, mask=in_tile[None, :] & (k0 + k < K)[:, None], other=0.0)
        if not DOT_BF16:
            a = a.to(tl.float32)
        acc = tl.dot(operand(w, DOT_BF16), a, acc)
    rows = tl.load(order_ptr + positions, mask=in_tile, other=0).to(tl.int64)
    out_ptrs = out_ptr + rows[None, :] * stride_out + n_rows[:, None]
    tl.store(out_ptrs, to_output_dtype(acc, out_ptr), mask=in_tile[None, :] & n_mask[:, None])


def sorted_bf16_activation(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The BF16 copy ``swap_bf16`` tiles read: row ``p`` is ``x̂[order[p]]`` (x [M, K] bf16/fp32 with unit column
    stride, quantized per token and 32 columns and dequantized exactly, ``quant.quantized_values``) with each
    32-column group's columns in ``word_pair_columns`` order; order [M] from the tile tables."""
    xs = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    quantized_values(x, xs, order=order, word_pairs=True)
    return xs


def swap_bf16_launch(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: BlockConfig,
) -> None:
    """The grouped GEMM on a ``swap_bf16`` tile ``cfg``: x [M, K] the unquantized activation, packed [E, N, K/2] and
    scale [E, N, K/32] of the experts, out [M, N], ``tables`` of ``cuda.grouped_gemm.expert_tiles`` for tiles of
    ``cfg.block_m`` rows."""
    if packed.data_ptr() % 4 or packed.stride(-2) % 4:
        raise ValueError(
            "decoding 'swap_bf16' reads the packed weight in 4-byte words: its rows must be 4-byte aligned"
        )
    order, tile_expert, tile_start, tile_end = tables
    xs = sorted_bf16_activation(x, order)
    (experts, n), k = packed.shape[:2], x.shape[1]
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _swap_bf16_kernel[(tile_expert.numel(), triton.cdiv(n, cfg.block_n))](
        xs, packed.view(torch.uint8), scale.view(torch.uint8), out, order, tile_expert, tile_start, tile_end,
        n, k, experts, xs.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_BF16=dot_in_bf16(), NATIVE=native_fp8(),
        EVEN=even, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
