"""Number formats and rounding points of the reference model (docs/design/numerics.md).

Part of the single reference model: ``deepinfer_model.reference`` re-exports the public names. Everything here is
plain PyTorch on FP32 values: UE8M0 scale bytes, e4m3 / e2m1 / TF32 rounding, the dynamic FP8 activation quantization,
the FP4 storage formats read back, the dequantization of FP8-block and MXFP4 weights, the correctly rounded inverse
RMS, and ``_Numerics``, the switch between the exact and fp32 compute modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "BF16",
    "F32",
    "Precision",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "fp4_e4m3_quant_dequant",
    "fp4_ue8m0_quant_dequant",
    "fp8_quant_dequant",
    "round_to_e2m1",
    "round_to_e4m3",
    "round_to_tf32",
    "ue8m0_to_float",
]

F32 = torch.float32
BF16 = torch.bfloat16

Precision = Literal["exact", "fp32"]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _scale_bytes(scale: Tensor) -> Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(f"UE8M0 scales must be float8_e8m0fnu or uint8, got {scale.dtype}")


def ue8m0_to_float(scale: Tensor) -> Tensor:
    """Decode UE8M0 scale bytes: byte ``b`` is ``2^(b − 127)`` (255 is NaN), built from FP32 bits so it is exact.

    Args:
        scale: ``float8_e8m0fnu`` or ``uint8`` tensor, any shape.

    Returns:
        FP32 tensor of the same shape.
    """
    b = _scale_bytes(scale).to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 0x00400000))  # byte 0 is the subnormal 2^-127
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(F32)


def _exp2(exponent: Tensor) -> Tensor:
    """Exact ``2^e`` in FP32 for an int32 tensor ``e`` in ``[-126, 127]``."""
    return ((exponent + 127) << 23).view(F32)


def _ceil_log2(ratio: Tensor) -> Tensor:
    """Exact ``⌈log2(ratio)⌉`` (int32) read from the FP32 bits of a positive normal FP32 ``ratio``
    (docs/design/numerics.md, "Activation quantization")."""
    bits = ratio.contiguous().view(torch.int32)
    return ((bits - 1) >> 23) + 1 - 127


def round_to_e4m3(x: Tensor) -> Tensor:
    """Round FP32 values to e4m3 (nearest-even, saturating at ±448) and return them as FP32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(F32)


def round_to_e2m1(x: Tensor) -> Tensor:
    """Round FP32 values to e2m1 (nearest, ties to the even code, saturating at ±6) and return them as FP32.

    The midpoints between neighbouring magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 go to the neighbour with the even code,
    which alternates between rounding down (``>``) and up (``>=``).
    """
    a = x.float().abs()
    code = (
        (a > 0.25).int()
        + (a >= 0.75).int()
        + (a > 1.25).int()
        + (a >= 1.75).int()
        + (a > 2.5).int()
        + (a >= 3.5).int()
        + (a > 5.0).int()
    )
    magnitude = torch.tensor(E2M1_VALUES, dtype=F32)[code.long()]
    return torch.copysign(magnitude, x.float())


def round_to_tf32(x: Tensor) -> Tensor:
    """Round FP32 values to TF32 (10 mantissa bits) by round-to-nearest-even; the result is FP32."""
    bits = x.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~0x1FFF).view(F32)


