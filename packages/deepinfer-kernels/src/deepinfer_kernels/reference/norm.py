"""Reference RMSNorm (docs/design/model.md, "RMSNorm"): FP32 statistics and product, one rounding to the output; and
RMSNorm followed by FP8 quantization of its output (docs/design/numerics.md, "Rounding points")."""

from __future__ import annotations

import torch

from deepinfer_kernels.reference import quant

__all__ = ["rms_norm", "rms_norm_fp8"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = round(x · ρ · w)`` with ``ρ = 1 / sqrt(Σx² / H + eps)``.

    ``Σx²`` is an FP32 sum (PyTorch's reduction order); ``eps`` is taken as an FP32 value (as every kernel
    receives it); ``Σx² / H + eps`` and ``1 / sqrt(·)`` are evaluated in FP64 and rounded once to FP32 (the
    "correctly rounded" ρ); the product ``(x · ρ) · w`` is FP32.

    Args:
        x: [num_rows, hidden_size] bf16 or fp32, contiguous.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square.
        out: [num_rows, hidden_size], x's dtype; written in place.
    """
    xf = x.float()
    sum_sq = (xf * xf).sum(dim=-1, keepdim=True)
    eps_fp32 = float(torch.tensor(eps, dtype=torch.float32))
    rho = (1.0 / torch.sqrt(sum_sq.double() / x.shape[-1] + eps_fp32)).float()
    out.copy_((xf * rho) * weight.float())


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    q_deinterleaved: torch.Tensor | None = None,
) -> None:
    """:func:`rms_norm` into ``out``, then ``out``'s value (rounded to its dtype) quantized per token and 32 columns
    into ``q``/``scale`` (``quant.quantize_fp8_per_token_group``).

    Args:
        x: [num_rows, hidden_size] bf16 or fp32, contiguous, ``hidden_size % 32 == 0``.
        weight: [hidden_size] bf16 or fp32.
        eps: added to the mean square.
        out: [num_rows, hidden_size], x's dtype; written.
        q: [num_rows, hidden_size] float8_e4m3fn; written.
        scale: [num_rows, hidden_size / 32] float8_e8m0fnu; written.
        q_deinterleaved: optional [num_rows, hidden_size] float8_e4m3fn; written with ``q``'s codes, each 32-column
            group even columns first, then odd ones.
    """
    rms_norm(x, weight, eps, out)
    quant.quantize_fp8_per_token_group(out, q, scale)
    if q_deinterleaved is not None:
        quant.deinterleave_groups(q, q_deinterleaved)
