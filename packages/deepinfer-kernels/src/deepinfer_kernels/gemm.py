"""Public quantized GEMMs: dynamic FP8 activation × FP8-block or MXFP4 weight, bf16 output
(docs/design/numerics.md, "GEMM accumulation").

Implementations: the reference (an exact emulation, FP64 sums), Triton on nvidia (``cuda.gemm``, FP32 sums); ascend
falls back to the reference. ``rotated_fp8_block_grouped_gemm`` is the grouped GEMM after a rotation of each head's
tail (the attention's de-rotation, fused on nvidia into the activation's quantization).

``dequantized_gemm`` is the same product for a caller that already holds the exactly dequantized weight ``Ŵ``
(reference only): the reference quantized GEMMs dequantize their whole weight on every call, so a caller that runs
them many times on one weight (the model's CPU path) can dequantize once and get bit-identical results.

``bf16_gemm`` is the product with a BF16 weight (projections stored in BF16, the LM head): exact products, FP32 sums,
rounded once to the output dtype; the nvidia backend runs one Triton GEMV launch for one or two rows times a weight of
at most 16 MiB and cuBLAS otherwise.
"""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_ndim_at_least, check_same_device, check_tensor

__all__ = [
    "bf16_gemm",
    "dequantized_gemm",
    "fp8_block_gemm",
    "fp8_block_gemm_quantized",
    "fp8_block_grouped_gemm",
    "mxfp4_gemm",
    "rotated_fp8_block_grouped_gemm",
]

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
_BF16_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float32)
_DEQUANTIZED_DTYPES = (torch.float32, torch.float64)
_GROUP = 32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_activation(x: torch.Tensor, reduction: int) -> None:
    check_tensor("x", x)
    check_dtype("x", x.dtype, _ACTIVATION_DTYPES)
    check_ndim_at_least("x", x, 1)
    if x.shape[-1] != reduction:
        raise ValueError(f"x has {x.shape[-1]} columns but the weight's reduction dimension is {reduction}")
    if reduction % _GROUP:
        raise ValueError(f"the reduction dimension ({reduction}) must be a multiple of {_GROUP}")


