"""Bit-exact number-format helpers shared by the reference ops (model-core §5, §17).

Formats (all scales are UE8M0 bytes, value ``2^(b - 127)``):

- e4m3 (``torch.float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; conversion is
  round-to-nearest-even (PyTorch's cast, which defines the truth here).
- e2m1 (FP4): code ``c = s·8 + e·2 + f``; values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (8 = −0).

Scale exponents use an exact power-of-two ceiling read from the FP32 bits of ``amax / max``:
``e = ((bits − 1) >> 23) + 1 − 127``, so ``|x · 2^−e| ≤ max`` and nothing saturates.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "FP4_AMAX_FLOOR",
    "FP8_AMAX_FLOOR",
    "ceil_pow2_exponent",
    "e2m1_decode",
    "e2m1_encode",
    "exp2_int",
    "scale_exponent",
    "ue8m0_bytes_to_float",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126


def ceil_pow2_exponent(ratio: torch.Tensor) -> torch.Tensor:
    """Exact ``⌈log2(ratio)⌉`` from the FP32 bits of a positive normal FP32 ``ratio``.

    Args:
        ratio: FP32 tensor of positive normal values, any shape.

    Returns:
        int32 tensor of the same shape.
    """
    bits = ratio.contiguous().view(torch.int32)
    return ((bits - 1) >> 23) + 1 - 127


def scale_exponent(amax: torch.Tensor, floor: float, max_value: float) -> torch.Tensor:
    """UE8M0 exponent ``e = ⌈log2(max(amax, floor) / max_value)⌉`` with the FP32 division of §5.5.

    Args:
        amax: FP32 tensor of group maxima of ``|x|``, any shape.
        floor: smallest amax considered (1e-4 for FP8, ``6·2^−126`` for FP4).
        max_value: largest magnitude of the target format (448 for e4m3, 6 for e2m1).

    Returns:
        int32 tensor of the same shape; the stored scale byte is ``e + 127``.
    """
    ratio = torch.clamp_min(amax.float(), floor) / max_value
    return ceil_pow2_exponent(ratio)


def exp2_int(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly ``2^exponent`` as FP32 for int32 exponents in ``[-126, 127]`` (built from the bits)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def ue8m0_bytes_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 bytes to FP32 ``2^(b − 127)`` exactly; byte 0 gives the subnormal ``2^−127``, 255 gives NaN.

    Args:
        scale_bytes: uint8 tensor, any shape.

    Returns:
        FP32 tensor of the same shape.
    """
    b = scale_bytes.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Round FP32 values onto the e2m1 grid (nearest, ties to the even code) and return 4-bit codes.

    Magnitudes above 6 become 6. The sign bit follows the sign of the input, so −0 and small negative
    values that round to zero give code 8.

    Args:
        values: FP32 tensor, any shape.

    Returns:
        uint8 tensor of codes in ``[0, 15]``, same shape.
    """
    a = values.abs()
    # Each boundary sits halfway between neighbouring grid points; at a tie the even code wins, so the
    # comparison is strict where the lower neighbour has the even code and inclusive where the upper has it.
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return code | (torch.signbit(values).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Decode 4-bit e2m1 codes (uint8 in ``[0, 15]``, any shape) to FP32 values of the same shape.

    Computed rather than looked up: a table copied to the device inside a step would break CUDA graph capture.
    Magnitude codes are ``0.5·m`` for exponent 0 and ``(1 + m/2) · 2^(e−1)`` otherwise (same values as the table).
    """
    magnitude_code = (codes & 7).to(torch.int32)
    exponent, mantissa = magnitude_code >> 1, (magnitude_code & 1).to(torch.float32)
    normal = (1.0 + 0.5 * mantissa) * exp2_int(exponent - 1)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)
    return torch.where((codes & 8) != 0, -magnitude, magnitude)
