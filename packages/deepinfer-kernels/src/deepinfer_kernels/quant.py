"""Public FP8 / MXFP4 quantization ops and the UE8M0 decoder (docs/design/numerics.md, "Number formats").

Byte layouts at this boundary (all row-major, contiguous outputs):

- UE8M0 scale: one byte ``b`` per scale, value ``2^(b − 127)``; dtype ``torch.float8_e8m0fnu``
  (``ue8m0_to_float`` also accepts the same bytes as uint8).
- FP8 block weight: ``q`` float8_e4m3fn [out, in]; ``scale`` [⌈out/32⌉, ⌈in/32⌉]; element ``(o, i)`` uses
  ``scale[o // 32, i // 32]``.
- FP8 per-token group activation / Engram row: ``q`` float8_e4m3fn [..., K]; ``scale`` [..., K / group_size];
  element ``(r, c)`` uses ``scale[r, c // group_size]``.
- MXFP4 weight: ``packed`` int8 [out, in / 2]; byte ``(o, j)`` = code of element ``(o, 2j)`` in bits 0–3 and
  of ``(o, 2j+1)`` in bits 4–7; ``scale`` [out, in / 32] for 32 consecutive input columns::

      byte j:   | bits 7..4      | bits 3..0    |
                | e2m1(o, 2j+1)  | e2m1(o, 2j)  |
"""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import (
    FLOAT_DTYPES,
    OUT_DTYPES,
    check_dtype,
    check_ndim_at_least,
    check_same_device,
    check_tensor,
)

__all__ = [
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_mxfp4",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_mxfp4",
    "ue8m0_to_float",
]

_BLOCK = 32
_GROUP_SIZES = (32, 128)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {tuple(tensor.shape)}")


