"""Triton quantized GEMMs: FP8 activation × FP8-block or MXFP4 weight, bf16 output
(docs/design/numerics.md, "Activation quantization", "GEMM accumulation").

The activation is quantized per token and 32 columns by the Triton quantizer of ``cuda.quant`` (bit-exact with the
reference). Inside the GEMM both operands are decoded from their bytes and multiplied by their power-of-two UE8M0
scales, then rounded to bf16 for ``tl.dot``; every step is exact. Decoding places a code's bits into an fp16 (the
e4m3 magnitude bits at bits 7–13 give the value times 2^−8, the e2m1 bits at 9–11 the value times 2^−14, subnormal
codes included, since fp16 keeps subnormals), widens it to FP32 and multiplies by ``2^(b − 127 + 8)`` resp.
``2^(b − 127 + 14)`` built from its bits. An e4m3 value has 4 significant bits and an e2m1 value 2, so the scaled value
is a bf16 number as long as it stays inside the normal range. That holds for every scale byte ``b`` the kernels can
meet in practice, and is the stated assumption: weight scale bytes in ``[10, 240]`` (2^−117 … 2^113; real checkpoints
use about 2^−20 … 2^0) and activation scale bytes, which the quantizer keeps in ``[105, 246]``. The tests check the
result against the FP64 reference with scale bytes 100 … 140. ``tl.dot`` then accumulates in FP32 and the result is
rounded to bf16 once (nearest even): only the FP32 accumulation order differs from the reference.

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
from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import check_launchable
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = [
    "BlockConfig",
    "block_config",
    "deinterleaved_activation",
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

    Every choice compiles for sm_90a without register spills (checked with ptxas). Few rows (decode) make the GEMM
    weight-bandwidth bound: small M tiles waste less of the 16-row MMA minimum, and narrow N tiles spread the weight
    stream over more SMs (N = 4096 in 32-column tiles gives 128 programs for the H200's 132 SMs); 4 pipeline stages
    keep several K steps of weight bytes in flight. Many rows (prefill) use 128×128 tiles for reuse.
    """
    if rows <= 16:
        return BlockConfig(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    if rows <= 32:
        return BlockConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows <= 64:
        return BlockConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if rows <= 256:
        return BlockConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return BlockConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


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
def _pow2(scale_bytes, bias: tl.constexpr):  # type: ignore[no-untyped-def]
    # 2^(b − 127 + bias) built from its FP32 bits; a normal number for scale bytes b ≤ 254 − bias.
    return (((scale_bytes.to(tl.int32) & 0xFF) + bias) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _half(bits):  # type: ignore[no-untyped-def]
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3_tile(raw, scale_bytes, ROWS: tl.constexpr, COLS: tl.constexpr):  # type: ignore[no-untyped-def]
    # raw [ROWS, G, W] e4m3 bytes (W bytes of each of G scale groups), scale_bytes [ROWS, G] → [ROWS, COLS = G·W]
    # FP32 values. The magnitude bits shifted into an fp16 are the e4m3 value times 2^−8, subnormals included (fp16
    # keeps subnormals), so one multiply by 2^(b − 127 + 8) finishes the decode. 0x7F / 0xFF are NaN in e4m3.
    c = raw.to(tl.int32) & 0xFF
    magnitude = c & 0x7F
    value = _half((magnitude << 7) | ((c & 0x80) << 8)) * _pow2(scale_bytes, 8)[:, :, None]
    value = tl.where(magnitude == 0x7F, (0x7FC00000 + c * 0).to(tl.float32, bitcast=True), value)
    return tl.reshape(value, (ROWS, COLS))


@triton.jit
def _e2m1_half_bits(code):  # type: ignore[no-untyped-def]
    # An e2m1 code's exponent and mantissa bits placed at fp16's bits 9–11 give the value times 2^−14 (code 1 = 0.5
    # becomes an fp16 subnormal); its sign bit goes to bit 15.
    return ((code & 0x7) << 9) | ((code & 0x8) << 12)


@triton.jit
def _e2m1_tiles(raw, scale_bytes, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    # raw [ROWS, BLOCK_K/32, 16] packed bytes, scale_bytes [ROWS, BLOCK_K/32] → the even (low-nibble) and odd
    # (high-nibble) elements as two [ROWS, BLOCK_K/2] FP32 tiles: column g·16 + j holds element g·32 + 2j of the
    # K step (even tile) or element g·32 + 2j + 1 (odd tile).
    b = raw.to(tl.int32) & 0xFF
    factor = _pow2(scale_bytes, 14)[:, :, None]
    even = tl.reshape(_half(_e2m1_half_bits(b & 0xF)) * factor, (ROWS, BLOCK_K // 2))
    odd = tl.reshape(_half(_e2m1_half_bits(b >> 4)) * factor, (ROWS, BLOCK_K // 2))
    return even, odd


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
    groups = tl.arange(0, BLOCK_K // 32)
    within = groups[:, None] * 32 + tl.arange(0, 32)[None, :]
    q_ptrs = q_ptr + rows[:, None, None] * stride_q + within[None, :, :]
    qs_ptrs = qs_ptr + rows[:, None] * stride_qs + groups[None, :]
    w_ptrs = w_ptr + n_rows[:, None, None] * stride_w + within[None, :, :]
    ws_ptrs = ws_ptr + (n_rows // 32)[:, None] * stride_ws + groups[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        # K is a multiple of 32, so whole 32-column groups are in or out of range.
        group_mask = (k0 + groups * 32 < K)[None, :]
        a_mask = row_mask[:, None] & group_mask
        q = tl.load(q_ptrs, mask=a_mask[:, :, None], other=0)
        a = _e4m3_tile(q, tl.load(qs_ptrs, mask=a_mask, other=0), BLOCK_M, BLOCK_K)
        w_mask = n_mask[:, None] & group_mask
        w = tl.load(w_ptrs, mask=w_mask[:, :, None], other=0)
        b = _e4m3_tile(w, tl.load(ws_ptrs, mask=w_mask, other=0), BLOCK_N, BLOCK_K)
        acc = tl.dot(_operand(a, DOT_BF16), tl.trans(_operand(b, DOT_BF16)), acc)
        q_ptrs += BLOCK_K
        qs_ptrs += BLOCK_K // 32
        w_ptrs += BLOCK_K
        ws_ptrs += BLOCK_K // 32
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
    # The activation arrives de-interleaved per 32-column group (16 even columns, then 16 odd ones; see
    # deinterleaved_activation), so each nibble plane of the packed weight meets contiguous activation bytes: the
    # product is the sum of an even-column and an odd-column dot, with no interleaving of decoded nibbles in registers.
    groups = tl.arange(0, BLOCK_K // 32)
    sixteen = tl.arange(0, 16)
    q_ptrs = q_ptr + rows[:, None, None] * stride_q + (groups[:, None] * 32 + sixteen[None, :])[None, :, :]
    qs_ptrs = qs_ptr + rows[:, None] * stride_qs + groups[None, :]
    p_ptrs = packed_ptr + n_rows[:, None, None] * stride_p + (groups[:, None] * 16 + sixteen[None, :])[None, :, :]
    s_ptrs = ws_ptr + n_rows[:, None] * stride_s + groups[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        group_mask = (k0 + groups * 32 < K)[None, :]
        a_mask = row_mask[:, None] & group_mask
        a_scale = tl.load(qs_ptrs, mask=a_mask, other=0)
        a_even = _e4m3_tile(tl.load(q_ptrs, mask=a_mask[:, :, None], other=0), a_scale, BLOCK_M, BLOCK_K // 2)
        a_odd = _e4m3_tile(tl.load(q_ptrs + 16, mask=a_mask[:, :, None], other=0), a_scale, BLOCK_M, BLOCK_K // 2)
        w_mask = n_mask[:, None] & group_mask
        raw = tl.load(p_ptrs, mask=w_mask[:, :, None], other=0)
        b_even, b_odd = _e2m1_tiles(raw, tl.load(s_ptrs, mask=w_mask, other=0), BLOCK_N, BLOCK_K)
        acc = tl.dot(_operand(a_even, DOT_BF16), tl.trans(_operand(b_even, DOT_BF16)), acc)
        acc = tl.dot(_operand(a_odd, DOT_BF16), tl.trans(_operand(b_odd, DOT_BF16)), acc)
        q_ptrs += BLOCK_K
        qs_ptrs += BLOCK_K // 32
        p_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32
    _store_tile(out_ptr, acc, rows, row_mask, n_offsets, N, stride_out)


def quantized_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 32-column e4m3 activation quantization of ``x`` [M, K] by the Triton quantizer.

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


def deinterleaved_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantized_activation` with each 32-column group's codes reordered for ``mxfp4_kernel``.

    Returns:
        (codes [M, K] uint8 where group g holds columns g·32, g·32+2, …, g·32+30, then g·32+1, …, g·32+31;
        scale [M, K/32] uint8 UE8M0 bytes).
    """
    q, scale = quantized_activation(x)
    rows, cols = q.shape
    codes = q.view(torch.uint8).view(rows, cols // 32, 16, 2).transpose(2, 3).reshape(rows, cols)
    return codes, scale.view(torch.uint8)


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
    codes, q_scale = deinterleaved_activation(x)
    cfg = block_config(m)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    # The routing-table pointers are unused when GROUPED is False; any tensor of the right device fills them.
    unused = packed
    mxfp4_kernel[grid](
        codes,
        q_scale,
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
        codes.stride(0),
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
