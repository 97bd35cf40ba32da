"""Reference rotary embedding on interleaved pairs (docs/design/model.md, "RoPE and YaRN")."""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_table"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Rotate pairs ``(x[2i], x[2i+1])`` by the angle whose cosine and sine are given.

    ``x'[2i] = fma(x[2i], c, −(x[2i+1]·s))`` and ``x'[2i+1] = fma(x[2i], s, x[2i+1]·c)`` in FP32, then one
    rounding to the storage dtype. The fma is emulated in FP64: the product ``x·c`` is exact there and the
    single FP64 sum is rounded to FP32 (a double rounding that can differ from a true fma in the last FP32
    bit in rare cases).

    Args:
        x: [num_tokens, num_heads, rope_dim] bf16 or fp32 (any strides).
        cos: [num_tokens, rope_dim // 2] fp32.
        sin: [num_tokens, rope_dim // 2] fp32.
        out: [num_tokens, num_heads, rope_dim], x's dtype; written (it may be ``x``: both halves are read first).
    """
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    c = cos[:, None, :].float()
    s = sin[:, None, :].float()
    even = (x_even.double() * c.double() - (x_odd * s).double()).float()
    odd = (x_even.double() * s.double() + (x_odd * c).double()).float()
    out[..., 0::2] = even
    out[..., 1::2] = odd


def rope_table(positions: torch.Tensor, inverse_frequencies: torch.Tensor, out: torch.Tensor) -> None:
    """Planes cos, sin and −sin of the FP32 angles ``fp32(fp32(t) · f_i)``, evaluated through the complex polar form.

    Args:
        positions: [n] int32/int64, contiguous.
        inverse_frequencies: [r/2] fp32, contiguous.
        out: [3, n, r/2] fp32; written.
    """
    angles = positions.to(torch.float32)[:, None] * inverse_frequencies[None, :]
    rotation = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    out[0] = rotation[..., 0]
    out[1] = rotation[..., 1]
    torch.neg(rotation[..., 1], out=out[2])