def _run(
    op: str, x: torch.Tensor, weight_rows: int, *weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    out = torch.empty((*x.shape[:-1], weight_rows), dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[1] == 0:
        return out.zero_()
    _registry.resolve(op, rows.device.type)(rows, *(w.contiguous() for w in weight), out.view(-1, weight_rows))
    return out


def _check_fp8_block_weight(w_q: torch.Tensor, w_scale: torch.Tensor) -> tuple[int, int]:
    """Check an FP8 32×32-block weight; returns its shape (N, K)."""
    check_tensor("w_q", w_q)
    check_tensor("w_scale", w_scale)
    check_dtype("w_q", w_q.dtype, (torch.float8_e4m3fn,))
    check_dtype("w_scale", w_scale.dtype, (torch.float8_e8m0fnu,))
    if w_q.dim() != 2:
        raise ValueError(f"w_q must be 2-D [N, K], got shape {tuple(w_q.shape)}")
    n, k = w_q.shape
    expected = (_cdiv(n, 32), k // 32)
    if tuple(w_scale.shape) != expected:
        raise ValueError(f"w_scale must have shape {expected} for w_q {tuple(w_q.shape)}, got {tuple(w_scale.shape)}")
    return n, k


def fp8_block_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``y = bf16(x̂ · Ŵᵀ)``: x quantized per token and 32 columns (docs/design/numerics.md, "Activation quantization"),
    weight in 32×32 FP8 blocks (docs/design/numerics.md, "Weight formats").

    Args:
        x: [..., K] bf16 or fp32, ``K % 32 == 0``.
        w_q: [N, K] float8_e4m3fn, same device.
        w_scale: [⌈N/32⌉, K/32] float8_e8m0fnu, same device.

    Returns:
        [..., N] bf16.
    """
    n, k = _check_fp8_block_weight(w_q, w_scale)
    _check_activation(x, k)
    check_same_device(x=x, w_q=w_q, w_scale=w_scale)
    return _run("fp8_block_gemm", x, n, w_q, w_scale)


def fp8_block_grouped_gemm(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped ``y[..., g·N/G …] = fp32(x̂[..., g·K …] · Ŵ_gᵀ)`` with FP32 output: x quantized per token and 32 columns
    (docs/design/numerics.md, "Activation quantization"), group g multiplying input slice g by weight rows
    ``g·N/G … (g+1)·N/G − 1`` (the attention's ``wo_a``; docs/design/numerics.md, "Attention output rounding").

    Args:
        x: [..., G·K] bf16 or fp32, ``K % 32 == 0``.
        w_q: [N, K] float8_e4m3fn, same device, ``N/G`` a multiple of 32.
        w_scale: [N/32, K/32] float8_e8m0fnu, same device.
        groups: G ≥ 1.

    Returns:
        [..., N] fp32.
    """
    n = _check_grouped(x, w_q, w_scale, groups)
    return _run("fp8_block_grouped_gemm", x, n, w_q, w_scale, out_dtype=torch.float32)


def rotated_fp8_block_grouped_gemm(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, groups: int
) -> torch.Tensor:
    """:func:`fp8_block_grouped_gemm` of x's heads with each head's last ``r = 2 · cos.shape[1]`` columns rotated
    first: ``x'[t, h, D − r:] = apply_rope(x[t, h, D − r:], cos, sin)`` computed into FP32 (not rounded to x's
    dtype), the other columns x's values, then ``fp8_block_grouped_gemm(x'.reshape(T, H·D), …)``. The attention's
    de-rotation and ``wo_a`` in one op, so that the rotated FP32 values need not be written out (the nvidia backend
    rotates them inside the activation's quantization where its tile takes ``x̂``; docs/design/numerics.md,
    "Attention output rounding").

    Args:
        x: [T, H, D] bf16 or fp32 (the attention output; D even).
        cos: [T, r/2] fp32, same device, ``0 < r ≤ D``.
        sin: [T, r/2] fp32, same device (negated sines de-rotate).
        w_q: [N, K] float8_e4m3fn, same device, ``H·D = G·K``, ``N/G`` a multiple of 32.
        w_scale: [N/32, K/32] float8_e8m0fnu, same device.
        groups: G ≥ 1.

    Returns:
        [T, N] fp32.
    """
    check_tensor("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D] (the heads of each row), got shape {tuple(x.shape)}")
    tokens, heads, width = x.shape
    n = _check_grouped(x, w_q, w_scale, groups, heads * width)
    for name, table in (("cos", cos), ("sin", sin)):
        check_tensor(name, table)
        check_dtype(name, table.dtype, (torch.float32,))
        if table.dim() != 2 or table.shape[0] != tokens or not 0 < 2 * table.shape[1] <= width or width % 2:
            raise ValueError(
                f"{name} must be [T={tokens}, r/2] with r even, 0 < r <= D={width} (D even), got {tuple(table.shape)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    check_same_device(x=x, cos=cos, sin=sin)
    out = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    if out.numel():
        impl = _registry.resolve("rotated_fp8_block_grouped_gemm", x.device.type)
        impl(x.contiguous(), cos.contiguous(), sin.contiguous(), w_q.contiguous(), w_scale.contiguous(), out)
    return out


def _check_grouped(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, groups: int, columns: int | None = None
) -> int:
    """Check a grouped GEMM's weight, groups and activation (``columns`` a row, default its last dimension's);
    returns the weight's N."""
    n, k = _check_fp8_block_weight(w_q, w_scale)
    if not isinstance(groups, int) or groups < 1 or n % (32 * groups):
        raise ValueError(
            f"groups must be an int >= 1 dividing the weight's {n} rows into multiples of 32, got {groups!r}"
        )
    check_tensor("x", x)
    check_dtype("x", x.dtype, _ACTIVATION_DTYPES)
    check_ndim_at_least("x", x, 1)
    columns = x.shape[-1] if columns is None else columns
    if k % _GROUP or columns != groups * k:
        raise ValueError(
            f"x must have groups·K = {groups}·{k} columns with K a multiple of {_GROUP}, got {columns} columns"
        )
    check_same_device(x=x, w_q=w_q, w_scale=w_scale)
    return n


def fp8_block_gemm_quantized(
    q: torch.Tensor, q_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """:func:`fp8_block_gemm` on an activation already quantized by its producer: ``y = bf16(x̂ · Ŵᵀ)`` with
    ``x̂ = dequantize_fp8_per_token_group(q, q_scale)``. Equals ``fp8_block_gemm(x, …)`` bit for bit when
    ``(q, q_scale) = quantize_fp8_per_token_group(x)`` (same implementation).

    Args:
        q: [..., K] float8_e4m3fn codes, ``K % 32 == 0``.
        q_scale: [..., K/32] float8_e8m0fnu, same device.
        w_q: [N, K] float8_e4m3fn, same device.
        w_scale: [⌈N/32⌉, K/32] float8_e8m0fnu, same device.

    Returns:
        [..., N] bf16.
    """
    n, k = _check_fp8_block_weight(w_q, w_scale)
    check_tensor("q", q)
    check_tensor("q_scale", q_scale)
    check_dtype("q", q.dtype, (torch.float8_e4m3fn,))
    check_dtype("q_scale", q_scale.dtype, (torch.float8_e8m0fnu,))
    check_ndim_at_least("q", q, 1)
    if q.shape[-1] != k or k % _GROUP:
        raise ValueError(f"q has {q.shape[-1]} columns; the weight needs K = {k}, a multiple of {_GROUP}")
    if tuple(q_scale.shape) != (*q.shape[:-1], k // _GROUP):
        raise ValueError(f"q_scale must have shape {(*q.shape[:-1], k // _GROUP)}, got {tuple(q_scale.shape)}")
    check_same_device(q=q, q_scale=q_scale, w_q=w_q, w_scale=w_scale)
    out = torch.empty((*q.shape[:-1], n), dtype=torch.bfloat16, device=q.device)
    if out.numel():
        impl = _registry.resolve("fp8_block_gemm_quantized", q.device.type)
        impl(
            q.reshape(-1, k).contiguous(), q_scale.reshape(-1, k // _GROUP).contiguous(), w_q, w_scale, out.view(-1, n)
        )
    return out


def mxfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``y = bf16(x̂ · Ŵᵀ)``: x quantized per token and 32 columns (docs/design/numerics.md, "Activation quantization"),
    weight MXFP4 (docs/design/numerics.md, "Weight formats").

    Args:
        x: [..., K] bf16 or fp32, ``K % 32 == 0``.
        packed: [N, K/2] int8 or uint8 (low nibble = even element), same device.
        scale: [N, K/32] float8_e8m0fnu, same device.

    Returns:
        [..., N] bf16.
    """
    check_tensor("packed", packed)
    check_tensor("scale", scale)
    check_dtype("packed", packed.dtype, (torch.int8, torch.uint8))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [N, K/2], got shape {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_activation(x, k)
    if tuple(scale.shape) != (n, k // 32):
        raise ValueError(
            f"scale must have shape {(n, k // 32)} for packed {tuple(packed.shape)}, got {tuple(scale.shape)}"
        )
    check_same_device(x=x, packed=packed, scale=scale)
    return _run("mxfp4_gemm", x, n, packed.view(torch.int8), scale)


def bf16_gemm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``y = x · Wᵀ`` for a BF16 weight: FP32 products (exact for a BF16 ``x``), FP32 sums, rounded once to
    ``out_dtype`` (docs/design/numerics.md, "GEMM accumulation"). The reference sums in FP32 too; implementations
    differ only in summation order.

    Args:
        x: [..., K] bf16 or fp32.
        weight: [N, K] bf16, same device.
        out_dtype: bf16 or fp32 (the accumulator as it is).

    Returns:
        [..., N] of ``out_dtype``.
    """
    check_tensor("x", x)
    check_tensor("weight", weight)
    check_dtype("x", x.dtype, _ACTIVATION_DTYPES)
    check_dtype("weight", weight.dtype, (torch.bfloat16,))
    check_dtype("out_dtype", out_dtype, _BF16_GEMM_OUT_DTYPES)
    check_ndim_at_least("x", x, 1)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} columns but the weight [N, K] has K = {weight.shape[1]}")
    check_same_device(x=x, weight=weight)
    return _run("bf16_gemm", x, weight.shape[0], weight, out_dtype=out_dtype)


def dequantized_gemm(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """``y = bf16(x̂ · Ŵᵀ)`` for a weight given as its exact dequantized values (x quantized as in the GEMMs above).

    ``dequantized_gemm(x, dequantize_fp8_block(w_q, w_scale))`` equals the reference ``fp8_block_gemm(x, w_q,
    w_scale)`` bit for bit, and likewise with ``dequantize_mxfp4`` / ``mxfp4_gemm``. There is only a reference
    implementation: on a device with fast GEMMs, call those on the stored weights instead.

    Args:
        x: [..., K] bf16 or fp32, ``K % 32 == 0``.
        w_hat: [N, K] fp32 or fp64, same device.

    Returns:
        [..., N] bf16.
    """
    check_tensor("w_hat", w_hat)
    check_dtype("w_hat", w_hat.dtype, _DEQUANTIZED_DTYPES)
    if w_hat.dim() != 2:
        raise ValueError(f"w_hat must be 2-D [N, K], got shape {tuple(w_hat.shape)}")
    _check_activation(x, w_hat.shape[1])
    check_same_device(x=x, w_hat=w_hat)
    return _run("dequantized_gemm", x, w_hat.shape[0], w_hat)