def _grouped(x: Tensor, group: int) -> Tensor:
    if x.shape[-1] % group != 0:
        raise ValueError(f"last dimension {x.shape[-1]} must be a multiple of the quantization group {group}")
    return x.float().unflatten(-1, (x.shape[-1] // group, group))


def fp8_quant_dequant(x: Tensor, group: int = 32) -> Tensor:
    """Dynamic FP8 e4m3 quantization with UE8M0 per-group scales, read back
    (docs/design/numerics.md, "Activation quantization").

    Per group: ``e = ⌈log2(max(amax, 1e−4) / 448)⌉``, codes ``e4m3(x·2^−e)``, value ``code·2^e``. This is both the
    activation quantization in front of every FP8 GEMM and the SWA / FP8 compressed-KV storage format.

    Args:
        x: ``[..., K]`` BF16 or FP32, ``K % group == 0``.
        group: consecutive elements sharing one scale.

    Returns:
        ``[..., K]`` FP32 dequantized values.
    """
    g = _grouped(x, group)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    e = _ceil_log2(amax / E4M3_MAX)
    return (round_to_e4m3(g * _exp2(-e)) * _exp2(e)).flatten(-2)


def fp4_ue8m0_quant_dequant(x: Tensor, group: int = 32) -> Tensor:
    """FP4 e2m1 with UE8M0 per-group scales, read back: the index-K cache and index-query format
    (docs/design/numerics.md, "KV storage formats").

    Args:
        x: ``[..., K]`` BF16 or FP32, ``K % group == 0``.
        group: elements per scale (32).

    Returns:
        ``[..., K]`` FP32 dequantized values.
    """
    g = _grouped(x, group)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(FP4_UE8M0_AMAX_FLOOR)
    e = _ceil_log2(amax / E2M1_MAX)
    return (round_to_e2m1(g * _exp2(-e)) * _exp2(e)).flatten(-2)


def fp4_e4m3_quant_dequant(x: Tensor, group: int = 16) -> Tensor:
    """FP4 e2m1 with E4M3 per-group scales, read back: the default compressed-KV format
    (docs/design/numerics.md, "KV storage formats").

    ``scale = e4m3(min(max(amax, 6·2^−9) / 6, 448))``; codes are e2m1 of ``x`` times the FP32 reciprocal of scale.

    Args:
        x: ``[..., K]`` BF16 or FP32, ``K % group == 0``.
        group: elements per scale (16).

    Returns:
        ``[..., K]`` FP32 dequantized values.
    """
    g = _grouped(x, group)
    amax = g.abs().amax(-1, keepdim=True)
    scale = round_to_e4m3((amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX))
    return (round_to_e2m1(g * (1.0 / scale)) * scale).flatten(-2)


def dequantize_fp8_block(weight: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """Dequantize an FP8 weight with 32×32 UE8M0 block scales (docs/design/numerics.md, "Weight formats").

    Args:
        weight: ``[out, in]`` ``float8_e4m3fn``.
        scale: ``[⌈out/32⌉, ⌈in/32⌉]`` UE8M0.
        block: block edge (32).

    Returns:
        ``[out, in]`` FP32.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    rows, cols = weight.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 block scale has shape {tuple(scale.shape)}, expected {expected} for weight {rows}×{cols}"
        )
    s = ue8m0_to_float(scale).repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.to(F32) * s


def dequantize_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """Dequantize MXFP4 expert weights (docs/design/numerics.md, "Weight formats"): low nibble = even column, 1×32 UE8M0
    scales.

    Args:
        packed: ``[out, in/2]`` int8 or uint8, two e2m1 codes per byte.
        scale: ``[out, in/32]`` UE8M0.

    Returns:
        ``[out, in]`` FP32.
    """
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"MXFP4 weight must be int8 or uint8 bytes, got {packed.dtype}")
    rows, half = packed.shape
    if tuple(scale.shape) != (rows, 2 * half // 32):
        raise ValueError(f"MXFP4 scale has shape {tuple(scale.shape)}, expected {(rows, 2 * half // 32)}")
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(rows, 2 * half)
    magnitude = torch.tensor(E2M1_VALUES, dtype=F32)[codes & 0x7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    return values * ue8m0_to_float(scale).repeat_interleave(32, 1)


def _dequantize_fp8_rows(rows: Tensor, scale: Tensor) -> Tensor:
    """Dequantize gathered Engram rows: ``[..., d_e]`` e4m3 with ``[..., d_e/32]`` UE8M0
    (docs/design/numerics.md, "Weight formats")."""
    return (rows.to(F32).unflatten(-1, (scale.shape[-1], 32)) * ue8m0_to_float(scale)[..., None]).flatten(-2)


@dataclass(frozen=True)
class _Numerics:
    """The four kinds of rounding point of the forward; in fp32 precision each one returns its input as FP32."""

    precision: Precision

    @property
    def exact(self) -> bool:
        return self.precision == "exact"

    def bf16(self, x: Tensor) -> Tensor:
        """A BF16 rounding point (docs/design/numerics.md, "Rounding points"): BF16 in exact mode, unrounded FP32 in
        fp32 mode."""
        return x.to(BF16) if self.exact else x.float()

    def act_quant(self, x: Tensor) -> Tensor:
        """The FP8 GEMM input (dynamic 1×32 FP8 activation quantization), read back as FP32."""
        return fp8_quant_dequant(x) if self.exact else x.float()

    def tf32(self, x: Tensor) -> Tensor:
        """An operand of the TF32 mHC mix GEMM (docs/design/numerics.md, "GEMM accumulation"), as FP32."""
        return round_to_tf32(x) if self.exact else x.float()

    def store(self, x: Tensor, quantizer: Callable[[Tensor], Tensor]) -> Tensor:
        """A vector as read back from its storage format ``quantizer`` (docs/design/numerics.md, "KV storage formats"),
        as FP32."""
        return quantizer(x) if self.exact else x.float()


def _numerics(precision: Precision) -> _Numerics:
    """The rounding points of ``precision``; anything but ``"exact"`` or ``"fp32"`` is an error."""
    if precision not in ("exact", "fp32"):
        raise ValueError(f"precision must be 'exact' or 'fp32', got {precision!r}")
    return _Numerics(precision)


def _inverse_rms(sum_squares: Tensor, width: int, eps: float) -> Tensor:
    """``1/sqrt(Σx²/d + ε)`` from the FP32 sum and the FP32 value of ``ε``, in FP64, rounded once to FP32
    (docs/design/model.md, "RMSNorm")."""
    eps_fp32 = float(torch.tensor(eps, dtype=F32))
    return (1.0 / torch.sqrt(sum_squares.double() / width + eps_fp32)).float()