def _check_scale_shape(name: str, scale: torch.Tensor, expected: tuple[int, ...], against: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} for {against}, got {tuple(scale.shape)}")


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 scale bytes to FP32 ``ldexp(1, b − 127)`` exactly (docs/design/numerics.md, "UE8M0 scales").

    Args:
        scale: any shape, float8_e8m0fnu or uint8.

    Returns:
        FP32 tensor of the same shape (byte 255, which the format leaves unused, decodes to NaN).
    """
    check_tensor("scale", scale)
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu, torch.uint8))
    out = torch.empty(scale.shape, dtype=torch.float32, device=scale.device)
    if scale.numel():
        _registry.resolve("ue8m0_to_float", out.device.type)(scale.contiguous(), out)
    return out


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to e4m3 with one power-of-two UE8M0 scale per 32×32 block.

    Per block: ``e = ⌈log2(max(amax, 1e−4) / 448)⌉`` (the activation-quantization ceiling, so nothing saturates),
    ``q = e4m3(w · 2^−e)`` round-to-nearest-even, scale byte ``e + 127``.

    Args:
        w: [out, in] bf16/fp16/fp32.

    Returns:
        ``(q, scale)``: q [out, in] float8_e4m3fn; scale [⌈out/32⌉, ⌈in/32⌉] float8_e8m0fnu.
    """
    check_tensor("w", w)
    check_dtype("w", w.dtype, FLOAT_DTYPES)
    _check_2d("w", w)
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((_cdiv(rows, _BLOCK), _cdiv(cols, _BLOCK)), dtype=torch.float8_e8m0fnu, device=w.device)
    if w.numel():
        _registry.resolve("quantize_fp8_block", q.device.type)(w.contiguous(), q, scale)
    return q, scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize a 32×32-block FP8 weight: ``Ŵ[o, i] = e4m3(q[o, i]) · 2^(scale[o//32, i//32] − 127)``
    (docs/design/numerics.md, "Weight formats").

    Args:
        q: [out, in] float8_e4m3fn.
        scale: [⌈out/32⌉, ⌈in/32⌉] float8_e8m0fnu, same device.
        out_dtype: fp32 (default; exact), bf16 or fp16 (one rounding).

    Returns:
        [out, in] tensor of ``out_dtype``.
    """
    check_tensor("q", q)
    check_tensor("scale", scale)
    check_dtype("q", q.dtype, (torch.float8_e4m3fn,))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    check_dtype("out_dtype", out_dtype, OUT_DTYPES)
    _check_2d("q", q)
    rows, cols = q.shape
    _check_scale_shape("scale", scale, (_cdiv(rows, _BLOCK), _cdiv(cols, _BLOCK)), f"q {tuple(q.shape)}")
    check_same_device(q=q, scale=scale)
    out = torch.empty((rows, cols), dtype=out_dtype, device=q.device)
    if q.numel():
        _registry.resolve("dequantize_fp8_block", out.device.type)(q.contiguous(), scale.contiguous(), out)
    return out


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 quantization (docs/design/numerics.md, "Activation quantization").

    Per group of ``group_size`` consecutive columns: ``a = max(amax, 1e−4)``; ``e = ⌈log2(a/448)⌉`` from the
    FP32 bits of ``a/448``; ``q = e4m3(x · 2^−e)`` round-to-nearest-even; scale byte ``e + 127``. The same 1×32
    format stores FP8 Engram tables (docs/design/numerics.md, "Weight formats").

    Args:
        x: [..., K] bf16/fp16/fp32 with ``K % group_size == 0``.
        group_size: 32 (V4.1) or 128.

    Returns:
        ``(q, scale)``: q [..., K] float8_e4m3fn; scale [..., K // group_size] float8_e8m0fnu.
    """
    check_tensor("x", x)
    check_dtype("x", x.dtype, FLOAT_DTYPES)
    check_ndim_at_least("x", x, 1)
    if group_size not in _GROUP_SIZES:
        raise ValueError(f"group_size must be one of {_GROUP_SIZES}, got {group_size!r}")
    width = x.shape[-1]
    if width % group_size:
        raise ValueError(f"the last dimension of x ({width}) must be a multiple of group_size={group_size}")
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], width // group_size), dtype=torch.float8_e8m0fnu, device=x.device)
    if x.numel():
        rows = x.reshape(-1, width).contiguous()
        _registry.resolve("quantize_fp8_per_token_group", q.device.type)(
            rows, q.view(-1, width), scale.view(-1, width // group_size)
        )
    return q, scale


def dequantize_fp8_per_token_group(
    q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize per-token-group FP8: ``x̂[r, c] = e4m3(q[r, c]) · 2^(scale[r, c // group_size] − 127)``.

    ``group_size = K / scale.shape[-1]`` and must be 32 or 128.

    Args:
        q: [..., K] float8_e4m3fn.
        scale: [..., K // group_size] float8_e8m0fnu, same leading shape and device.
        out_dtype: fp32 (default; exact), bf16 or fp16 (one rounding).

    Returns:
        [..., K] tensor of ``out_dtype``.
    """
    check_tensor("q", q)
    check_tensor("scale", scale)
    check_dtype("q", q.dtype, (torch.float8_e4m3fn,))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    check_dtype("out_dtype", out_dtype, OUT_DTYPES)
    check_ndim_at_least("q", q, 1)
    width = q.shape[-1]
    num_groups = scale.shape[-1] if scale.dim() else 0
    group_ok = num_groups > 0 and width % num_groups == 0 and width // num_groups in _GROUP_SIZES
    if scale.shape[:-1] != q.shape[:-1] or not group_ok:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match q {tuple(q.shape)}: expected q's leading shape "
            f"and K / group_size columns with group_size in {_GROUP_SIZES}"
        )
    check_same_device(q=q, scale=scale)
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if q.numel():
        _registry.resolve("dequantize_fp8_per_token_group", out.device.type)(
            q.reshape(-1, width).contiguous(), scale.reshape(-1, num_groups).contiguous(), out.view(-1, width)
        )
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to MXFP4 (e2m1 codes, two per byte, UE8M0 scale per row and 32 columns).

    Per group: ``e = ⌈log2(max(amax, 6·2^−126) / 6)⌉`` from the FP32 bits; codes are the e2m1 round-to-nearest-
    even (ties to the even code) of ``w · 2^−e``.

    Args:
        w: [out, in] bf16/fp16/fp32 with ``in % 32 == 0``.

    Returns:
        ``(packed, scale)``: packed [out, in / 2] int8 (low nibble = even element); scale [out, in / 32]
        float8_e8m0fnu.
    """
    check_tensor("w", w)
    check_dtype("w", w.dtype, FLOAT_DTYPES)
    _check_2d("w", w)
    rows, cols = w.shape
    if cols % _BLOCK:
        raise ValueError(f"the input dimension of w ({cols}) must be a multiple of {_BLOCK}")
    packed = torch.empty((rows, cols // 2), dtype=torch.int8, device=w.device)
    scale = torch.empty((rows, cols // _BLOCK), dtype=torch.float8_e8m0fnu, device=w.device)
    if w.numel():
        _registry.resolve("quantize_mxfp4", packed.device.type)(w.contiguous(), packed, scale)
    return packed, scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize MXFP4: ``Ŵ[o, i] = e2m1(o, i) · 2^(scale[o, i // 32] − 127)``
    (docs/design/numerics.md, "Weight formats").

    Args:
        packed: [out, in / 2] int8 or uint8 (low nibble = even element).
        scale: [out, in / 32] float8_e8m0fnu, same device.
        out_dtype: fp32 (default; exact), bf16 or fp16.

    Returns:
        [out, in] tensor of ``out_dtype``.
    """
    check_tensor("packed", packed)
    check_tensor("scale", scale)
    check_dtype("packed", packed.dtype, (torch.int8, torch.uint8))
    check_dtype("scale", scale.dtype, (torch.float8_e8m0fnu,))
    check_dtype("out_dtype", out_dtype, OUT_DTYPES)
    _check_2d("packed", packed)
    rows, half_cols = packed.shape
    if (half_cols * 2) % _BLOCK:
        raise ValueError(
            f"packed has {half_cols} bytes per row; the logical width {half_cols * 2} must be a multiple of {_BLOCK}"
        )
    _check_scale_shape("scale", scale, (rows, half_cols * 2 // _BLOCK), f"packed {tuple(packed.shape)}")
    check_same_device(packed=packed, scale=scale)
    out = torch.empty((rows, half_cols * 2), dtype=out_dtype, device=packed.device)
    if packed.numel():
        _registry.resolve("dequantize_mxfp4", out.device.type)(
            packed.contiguous().view(torch.int8), scale.contiguous(), out
        )
    return out
