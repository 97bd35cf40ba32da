"""Triton quantized GEMMs: FP8 activation × FP8-block or MXFP4 weight, bf16 output (model-core §5.5/§5.6).

The activation is quantized per token and 32 columns by the Triton quantizer of ``cuda.quant`` (bit-exact with the
reference). Inside the GEMM both operands are decoded from their bytes (integer arithmetic, ``cuda._formats``) and
multiplied by their power-of-two UE8M0 scales to bf16, which is exact: an e4m3 value has 4 significant bits and an
e2m1 value 2, so with a power-of-two scale the product is representable in bf16 (8 bits, FP32's exponent range) as
long as it stays inside bf16's range, i.e. ``2^−133 ≤ |value| < 2^128``. Activation scales are ``≥ 2^−22`` by the
1e−4 amax floor, and real weight scale bytes are far from the ends of the UE8M0 range, so the assumption holds for
any checkpoint; the tests compare against the FP64 reference. ``tl.dot`` then accumulates in FP32 and the result is
rounded to bf16 once (nearest even). Only the FP32 accumulation order differs from the reference.

Under ``TRITON_INTERPRET=1`` the operands stay FP32 (``DOT_BF16=False``): Triton's interpreter stores bf16 as raw
uint16 and its ``tl.dot`` multiplies those integers. The values are the same (bf16-exact, hence also TF32-exact), so
only the compiled kernel's operand type differs.

``mxfp4_kernel`` also serves the grouped (per-row expert) GEMM: there each program reads which expert and which
rows of the expert-sorted order it owns from tables built on the device (``cuda.grouped_gemm``).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda import quant
from deepinfer_kernels.cuda._formats import e2m1_decode, e4m3_decode, to_output_dtype, ue8m0_decode
from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = [
    "BlockConfig",
    "block_config",
    "dot_in_bf16",
    "fp8_block_gemm",
    "mxfp4_gemm",
    "mxfp4_kernel",
    "quantized_activation",
]

_GROUP = 32


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch options of one GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_config(rows: int) -> BlockConfig:
    """Tiles for ``rows`` activation rows per weight (per expert for the grouped GEMM), chosen for SM90.

    Few rows (decode) make the GEMM weight-bandwidth bound: small M tiles waste less of the 16-row MMA minimum and
    narrow N tiles spread the weight stream over more SMs (N = 4096 in 32-column tiles gives 128 programs for the
    H200's 132 SMs). Many rows (prefill) use 128×128 tiles for reuse.
    """
    if rows <= 16:
        return BlockConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if rows <= 32:
        return BlockConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows <= 64:
        return BlockConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows <= 256:
        return BlockConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return BlockConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def dot_in_bf16() -> bool:
    """Value of the kernels' ``DOT_BF16``: bf16 MMA operands when compiled, FP32 in the interpreter."""
    return not triton_interpreter_enabled()


@triton.jit
def _operand(value, DOT_BF16: tl.constexpr):  # type: ignore[no-untyped-def]
    if DOT_BF16:
        return value.to(tl.bfloat16)
    else:
        return value


@triton.jit
def _activation_tile(  # type: ignore[no-untyped-def]
    q_ptr, qs_ptr, rows, row_mask, k0, K, stride_q, stride_qs, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr
):
    # x̂ for [BLOCK_M, BLOCK_K] as a dot operand (exact, see the module docstring); masked entries are 0.
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = row_mask[:, None] & (cols < K)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :], mask=mask, other=0)
    s = tl.load(qs_ptr + rows[:, None] * stride_qs + (cols // 32)[None, :], mask=mask, other=127)
    return _operand(e4m3_decode(q) * ue8m0_decode(s), DOT_BF16)


@triton.jit
def _store_tile(out_ptr, acc, rows, row_mask, n_offsets, N, stride_out):  # type: ignore[no-untyped-def]
    mask = row_mask[:, None] & (n_offsets < N)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + n_offsets[None, :], to_output_dtype(acc, out_ptr), mask=mask)


@triton.jit
def _fp8_block_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_q,
    stride_qs,
    stride_w,
    stride_ws,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _activation_tile(q_ptr, qs_ptr, rows, row_mask, k0, K, stride_q, stride_qs, BLOCK_K, DOT_BF16)
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + n_rows[:, None] * stride_w + cols[None, :], mask=mask, other=0)
        s = tl.load(ws_ptr + (n_rows // 32)[:, None] * stride_ws + (cols // 32)[None, :], mask=mask, other=127)
        b = _operand(e4m3_decode(w) * ue8m0_decode(s), DOT_BF16)
        acc = tl.dot(a, tl.trans(b), acc)
    _store_tile(out_ptr, acc, rows, row_mask, n_offsets, N, stride_out)


@triton.jit
def mxfp4_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    packed_ptr,
    ws_ptr,
    out_ptr,
    order_ptr,
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    M,
    N,
    K,
    num_experts,
    stride_q,
    stride_qs,
    stride_pe,
    stride_p,
    stride_se,
    stride_s,
    stride_out,
    GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """Dense (``GROUPED=False``: one weight, rows ``pid·BLOCK_M …``) or grouped MXFP4 GEMM tile.

    Grouped: program ``pid`` owns positions ``[block_start[pid], block_end[pid])`` of the expert-sorted row order
    ``order`` and multiplies them by expert ``block_expert[pid]``; ``block_expert ≥ num_experts`` marks a spare
    program of the worst-case grid, which exits at once (its rows, if any, belong to no expert and stay zero).
    """
    if GROUPED:
        expert = tl.load(block_expert_ptr + tl.program_id(0))
        if expert >= num_experts:
            return
        positions = tl.load(block_start_ptr + tl.program_id(0)) + tl.arange(0, BLOCK_M)
        row_mask = positions < tl.load(block_end_ptr + tl.program_id(0))
        rows = tl.load(order_ptr + positions, mask=row_mask, other=0).to(tl.int64)
        packed_ptr += expert.to(tl.int64) * stride_pe
        ws_ptr += expert.to(tl.int64) * stride_se
    else:
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < M
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _activation_tile(q_ptr, qs_ptr, rows, row_mask, k0, K, stride_q, stride_qs, BLOCK_K, DOT_BF16)
        byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte_mask = n_mask[:, None] & (byte_cols < K // 2)[None, :]
        raw = tl.load(packed_ptr + n_rows[:, None] * stride_p + byte_cols[None, :], mask=byte_mask, other=0)
        raw = raw.to(tl.int32) & 0xFF
        # Low nibble = even element, high = odd: joining on a new last axis and flattening interleaves them.
        codes = tl.reshape(tl.join(raw & 0xF, raw >> 4), (BLOCK_N, BLOCK_K))
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (cols < K)[None, :]
        s = tl.load(ws_ptr + n_rows[:, None] * stride_s + (cols // 32)[None, :], mask=mask, other=127)
        b = _operand(e2m1_decode(codes) * ue8m0_decode(s), DOT_BF16)
        acc = tl.dot(a, tl.trans(b), acc)
    _store_tile(out_ptr, acc, rows, row_mask, n_offsets, N, stride_out)


def quantized_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """§5.5 per-token 32-column e4m3 quantization of ``x`` [M, K] by the Triton quantizer.

    Returns:
        (q [M, K] float8_e4m3fn, scale [M, K/32] float8_e8m0fnu).
    """
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], x.shape[1] // _GROUP), dtype=torch.float8_e8m0fnu, device=x.device)
    quant.quantize_fp8_per_token_group(x, q, scale)
    return q, scale


def fp8_block_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor) -> None:
    """Triton ``out = bf16(x̂ · Ŵᵀ)`` for an FP8 32×32-block weight (contract of ``reference.gemm``).

    Args:
        x: [M, K] bf16/fp32, contiguous, ``K % 32 == 0``.
        w_q: [N, K] float8_e4m3fn, contiguous.
        w_scale: [ceil(N/32), K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written.
    """
    check_launchable(x=x, w_q=w_q, w_scale=w_scale, out=out)
    (m, k), n = x.shape, w_q.shape[0]
    q, q_scale = quantized_activation(x)
    cfg = block_config(m)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _fp8_block_kernel[grid](
        q.view(torch.uint8),
        q_scale.view(torch.uint8),
        w_q.view(torch.uint8),
        w_scale.view(torch.uint8),
        out,
        m,
        n,
        k,
        q.stride(0),
        q_scale.stride(0),
        w_q.stride(0),
        w_scale.stride(0),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_BF16=dot_in_bf16(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def mxfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Triton ``out = bf16(x̂ · Ŵᵀ)`` for an MXFP4 weight (contract of ``reference.gemm.mxfp4_gemm``).

    Args:
        x: [M, K] bf16/fp32, contiguous, ``K % 32 == 0``.
        packed: [N, K/2] int8, contiguous (low nibble = even element).
        scale: [N, K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written.
    """
    check_launchable(x=x, packed=packed, scale=scale, out=out)
    (m, k), n = x.shape, packed.shape[0]
    q, q_scale = quantized_activation(x)
    cfg = block_config(m)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    # The routing-table pointers are unused when GROUPED is False; any tensor of the right device fills them.
    unused = packed
    mxfp4_kernel[grid](
        q.view(torch.uint8),
        q_scale.view(torch.uint8),
        packed.view(torch.uint8),
        scale.view(torch.uint8),
        out,
        unused,
        unused,
        unused,
        unused,
        m,
        n,
        k,
        1,
        q.stride(0),
        q_scale.stride(0),
        0,
        packed.stride(0),
        0,
        scale.stride(0),
        out.stride(0),
        GROUPED=False,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_BF16=dot_in_bf16(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
