"""Triton RoPE: the interleaved-pair rotation (one program per (token, head tile), true FP32 fma, one rounding) and the
rotation table of a step's positions (one launch for its three planes)."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN201, ANN202

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch

__all__ = ["HeadRotation", "apply_rope", "rope_table", "rotated_head_tails", "rotated_pair"]


class HeadRotation(NamedTuple):
    """The rotation of each head's last ``2 · cos.shape[1]`` columns of rows of heads of ``head_width`` columns: a
    row's ``cos`` and ``sin`` ([rows, rope_dim / 2] FP32, contiguous), as ``apply_rope`` takes them."""

    cos: torch.Tensor
    sin: torch.Tensor
    head_width: int


_HEADS_PER_PROGRAM = 16
_TABLE_ROWS_PER_PROGRAM = 16


@triton.jit
def rotated_pair(x_even, x_odd, c, s):  # type: ignore[no-untyped-def]
    # The pair's rotation in FP32, one true fma each (every kernel that rotates shares it, so their bits agree).
    # Multiplying by −1 (not unary minus, which Triton lowers to 0 − x) keeps the sign of a zero product.
    return tl.fma(x_even, c, (x_odd * s) * -1.0), tl.fma(x_even, s, x_odd * c)


@triton.jit
def rotated_head_tails(x, rows, cols, row_mask, cos_ptr, sin_ptr, HEAD_WIDTH: tl.constexpr, ROPE_DIM: tl.constexpr):  # type: ignore[no-untyped-def]
    # x [R, G, 32] FP32, the values of rows [R] (int64) at columns cols [G, 32] of heads of HEAD_WIDTH columns, with
    # each head's last ROPE_DIM columns rotated by its row's cos/sin ([rows, ROPE_DIM / 2] FP32, contiguous) as
    # _rope_kernel rotates them; the other columns pass through untouched (selected, not computed).
    R: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1]
    x_even, x_odd = tl.split(tl.reshape(x, (R, G, 16, 2)))
    first, _ = tl.split(tl.reshape(cols, (G, 16, 2)))
    tail = first % HEAD_WIDTH - (HEAD_WIDTH - ROPE_DIM)
    in_tail = tail >= 0
    mask = row_mask[:, None, None] & in_tail[None, :, :]
    table = rows[:, None, None] * (ROPE_DIM // 2) + (tail // 2)[None, :, :]
    c = tl.load(cos_ptr + table, mask=mask, other=1.0)
    s = tl.load(sin_ptr + table, mask=mask, other=0.0)
    even, odd = rotated_pair(x_even, x_odd, c, s)
    even = tl.where(in_tail[None, :, :], even, x_even)
    odd = tl.where(in_tail[None, :, :], odd, x_odd)
    return tl.reshape(tl.join(even, odd), (R, G, 32))


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_heads,
    rope_dim,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_table,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_DIM)[None, :]
    mask = (heads < num_heads) & (dims < rope_dim)
    # Contiguous rows are loaded once and split into (even, odd) lanes in registers.
    x = tl.load(x_ptr + token * stride_x_token + heads * stride_x_head + dims, mask=mask, other=0.0)
    x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_HEADS, BLOCK_DIM // 2, 2)))
    pairs = tl.arange(0, BLOCK_DIM // 2)[None, :]
    pair_mask = 2 * pairs < rope_dim
    c = tl.load(cos_ptr + token * stride_table + pairs, mask=pair_mask, other=0.0)
    s = tl.load(sin_ptr + token * stride_table + pairs, mask=pair_mask, other=0.0)
    even, odd = rotated_pair(x_even, x_odd, c, s)
    rotated = tl.reshape(tl.join(even, odd), (BLOCK_HEADS, BLOCK_DIM))
    out_offsets = token * stride_out_token + heads * stride_out_head + dims
    tl.store(out_ptr + out_offsets, to_output_dtype(rotated, out_ptr), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Triton interleaved-pair rotation (numerics of ``reference.rope.apply_rope`` with a true fma).

    Args:
        x: [num_tokens, num_heads, rope_dim] bf16 or fp32, unit stride in the last dimension.
        cos: [num_tokens, rope_dim // 2] fp32, contiguous.
        sin: [num_tokens, rope_dim // 2] fp32, contiguous.
        out: [num_tokens, num_heads, rope_dim], x's dtype, unit stride in the last dimension; written. It may be
            ``x`` itself: a program loads its elements before it stores them.
    """
    check_launchable(x=x, cos=cos, sin=sin, out=out)
    num_tokens, num_heads, rope_dim = x.shape
    block_heads = min(triton.next_power_of_2(num_heads), _HEADS_PER_PROGRAM)
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rope_kernel[grid](
        x,
        cos,
        sin,
        out,
        num_heads,
        rope_dim,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        BLOCK_HEADS=block_heads,
        BLOCK_DIM=max(triton.next_power_of_2(rope_dim), 2),
        **dependent_launch(x.device),
    )


@triton.jit
def _rope_table_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,
    freqs_ptr,
    out_ptr,
    n,
    half,
    plane,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    # Rows of BLOCK_T positions; the planes (cos, sin, −sin) lie `plane` = n · half elements apart.
    await_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (rows < n) & (pairs < half)
    t = tl.load(positions_ptr + rows, mask=rows < n, other=0).to(tl.float32)
    angles = t * tl.load(freqs_ptr + pairs, mask=pairs < half, other=0.0)
    # Compiled, tl.cos and tl.sin are libdevice's cosf and sinf (not the .approx instructions): the CUDA math
    # library's, which PyTorch's polar kernel is built on.
    cos, sin = tl.cos(angles), tl.sin(angles)
    offsets = rows.to(tl.int64) * half + pairs
    tl.store(out_ptr + offsets, cos, mask=mask)
    tl.store(out_ptr + plane + offsets, sin, mask=mask)
    tl.store(out_ptr + 2 * plane + offsets, sin * -1.0, mask=mask)


def rope_table(positions: torch.Tensor, inverse_frequencies: torch.Tensor, out: torch.Tensor) -> None:
    """Triton ``reference.rope.rope_table`` (the same FP32 angles; cos and sin from the CUDA math library).

    Args:
        positions: [n] int32/int64, contiguous.
        inverse_frequencies: [r/2] fp32, contiguous.
        out: [3, n, r/2] fp32, contiguous; written.
    """
    check_launchable(positions=positions, inverse_frequencies=inverse_frequencies, out=out)
    n, half = positions.shape[0], inverse_frequencies.shape[0]
    _rope_table_kernel[(triton.cdiv(n, _TABLE_ROWS_PER_PROGRAM),)](
        positions,
        inverse_frequencies,
        out,
        n,
        half,
        n * half,
        BLOCK_T=_TABLE_ROWS_PER_PROGRAM,
        BLOCK_HALF=triton.next_power_of_2(half),
        **dependent_launch(out.device),
    )
