"""Triton Engram ops.

N-gram rows (docs/design/kernels.md, "engram_ngram_rows"): one program per 128 tokens walks each token's n-gram
back to front once, where PyTorch takes about thirty launches (index arithmetic, gathers, selects, a cumulative
maximum).

Lookup (docs/design/kernels.md, "engram_lookup"): one program per token forms the hash of every n-gram order and
copies each column's table row and scales, one launch where PyTorch takes about nine (the products, the xor chain,
the stack, the remainder, the offsets, two gathers).

Gate (docs/design/kernels.md, "engram_gate"): one program per token computes the gate of each of its ``m`` streams
and applies it, in one launch instead of about thirty elementwise and reduction kernels.

The three sums per stream (Σx², Σk², Σx·w·k) run over H in fixed ``BLOCK_H`` column chunks: each lane adds its column
of every chunk in chunk order, then the lanes are summed. The order depends on H and the block shape only, never on
the other tokens, so a token's result does not depend on the batch (batch-invariant by construction). The reciprocal
roots are taken in FP64 from the FP32 mean squares, as in the reference; the outputs are rounded once to the
trunk's dtype (nearest even), and inactive tokens' streams are stored as they were read.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.engram import GATE_FLOOR

__all__ = ["engram_gate", "engram_lookup", "engram_ngram_rows"]

_BLOCK_H = 512
_NGRAM_BLOCK = 128


@triton.jit
def _ngram_rows_kernel(  # type: ignore[no-untyped-def]
    ids_ptr, positions_ptr, request_ptr, q_start_ptr, prefix_ptr, table_ptr, rows_ptr, active_ptr, tokens, table_len,
    pad_id, NGRAM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = token < tokens
    position = tl.load(positions_ptr + token, mask=live, other=0)
    request = tl.load(request_ptr + token, mask=live, other=0)
    in_chunk = position - tl.load(q_start_ptr + request, mask=live, other=0)
    cut = token < 0  # all false: no negative id seen yet
    for j in tl.static_range(NGRAM):
        offset = in_chunk - j
        column = tl.minimum(tl.maximum(offset + NGRAM - 1, 0), NGRAM - 2)
        before = tl.load(prefix_ptr + request * (NGRAM - 1) + column, mask=live, other=-1)
        here = tl.load(ids_ptr + tl.maximum(token - j, 0), mask=live, other=-1)
        raw = tl.where(offset >= 0, here, before)
        known = (raw >= 0) & (raw < table_len)
        compressed = tl.load(table_ptr + tl.where(known, raw, 0), mask=live & known, other=-1)
        compressed = tl.where(known, compressed, -1)
        compressed = tl.where(position - j < 0, pad_id, compressed)
        if j == 0:
            tl.store(active_ptr + token, compressed >= 0, mask=live)
        cut = cut | (compressed < 0)
        tl.store(rows_ptr + token * NGRAM + j, tl.where(cut, pad_id, compressed), mask=live)


def engram_ngram_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    q_start: torch.Tensor,
    prefix_ids: torch.Tensor,
    old_to_new: torch.Tensor,
    pad_id: int,
    rows: torch.Tensor,
    active: torch.Tensor,
) -> None:
    """Triton ``deepinfer_kernels.engram_ngram_rows`` (contiguous tensors, shapes there)."""
    check_launchable(
        input_ids=input_ids, positions=positions, token_request=token_request, q_start=q_start, prefix_ids=prefix_ids,
        old_to_new=old_to_new, rows=rows, active=active,
    )  # fmt: skip
    tokens = input_ids.shape[0]
    _ngram_rows_kernel[(triton.cdiv(tokens, _NGRAM_BLOCK),)](
        input_ids, positions, token_request, q_start, prefix_ids, old_to_new, rows, active, tokens,
        old_to_new.shape[0], pad_id, NGRAM=rows.shape[1], BLOCK=_NGRAM_BLOCK,
        **dependent_launch(input_ids.device),
    )  # fmt: skip


@triton.jit
def _lookup_kernel(  # type: ignore[no-untyped-def]
    rows_ptr, multipliers_ptr, sizes_ptr, offsets_ptr, weight_ptr, scale_ptr, codes_ptr, scales_ptr, columns,
    NGRAM: tl.constexpr, HEADS: tl.constexpr, WIDTH: tl.constexpr, SCALES: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    column = tl.arange(0, BLOCK_C)
    live = column < columns
    order = column // HEADS + 1
    # int64 products wrap as torch's do; the xor folds the orders left to right.
    folded = tl.load(rows_ptr + token * NGRAM) * tl.load(multipliers_ptr)
    hashes = tl.zeros((BLOCK_C,), dtype=tl.int64)
    for n in tl.static_range(1, NGRAM):
        folded = folded ^ (tl.load(rows_ptr + token * NGRAM + n) * tl.load(multipliers_ptr + n))
        hashes = tl.where(order == n, folded, hashes)
    size = tl.load(sizes_ptr + column, mask=live, other=1)
    remainder = hashes % size  # the sign of the hash; torch.remainder's is the size's
    row = tl.where(remainder < 0, remainder + size, remainder) + tl.load(offsets_ptr + column, mask=live, other=0)
    byte = tl.arange(0, BLOCK_W)
    mask = live[:, None] & (byte < WIDTH)[None, :]
    code = tl.load(weight_ptr + row[:, None] * WIDTH + byte[None, :], mask=mask)
    tl.store(codes_ptr + (token * columns + column)[:, None] * WIDTH + byte[None, :], code, mask=mask)
    group = tl.arange(0, BLOCK_S)
    mask = live[:, None] & (group < SCALES)[None, :]
    value = tl.load(scale_ptr + row[:, None] * SCALES + group[None, :], mask=mask)
    tl.store(scales_ptr + (token * columns + column)[:, None] * SCALES + group[None, :], value, mask=mask)


def engram_lookup(
    rows: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Triton ``deepinfer_kernels.engram_lookup`` (contiguous tensors, shapes there); the FP8 bytes move as uint8."""
    check_launchable(
        rows=rows, multipliers=multipliers, sizes=sizes, offsets=offsets, weight=weight, scale=scale, codes=codes,
        scales=scales,
    )  # fmt: skip
    ngram, columns = rows.shape[1], sizes.numel()
    width, groups = weight.shape[1], scale.shape[1]
    _lookup_kernel[(rows.shape[0],)](
        rows, multipliers, sizes, offsets, weight.view(torch.uint8), scale.view(torch.uint8), codes.view(torch.uint8),
        scales.view(torch.uint8), columns, NGRAM=ngram, HEADS=columns // (ngram - 1), WIDTH=width, SCALES=groups,
        BLOCK_C=triton.next_power_of_2(columns), BLOCK_W=triton.next_power_of_2(width),
        BLOCK_S=triton.next_power_of_2(groups),
        **dependent_launch(rows.device),
    )  # fmt: skip


