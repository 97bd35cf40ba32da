"""Byte layouts of cached rows (model-attention §8). Every cache pool is a uint8 tensor ``[..., bytes_per_row]``;
a codec encodes FP32 vectors into rows and decodes rows back to the exact dequantized values attention reads.

| codec              | use (exact mode)                       | row layout                                   |
|--------------------|----------------------------------------|----------------------------------------------|
| ``Fp8RowCodec``    | SWA rings; compressed rows (FP8 mode)  | ``[e4m3 × w | UE8M0 × w/32]``                |
| ``Fp4E4m3RowCodec``| compressed rows (``use_fp4_sparse_kv``) | ``[e2m1 pairs × w/2 | e4m3 scale × w/16]``   |
| ``Fp4Ue8m0RowCodec``| index-K rows                          | ``[e2m1 pairs × w/2 | UE8M0 × w/32]``        |
| ``RawFp32RowCodec``| compressor state; every cache in FP32 mode | ``[fp32 × w]`` little-endian bytes      |

FP4 pairs hold element ``2i`` in the low nibble and ``2i+1`` in the high nibble.
"""

from __future__ import annotations

import abc

import torch

from deepinfer_kernels import (
    dequantize_fp8_per_token_group,
    dequantize_mxfp4,
    quantize_fp8_per_token_group,
    quantize_mxfp4,
)

__all__ = ["Fp4E4m3RowCodec", "Fp4Ue8m0RowCodec", "Fp8RowCodec", "RawFp32RowCodec", "RowCodec"]

# Rounding boundaries between consecutive e2m1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); at a tie the even code
# wins, so the boundary belongs to the upper code for odd boundary indices (0.75, 1.75, 3.5) and to the lower code
# otherwise.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_E4M3_GROUP = 16
_FP4_SCALE_FLOOR = 6.0 * 2.0**-9


class RowCodec(abc.ABC):
    """Encodes ``[n, width]`` FP32 vectors into ``[n, bytes_per_row]`` uint8 rows and back."""

    def __init__(self, width: int) -> None:
        self.width = width

    @property
    @abc.abstractmethod
    def bytes_per_row(self) -> int:
        """Bytes of one encoded row."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [n, width] bf16/fp32. Returns: [n, bytes_per_row] uint8."""

    @abc.abstractmethod
    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Args: rows [..., bytes_per_row] uint8. Returns: [..., width] fp32 dequantized values."""


class RawFp32RowCodec(RowCodec):
    """Unquantized FP32 rows."""

    @property
    def bytes_per_row(self) -> int:
        return 4 * self.width

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().contiguous().view(torch.uint8)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.contiguous().view(torch.float32)


class Fp8RowCodec(RowCodec):
    """e4m3 with one UE8M0 scale per 32 elements (the §5.5 recipe)."""

    @property
    def bytes_per_row(self) -> int:
        return self.width + self.width // 32

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_fp8_per_token_group(x, 32)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        q = rows[..., : self.width].contiguous().view(torch.float8_e4m3fn)
        scale = rows[..., self.width :].contiguous().view(torch.float8_e8m0fnu)
        return dequantize_fp8_per_token_group(q, scale)


class Fp4Ue8m0RowCodec(RowCodec):
    """e2m1 with one UE8M0 scale per 32 elements (index K, index q)."""

    @property
    def bytes_per_row(self) -> int:
        return self.width // 2 + self.width // 32

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        packed, scale = quantize_mxfp4(x.reshape(-1, self.width))
        return torch.cat([packed.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(*x.shape[:-1], -1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1, self.bytes_per_row)
        packed = flat[:, : self.width // 2].contiguous()
        scale = flat[:, self.width // 2 :].contiguous().view(torch.float8_e8m0fnu)
        return dequantize_mxfp4(packed, scale).view(*rows.shape[:-1], self.width)


def _e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even e2m1 codes (uint8, sign in bit 3) of FP32 values already scaled into ``[−6, 6]``."""
    magnitude = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for index, bound in enumerate(_E2M1_BOUNDS):
        passed = magnitude >= bound if index % 2 == 1 else magnitude > bound
        code += passed.to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    # Computed, not looked up in a host-built table: a table copied to the device inside a step would break CUDA
    # graph capture. Magnitude codes 0 … 7 are 0, 0.5 (subnormal) and (1 + m/2) · 2^(e−1) for e = code >> 1 ≥ 1.
    magnitude = (code & 7).to(torch.int32)
    exponent, mantissa = magnitude >> 1, (magnitude & 1).to(torch.float32)
    normal = (1.0 + 0.5 * mantissa) * torch.exp2((exponent - 1).to(torch.float32))
    value = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where((code & 8) != 0, -value, value)


class Fp4E4m3RowCodec(RowCodec):
    """e2m1 with one e4m3 scale per 16 elements (compressed KV, ``use_fp4_sparse_kv``).

    ``scale = e4m3(min(max(amax, 6·2^−9) / 6, 448))``; codes are the e2m1 rounding of ``x · fp32(1/scale)``.
    """

    @property
    def bytes_per_row(self) -> int:
        return self.width // 2 + self.width // _FP4_E4M3_GROUP

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        groups = x.float().reshape(*x.shape[:-1], -1, _FP4_E4M3_GROUP)
        amax = groups.abs().amax(dim=-1, keepdim=True)
        scale = (torch.clamp(amax, min=_FP4_SCALE_FLOOR) / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn)
        codes = _e2m1_encode(torch.clamp(groups * (1.0 / scale.float()), -6.0, 6.0)).reshape(*x.shape)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return torch.cat([packed, scale.view(torch.uint8).reshape(*x.shape[:-1], -1)], dim=-1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        packed = rows[..., : self.width // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*rows.shape[:-1], self.width)
        scale = rows[..., self.width // 2 :].contiguous().view(torch.float8_e4m3fn).float()
        values = _e2m1_decode(codes).reshape(*rows.shape[:-1], -1, _FP4_E4M3_GROUP)
        return (values * scale[..., None]).reshape(*rows.shape[:-1], self.width)
