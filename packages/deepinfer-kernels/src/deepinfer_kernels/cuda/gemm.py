"""Triton quantized GEMMs: FP8 activation × FP8-block or MXFP4 weight, bf16 output
(docs/design/numerics.md, "Activation quantization", "GEMM accumulation").

The activation is quantized per token and 32 columns by the Triton quantizer of ``cuda.quant`` (bit-exact with the
reference). Inside the GEMM both operands are decoded from their bytes and multiplied by their power-of-two UE8M0
scales, then rounded to bf16 for ``tl.dot``; every step is exact. Decoding works on the codes' bits
(``cuda.gemm_operands``). An e4m3 value has 4 significant bits and an e2m1 value 2, so the scaled value
is a bf16 number as long as it stays inside the normal range. That holds for every scale byte ``b`` the kernels can
meet in practice, and is the stated assumption: weight scale bytes in ``[10, 240]`` (2^−117 … 2^113; real checkpoints
use about 2^−20 … 2^0) and activation scale bytes, which the quantizer keeps in ``[105, 246]``. The tests check the
result against the FP64 reference with scale bytes 100 … 140. ``tl.dot`` then accumulates in FP32 and the result is
rounded to bf16 once (nearest even): only the FP32 accumulation order differs from the reference.

The reduction runs in K chunks fixed per weight shape (``cuda.gemm_tiles``): for few rows each chunk is a program of
its own (split-K) and each tile's last program adds the FP32 chunk sums in chunk order (``gemm_operands.finish_tile``);
for many rows one program sums its chunks in the same order. Both give the same bits. For one or two rows per weight
the launchers run the FMA kernels of ``cuda.gemv`` instead of these MMA kernels (``cuda.gemm_tiles``).

Under ``TRITON_INTERPRET=1`` the operands stay FP32 (``DOT_BF16=False``): Triton's interpreter stores bf16 as raw
uint16 and its ``tl.dot`` multiplies those integers. The values are the same (bf16-exact, hence also TF32-exact), so
only the compiled kernel's operand type differs.

``mxfp4_kernel`` also serves the grouped (per-row expert) GEMM: there each program reads which expert and which
rows of the expert-sorted order it owns from tables built on the device (``cuda.grouped_gemm``).
"""


# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda import fp8_wgmma, quant
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.dequantized_gemm import bf16_product, dequantized_activation, quantized_value_activation
from deepinfer_kernels.cuda.gemm_decodings import dot_scaled_tiles, group_tiles, swapped_tiles
from deepinfer_kernels.cuda.gemm_operands import (
    chunk_range,
    dot_in_bf16,
    e2m1_tiles,
    e4m3_tile,
    finish_tile,
    group_activation,
    launch_grid,
    native_fp8,
    operand,
    split_buffers,
)
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, block_config, decodings
from deepinfer_kernels.cuda.gemv import fp8_gemv_kernel, mxfp4_gemv_kernel
from deepinfer_kernels.cuda.gluon_ring import available
from deepinfer_kernels.cuda.rope import HeadRotation
from deepinfer_kernels.cuda.swap_bf16 import fp8_swap_bf16_launch

__all__ = [
    "activation_for",
    "deinterleaved_activation",
    "fp8_block_activation_launch",
    "fp8_block_gemm",
    "fp8_block_launch",
    "gemv_rows",
    "mxfp4_gemm",
    "mxfp4_kernel",
    "mxfp4_launch",
    "quantized_activation",
]

_GROUP = 32