@triton.jit
def _reciprocal_rms(sum_sq, hidden, eps):  # type: ignore[no-untyped-def]
    # 1 / sqrt(Σu² / H + eps): the mean square in FP32, the root and reciprocal in FP64, rounded once to FP32.
    return (1.0 / tl.sqrt((sum_sq / hidden + eps).to(tl.float64))).to(tl.float32)


@triton.jit
def _engram_gate_kernel(  # type: ignore[no-untyped-def]
    trunk_ptr,
    keys_ptr,
    value_ptr,
    q_ptr,
    k_ptr,
    active_ptr,
    out_ptr,
    streams,
    eps,
    sqrt_hidden,
    stride_trunk_t,
    stride_trunk_m,
    stride_keys_t,
    stride_keys_m,
    stride_value_t,
    stride_out_t,
    stride_out_m,
    HIDDEN: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FLOOR: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    m = tl.arange(0, M_PAD)
    m_ok = m < streams
    cols = tl.arange(0, BLOCK_H)
    xx = tl.zeros((M_PAD, BLOCK_H), dtype=tl.float32)
    kk = tl.zeros((M_PAD, BLOCK_H), dtype=tl.float32)
    xwk = tl.zeros((M_PAD, BLOCK_H), dtype=tl.float32)
    # Unrolled over the constexpr width, so a token's program issues the loads of every chunk without waiting for the
    # previous chunk's (one program a token: at batch 1 a loop of dependent round trips); the sums are unchanged.
    for h0 in tl.static_range(0, HIDDEN, BLOCK_H):
        h = h0 + cols
        mask = m_ok[:, None] & (h < HIDDEN)[None, :]
        x = tl.load(trunk_ptr + t * stride_trunk_t + m[:, None] * stride_trunk_m + h[None, :], mask=mask, other=0)
        k = tl.load(keys_ptr + t * stride_keys_t + m[:, None] * stride_keys_m + h[None, :], mask=mask, other=0)
        weight_at = m[:, None] * HIDDEN + h[None, :]
        w = tl.load(q_ptr + weight_at, mask=mask, other=0).to(tl.float32)
        w = w * tl.load(k_ptr + weight_at, mask=mask, other=0).to(tl.float32)
        x = x.to(tl.float32)
        k = k.to(tl.float32)
        xx += x * x
        kk += k * k
        xwk += x * w * k
    z = tl.sum(xwk, axis=1) * _reciprocal_rms(tl.sum(xx, axis=1), HIDDEN, eps)
    z = z * _reciprocal_rms(tl.sum(kk, axis=1), HIDDEN, eps) / sqrt_hidden
    # copysign(sqrt(max(|z|, floor)), z) on the bits: z = +0 counts as positive, −0 as negative, as in the reference.
    magnitude = tl.sqrt(tl.maximum(tl.abs(z), FLOOR))
    signed = (magnitude.to(tl.int32, bitcast=True) | (z.to(tl.int32, bitcast=True) & -0x80000000)).to(
        tl.float32, bitcast=True
    )
    gate = tl.sigmoid(signed)
    active = tl.load(active_ptr + t + m * 0) != 0
    for h0 in tl.static_range(0, HIDDEN, BLOCK_H):
        h = h0 + cols
        mask = m_ok[:, None] & (h < HIDDEN)[None, :]
        x = tl.load(trunk_ptr + t * stride_trunk_t + m[:, None] * stride_trunk_m + h[None, :], mask=mask, other=0)
        v = tl.load(value_ptr + t * stride_value_t + h, mask=h < HIDDEN, other=0).to(tl.float32)
        updated = to_output_dtype(x.to(tl.float32) + gate[:, None] * v[None, :], out_ptr)
        result = tl.where(active[:, None], updated, x)
        tl.store(out_ptr + t * stride_out_t + m[:, None] * stride_out_m + h[None, :], result, mask=mask)


def engram_gate(
    trunk: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    active: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    """Triton ``deepinfer_kernels.engram_gate`` (shapes there; last dimensions contiguous, weights contiguous)."""
    check_launchable(trunk=trunk, keys=keys, value=value, q_weight=q_weight, k_weight=k_weight, out=out)
    tokens, streams, hidden = trunk.shape
    _engram_gate_kernel[(tokens,)](
        trunk,
        keys,
        value,
        q_weight,
        k_weight,
        active.view(torch.uint8),
        out,
        streams,
        eps,
        math.sqrt(hidden),
        trunk.stride(0),
        trunk.stride(1),
        keys.stride(0),
        keys.stride(1),
        value.stride(0),
        out.stride(0),
        out.stride(1),
        HIDDEN=hidden,
        M_PAD=triton.next_power_of_2(streams),
        BLOCK_H=min(_BLOCK_H, triton.next_power_of_2(hidden)),
        FLOOR=GATE_FLOOR,
        num_warps=4,
        **dependent_launch(trunk.device),
    )