@triton.jit
def _fp8_block_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_CHUNK,
    N_PER_GROUP,
    stride_q,
    stride_qs,
    stride_w,
    stride_ws,
    stride_out,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
    DECODING: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    q_ptr, qs_ptr = group_activation(q_ptr, qs_ptr, K, N_PER_GROUP, BLOCK_N)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    groups = tl.arange(0, BLOCK_K // 32)
    # The weight's 32×32 block scale serves each of its rows (n // 32).
    if DECODING == "dot_scaled":
        total = dot_scaled_tiles(
            q_ptr, qs_ptr, w_ptr, ws_ptr, rows, row_mask, n_rows, n_mask, n_rows // 32, groups, K, K_CHUNK,
            stride_q, stride_qs, stride_w, 1, stride_ws, "e4m3", SPLIT_GRID, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)
        return
    if DECODING == "group_fp16" or DECODING == "group_fp8" or DECODING == "swap_fp8":
        total = group_tiles(
            q_ptr, qs_ptr, w_ptr, ws_ptr, rows, row_mask, n_rows, n_mask, n_rows // 32, K, K_CHUNK,
            stride_q, stride_qs, stride_w, stride_ws, "e4m3", SPLIT_GRID, BLOCK_M, BLOCK_N, BLOCK_K, NATIVE_FP8,
            DECODING != "group_fp16", DECODING == "swap_fp8",
        )  # fmt: skip
        finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)
        return
    within = groups[:, None] * 32 + tl.arange(0, 32)[None, :]
    q_ptrs = q_ptr + rows[:, None, None] * stride_q + within[None, :, :]
    qs_ptrs = qs_ptr + rows[:, None] * stride_qs + groups[None, :]
    w_ptrs = w_ptr + n_rows[:, None, None] * stride_w + within[None, :, :]
    ws_ptrs = ws_ptr + (n_rows // 32)[:, None] * stride_ws + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            # K is a multiple of 32, so whole 32-column groups are in or out of range.
            group_mask = (k0 + groups * 32 < k_end)[None, :]
            a_mask = row_mask[:, None] & group_mask
            q = tl.load(q_ptrs + k0, mask=a_mask[:, :, None], other=0)
            a = e4m3_tile(q, tl.load(qs_ptrs + k0 // 32, mask=a_mask, other=0), BLOCK_M, BLOCK_K, NATIVE_FP8)
            w_mask = n_mask[:, None] & group_mask
            w = tl.load(w_ptrs + k0, mask=w_mask[:, :, None], other=0)
            b = e4m3_tile(w, tl.load(ws_ptrs + k0 // 32, mask=w_mask, other=0), BLOCK_N, BLOCK_K, NATIVE_FP8)
            acc = tl.dot(operand(a, DOT_BF16), tl.trans(operand(b, DOT_BF16)), acc)
        total += acc
    finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)


@triton.jit
def mxfp4_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    qs_ptr,
    packed_ptr,
    ws_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    order_ptr,
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    M,
    N,
    K,
    K_CHUNK,
    num_experts,
    stride_q,
    stride_qs,
    stride_pe,
    stride_p,
    stride_se,
    stride_s,
    stride_out,
    GROUPED: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr,
    DECODING: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    SCAN: tl.constexpr,
    REPEATS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Dense (``GROUPED=False``: one weight, rows ``pid·BLOCK_M …``) or grouped MXFP4 GEMM tile.

    ``DECODING`` (``gemm_tiles.BlockConfig``): ``"dot_scaled"`` gives the operands to ``tl.dot_scaled`` as they are
    stored (e4m3 activation codes in column order, packed e2m1 weight bytes, both with their UE8M0 group scales);
    Triton decodes them to the same BF16 values this kernel's own decoding gives (exact, see the module docstring)
    before the same BF16 MMA with FP32 accumulation. ``"swap_ab"`` (``swapped_tiles``) decodes the weight itself,
    scaled into BF16, straight into the registers of the MMA's first operand (the tile is computed transposed; the
    activation, in column order, is its narrow second operand). Otherwise the kernel decodes them itself, on an
    activation de-interleaved per group (``deinterleaved_activation``): scaled into BF16 (``"scaled_bf16"``) or
    unscaled FP16 with the scales applied to each group's sum (``"group_fp16"``, ``group_tiles``). ``"group_fp8"``
    (``group_tiles``) feeds the de-interleaved activation codes and the weight's codes turned into e4m3, in the same
    order, to the FP8 tensor cores, one MMA per 32-column group, the scales applied to each group's sum;
    ``"swap_fp8"`` does the same with the tile transposed (the weight as the MMA's first operand, for tiles of fewer
    than 64 rows).

    Grouped: program ``pid`` owns positions ``[block_start[pid], block_end[pid])`` of the expert-sorted row order
    ``order`` and multiplies them by expert ``block_expert[pid]``; ``block_expert ≥ num_experts`` marks a spare
    program of the worst-case grid, which exits at once. ``SCAN`` (all ``M ≤ BLOCK_M`` rows fit one tile): there are
    no tables and ``order_ptr`` holds the expert ids; program ``pid`` serves the expert of row ``pid`` if that row is
    the expert's first, with every row of that expert in one tile (so each weight is still read once), and exits
    otherwise. Product row r reads activation row ``r // REPEATS`` (a token's top-k rows read the token).
    """
    await_inputs(PDL)
    if GROUPED:
        if SCAN:
            slots = tl.arange(0, BLOCK_M)
            ids = tl.load(order_ptr + slots, mask=slots < M, other=-1)
            expert = tl.load(order_ptr + tl.program_id(0))
            first = tl.min(tl.where(ids == expert, slots, BLOCK_M), axis=0)
            if (expert < 0) | (expert >= num_experts) | (first != tl.program_id(0)):
                return
            rows = slots.to(tl.int64)
            row_mask = ids == expert
        else:
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
    a_rows = rows // REPEATS
    n_offsets = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offsets < N
    n_rows = n_offsets.to(tl.int64)
    groups = tl.arange(0, BLOCK_K // 32)
    if DECODING == "dot_scaled":
        total = dot_scaled_tiles(
            q_ptr, qs_ptr, packed_ptr, ws_ptr, a_rows, row_mask, n_rows, n_mask, n_rows, groups, K, K_CHUNK,
            stride_q, stride_qs, stride_p, 2, stride_s, "e2m1", SPLIT_GRID, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)
        return
    if DECODING == "swap_ab":
        total = swapped_tiles(
            q_ptr, qs_ptr, packed_ptr, ws_ptr, a_rows, row_mask, n_rows, n_mask, K, K_CHUNK,
            stride_q, stride_qs, stride_p, stride_s, SPLIT_GRID, BLOCK_M, BLOCK_N, BLOCK_K, DOT_BF16, NATIVE_FP8,
        )  # fmt: skip
        finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)
        return
    if DECODING == "group_fp16" or DECODING == "group_fp8" or DECODING == "swap_fp8":
        total = group_tiles(
            q_ptr, qs_ptr, packed_ptr, ws_ptr, a_rows, row_mask, n_rows, n_mask, n_rows, K, K_CHUNK,
            stride_q, stride_qs, stride_p, stride_s, "e2m1", SPLIT_GRID, BLOCK_M, BLOCK_N, BLOCK_K, NATIVE_FP8,
            DECODING != "group_fp16", DECODING == "swap_fp8",
        )  # fmt: skip
        finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)
        return
    # The activation arrives de-interleaved per 32-column group (16 even columns, then 16 odd ones; see
    # deinterleaved_activation), so each nibble plane of the packed weight meets contiguous activation bytes: the
    # product is the sum of an even-column and an odd-column dot.
    sixteen = tl.arange(0, 16)
    q_ptrs = q_ptr + a_rows[:, None, None] * stride_q + (groups[:, None] * 32 + sixteen[None, :])[None, :, :]
    qs_ptrs = qs_ptr + a_rows[:, None] * stride_qs + groups[None, :]
    p_ptrs = packed_ptr + n_rows[:, None, None] * stride_p + (groups[:, None] * 16 + sixteen[None, :])[None, :, :]
    s_ptrs = ws_ptr + n_rows[:, None] * stride_s + groups[None, :]
    first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, last):
        k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
            group_mask = (k0 + groups * 32 < k_end)[None, :]
            a_mask = row_mask[:, None] & group_mask
            a_scale = tl.load(qs_ptrs + k0 // 32, mask=a_mask, other=0)
            even_codes = tl.load(q_ptrs + k0, mask=a_mask[:, :, None], other=0)
            odd_codes = tl.load(q_ptrs + k0 + 16, mask=a_mask[:, :, None], other=0)
            a_even = e4m3_tile(even_codes, a_scale, BLOCK_M, BLOCK_K // 2, NATIVE_FP8)
            a_odd = e4m3_tile(odd_codes, a_scale, BLOCK_M, BLOCK_K // 2, NATIVE_FP8)
            w_mask = n_mask[:, None] & group_mask
            raw = tl.load(p_ptrs + k0 // 2, mask=w_mask[:, :, None], other=0)
            w_scale = tl.load(s_ptrs + k0 // 32, mask=w_mask, other=0)
            b_even, b_odd = e2m1_tiles(raw, w_scale, BLOCK_N, BLOCK_K, NATIVE_FP8)
            acc = tl.dot(operand(a_even, DOT_BF16), tl.trans(operand(b_even, DOT_BF16)), acc)
            acc = tl.dot(operand(a_odd, DOT_BF16), tl.trans(operand(b_odd, DOT_BF16)), acc)
        total += acc
    finish_tile(out_ptr, partial_ptr, counter_ptr, total, rows, row_mask, n_offsets, M, N, stride_out, SPLIT_GRID)


def quantized_activation(x: torch.Tensor, deinterleave: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 32-column e4m3 activation quantization of ``x`` [M, K] by the Triton quantizer (``deinterleave``:
    see :func:`deinterleaved_activation`).

    Returns:
        (q [M, K] uint8 e4m3 codes, scale [M, K/32] uint8 UE8M0 bytes).
    """
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], x.shape[1] // _GROUP), dtype=torch.float8_e8m0fnu, device=x.device)
    quant.quantize_fp8_per_token_group(x, q, scale, deinterleave=deinterleave)
    return q.view(torch.uint8), scale.view(torch.uint8)


def deinterleaved_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantized_activation` with each 32-column group's codes reordered for ``mxfp4_kernel``: group g holds
    columns g·32, g·32+2, …, g·32+30, then g·32+1, …, g·32+31. The quantizer stores them so, with no second pass
    (in an eager 8K prefill on the H200 the 16 strided byte copies this was before took 6.7 ms)."""
    return quantized_activation(x, deinterleave=True)


def codes_in_column_order(cfg: BlockConfig) -> bool:
    """Whether MXFP4 tiles ``cfg`` read activation codes in column order (the FMA kernels, ``tl.dot_scaled`` and
    ``swap_ab``), not de-interleaved per group (``mxfp4_kernel``'s other decodings and ``gluon_fp8``)."""
    return cfg.gemv or cfg.decoding in ("dot_scaled", "swap_ab")


def activation_for(x: torch.Tensor, cfg: BlockConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation codes an MXFP4 launch with tiles ``cfg`` reads (:func:`codes_in_column_order`; ``swap_bf16``
    quantizes the activation itself, ``cuda.swap_bf16``)."""
    return quantized_activation(x) if codes_in_column_order(cfg) else deinterleaved_activation(x)


def gemv_rows(rows: int, cfg: BlockConfig) -> int:
    """Rows per GEMV program: the rows rounded up to a power of two, at most the tile's ``block_m``."""
    return min(cfg.block_m, triton.next_power_of_2(max(rows, 1)))


def mxfp4_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor | None,
    rows_per_program: int,
    cfg: BlockConfig,
    repeats: int = 1,
) -> None:
    """Launch the MXFP4 GEMM (``cfg.gemv``: ``gemv.mxfp4_gemv_kernel`` on codes from :func:`quantized_activation`,
    else ``mxfp4_kernel`` on codes from :func:`activation_for`), dense (``tables`` None; packed [N, K/2]) or grouped
    (packed [E, N, K/2]; ``tables`` from ``grouped_gemm.expert_tiles``, or, for MMA tiles of at least M rows, the
    expert ids themselves: ``mxfp4_kernel``'s ``SCAN``). Row r of ``out`` [M, N] reads row ``r // repeats`` of the
    codes ``q`` [M / repeats, K]."""
    m, k = out.shape[0], q.shape[1]
    n = packed.shape[-2]
    grouped, scan = tables is not None, isinstance(tables, torch.Tensor)
    if cfg.decoding in ("gluon_fp8", "swap_bf16"):
        raise ValueError(f"{cfg.decoding} tiles run in the grouped GEMM's own launchers, not mxfp4_kernel")
    op = "mxfp4_grouped_gemm" if grouped else "mxfp4_gemm"
    if not cfg.gemv and cfg.decoding not in decodings(op):
        raise ValueError(f"{op} has the decodings {decodings(op)}, not {cfg.decoding!r}")
    if cfg.decoding == "swap_ab" and (packed.data_ptr() % 4 or packed.stride(-2) % 4):
        raise ValueError("decoding 'swap_ab' reads the packed weight in 4-byte words: its rows must be 4-byte aligned")
    if isinstance(tables, torch.Tensor):
        if cfg.gemv or m > rows_per_program:
            raise ValueError(f"a grouped launch without tile tables needs MMA tiles of at least M = {m} rows")
        order = tile_expert = tile_start = tile_end = tables
        row_tiles = m
    else:
        order, tile_expert, tile_start, tile_end = tables if tables is not None else (packed,) * 4
        row_tiles = tile_expert.numel() if grouped else triton.cdiv(m, rows_per_program)
    grid, chunk = launch_grid(row_tiles, n, k, cfg, grouped)
    partial, counters = split_buffers(m, n, cfg, grid, q.device)
    kernel = mxfp4_gemv_kernel if cfg.gemv else mxfp4_kernel
    rows: dict[str, int | bool | str] = (
        {"ROWS": rows_per_program, "NATIVE_FP8": native_fp8(), "E4M3_BIAS": 0 if native_fp8() else 8}
        if cfg.gemv
        else {
            "BLOCK_M": rows_per_program,
            "BLOCK_K": cfg.block_k,
            "DOT_BF16": dot_in_bf16(),
            "DECODING": cfg.decoding,
            "NATIVE_FP8": native_fp8(),
            "SCAN": scan,
        }
    )
    kernel[grid](
        q,
        q_scale,
        packed.view(torch.uint8),
        scale.view(torch.uint8),
        out,
        partial,
        counters,
        order,
        tile_expert,
        tile_start,
        tile_end,
        m,
        n,
        k,
        chunk,
        packed.shape[0] if grouped else 1,
        q.stride(0),
        q_scale.stride(0),
        packed.stride(0) if grouped else 0,
        packed.stride(-2),
        scale.stride(0) if grouped else 0,
        scale.stride(-2),
        out.stride(0),
        GROUPED=grouped,
        SPLIT_GRID=cfg.split_grid,
        BLOCK_N=cfg.block_n,
        **({"BLOCK_K": cfg.block_k} if cfg.gemv else {}),
        **rows,
        REPEATS=repeats,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **dependent_launch(out.device),
    )


# The FP8 block GEMM's decodings on the activation's BF16 dequantization x̂ rather than on its codes.
_ON_X_HAT = ("dequant_bf16", "swap_bf16")


def _x_hat_launch(
    x_hat: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, groups: int, cfg: BlockConfig
) -> None:
    if cfg.decoding == "dequant_bf16":
        bf16_product(x_hat, w_q, w_scale, out, groups)
    else:
        fp8_swap_bf16_launch(x_hat, w_q, w_scale, out, groups, cfg)


def fp8_block_launch(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    groups: int = 1,
    config: BlockConfig | None = None,
) -> None:
    """Launch the FP8 block GEMM on a quantized activation.

    ``groups`` > 1 makes it grouped: weight rows ``g·N/groups …`` multiply activation columns ``g·K …`` (K = the
    weight's width; ``N/groups`` a multiple of 32). q [M, groups·K] e4m3 codes and q_scale [M, groups·K/32] UE8M0
    bytes, both uint8 as :func:`quantized_activation` returns them (row strides free); w_q, w_scale as in
    :func:`fp8_block_gemm`; out [M, N] bf16 or fp32, unit column stride, written. ``config``: tiles to use instead of
    ``gemm_tiles.block_config``'s (tuning).
    """
    (m, n), k = out.shape, w_q.shape[1]
    cfg = config or block_config("fp8_block_gemm", m, n, k)
    if cfg.decoding not in decodings("fp8_block_gemm"):
        raise ValueError(f"the FP8 block GEMM has the decodings {decodings('fp8_block_gemm')}, not {cfg.decoding!r}")
    if cfg.decoding in _ON_X_HAT:
        _x_hat_launch(dequantized_activation(q, q_scale), w_q, w_scale, out, groups, cfg)
        return
    if cfg.decoding == "gluon_fp8":
        if available(out.device) and fp8_wgmma.fits(n, k, q, q_scale, w_q, w_scale, groups, cfg):
            fp8_wgmma.fp8_wgmma_launch(q, q_scale, w_q, w_scale, out, groups, cfg)
            return
        # The same sums from Triton (cuda.fp8_wgmma): the swap_fp8 tile in the same chunks, split as the tile says.
        cfg = replace(cfg, decoding="swap_fp8", block_m=max(16, cfg.block_m))
    _fp8_tile_launch(q, q_scale, w_q, w_scale, out, groups, cfg, quantize=False)


def _fp8_tile_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    groups: int,
    cfg: BlockConfig,
    quantize: bool,
) -> None:
    # The FMA GEMV (cfg.gemv) or the MMA kernel on codes a and scale bytes a_scale; quantize (GEMV only): a is the
    # activation itself, which the GEMV quantizes as it reads it (a_scale unused).
    (m, n), k = out.shape, w_q.shape[1]
    n_per_group = n // groups
    while groups > 1 and n_per_group % cfg.block_n:  # a tile must not straddle two groups
        cfg = replace(cfg, block_n=cfg.block_n // 2)
    rows = gemv_rows(m, cfg) if cfg.gemv else cfg.block_m
    grid, chunk = launch_grid(triton.cdiv(m, rows), n, k, cfg)
    partial, counters = split_buffers(m, n, cfg, grid, out.device)
    weight = (w_q.view(torch.uint8), w_scale.view(torch.uint8))
    args = (a, a_scale, *weight, out, partial, counters, m, n, k, chunk, n_per_group)
    strides = (a.stride(0), a_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0))
    launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    if cfg.gemv:
        fp8_gemv_kernel[grid](
            *args,
            *strides,
            SPLIT_GRID=cfg.split_grid,
            ROWS=rows,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            NATIVE_FP8=native_fp8(),
            E4M3_BIAS=0 if native_fp8() else 8,
            QUANTIZE=quantize,
            **launch,
            **dependent_launch(out.device),
        )
    else:
        _fp8_block_kernel[grid](
            *args,
            *strides,
            SPLIT_GRID=cfg.split_grid,
            BLOCK_M=rows,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            DOT_BF16=dot_in_bf16(),
            DECODING=cfg.decoding,
            NATIVE_FP8=native_fp8(),
            **launch,
            **dependent_launch(out.device),
        )


def fp8_block_gemm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, config: BlockConfig | None = None
) -> None:
    """Triton ``out = bf16(x̂ · Ŵᵀ)`` for an FP8 32×32-block weight (contract of ``reference.gemm``).

    Args:
        x: [M, K] bf16/fp32, contiguous, ``K % 32 == 0``.
        w_q: [N, K] float8_e4m3fn, contiguous.
        w_scale: [ceil(N/32), K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written.
        config: tiles to use instead of ``gemm_tiles.block_config``'s (tuning).
    """
    check_launchable(x=x, w_q=w_q, w_scale=w_scale, out=out)
    fp8_block_activation_launch(x, w_q, w_scale, out, config=config)


def fp8_block_activation_launch(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    groups: int = 1,
    config: BlockConfig | None = None,
    rotation: HeadRotation | None = None,
) -> None:
    """:func:`fp8_block_launch` on the unquantized activation x [M, groups·K] (bf16/fp32, contiguous): the
    ``dequant_bf16`` and ``swap_bf16`` decodings take ``x̂`` from one quantize-and-dequantize launch, the FMA GEMV
    quantizes x itself as it reads it (no quantizer launch), the others read the quantizer's codes. With
    ``rotation`` the activation is x with its heads' tails rotated in FP32: inside the ``x̂`` launch, else in an FP32
    copy of x (``apply_rope``'s bits either way)."""
    (m, n), k = out.shape, w_q.shape[1]
    cfg = config or block_config("fp8_block_gemm", m, n, k)
    if cfg.decoding in _ON_X_HAT:
        _x_hat_launch(quantized_value_activation(x, rotation), w_q, w_scale, out, groups, cfg)
        return
    if rotation is not None:
        x = quant.rotated_copy(x, rotation)
    if cfg.gemv:  # the FMA GEMV quantizes x as it reads it: one launch, the quantizer's codes
        _fp8_tile_launch(x, x, w_q, w_scale, out, groups, cfg, quantize=True)
        return
    q, q_scale = quantized_activation(x)
    fp8_block_launch(q, q_scale, w_q, w_scale, out, groups, config=cfg)


def mxfp4_gemm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, config: BlockConfig | None = None
) -> None:
    """Triton ``out = bf16(x̂ · Ŵᵀ)`` for an MXFP4 weight (contract of ``reference.gemm.mxfp4_gemm``).

    Args:
        x: [M, K] bf16/fp32, contiguous, ``K % 32 == 0``.
        packed: [N, K/2] int8, contiguous (low nibble = even element).
        scale: [N, K/32] float8_e8m0fnu, contiguous.
        out: [M, N] bf16, contiguous; written.
        config: tiles to use instead of ``gemm_tiles.block_config``'s (tuning).
    """
    check_launchable(x=x, packed=packed, scale=scale, out=out)
    (m, k), n = x.shape, packed.shape[0]
    cfg = config or block_config("mxfp4_gemm", m, n, k)
    q, q_scale = activation_for(x, cfg)
    rows = gemv_rows(m, cfg) if cfg.gemv else cfg.block_m
    mxfp4_launch(q, q_scale, packed, scale, out, None, rows, cfg)
