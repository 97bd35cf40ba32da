"""Triton device functions for the e4m3, e2m1 and UE8M0 encodings, in integer arithmetic.

Working on bit patterns keeps the kernels arch-neutral (no FP8 conversion instructions, so they run on any
GPU Triton supports and in the interpreter) and bit-exact with the PyTorch reference:

- e4m3 encode: round-to-nearest-even of the FP32 mantissa to 3 bits by integer add-and-shift for normal
  results; for results below 2^−6 the value times 2^9 is rounded to an integer with the 2^23 trick
  (adding 2^23 in FP32 rounds to nearest even). Codes saturate at 0x7E (448).
- scale exponent: ``e = ((bits(max(amax, floor) / max) − 1) >> 23) + 1 − 127`` with an IEEE division.
- negative zero is kept: signs are set on the bit pattern, never by unary minus (which Triton lowers to 0 − x).
- bf16 outputs are rounded to nearest even in integer arithmetic (:func:`to_output_dtype`).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ceil_pow2_exponent",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_decode",
    "e4m3_encode",
    "e4m3_value",
    "exp2_int",
    "fp8_group_values",
    "fp8_token_groups",
    "scale_exponent",
    "to_output_dtype",
    "to_output_dtype_native",
    "ue8m0_decode",
]

_FP8_AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-4)
_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)


@triton.jit
def to_output_dtype(value, out_ptr):  # type: ignore[no-untyped-def]
    # FP32 -> bf16 is rounded to nearest even in integer arithmetic: Triton's interpreter truncates in its
    # own cast (even with fp_downcast_rounding="rtne"), while the GPU cast rounds; this agrees with both.
    if out_ptr.dtype.element_ty == tl.float32:
        return value
    elif out_ptr.dtype.element_ty == tl.bfloat16:
        # A NaN stays a NaN (the GPU's canonical NaN 0x7FFFFFFF would carry into the sign bit and give −0).
        bits = value.to(tl.int32, bitcast=True)
        rounded = tl.where(value != value, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return value.to(out_ptr.dtype.element_ty)


@triton.jit
def to_output_dtype_native(value, out_ptr, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # to_output_dtype's bits but for NaNs (a NaN stays a NaN, of the hardware's payload); NATIVE (compiled): a bf16
    # output by the hardware's round-to-nearest-even conversion, two values an instruction.
    if NATIVE and out_ptr.dtype.element_ty == tl.bfloat16:
        return value.to(tl.bfloat16)
    else:
        return to_output_dtype(value, out_ptr)


@triton.jit
def ceil_pow2_exponent(ratio):  # type: ignore[no-untyped-def]
    bits = ratio.to(tl.int32, bitcast=True)
    return ((bits - 1) >> 23) + 1 - 127


@triton.jit
def scale_exponent(amax, floor: tl.constexpr, max_value: tl.constexpr):  # type: ignore[no-untyped-def]
    a = tl.maximum(amax, floor)
    return ceil_pow2_exponent(tl.div_rn(a, max_value))


@triton.jit
def exp2_int(exponent):  # type: ignore[no-untyped-def]
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_token_groups(values):  # type: ignore[no-untyped-def]
    # Per-token-group FP8 quantization of values [G, W] (one row per W-column group): the e4m3 codes [G, W] and the
    # UE8M0 scale bytes [G] (amax floor 1e−4, e4m3 maximum 448; docs/design/numerics.md, "Activation quantization").
    exponent = scale_exponent(tl.max(tl.abs(values), axis=1), _FP8_AMAX_FLOOR, _E4M3_MAX)
    return e4m3_encode(values * exp2_int(-exponent)[:, None]), (exponent + 127).to(tl.uint8)


@triton.jit
def fp8_group_values(values):  # type: ignore[no-untyped-def]
    # The values x̂ [G, W] (FP32) of fp8_token_groups' codes and scales, e4m3_decode(codes) · ue8m0_decode(scale), bit
    # for bit, without forming the codes: the scaled value is rounded in place, to 3 mantissa bits (nearest even, by
    # e4m3_encode's integer add) where it is normal in e4m3 and to a multiple of 2^−9 below 2^−6, and saturated at 448
    # (the largest code e4m3_encode gives, also for inf and NaN); the sign bit is kept. Fewer instructions than encoding
    # and decoding: quantized_values' sorted-copy tile takes 41 against 54 SASS instructions an element (sm_90).
    exponent = scale_exponent(tl.max(tl.abs(values), axis=1), _FP8_AMAX_FLOOR, _E4M3_MAX)
    v = values * exp2_int(-exponent)[:, None]
    bits = v.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    normal = tl.minimum((abits + 0x7FFFF + ((abits >> 20) & 1)) & -0x100000, 0x43E00000)
    a = abits.to(tl.float32, bitcast=True)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    magnitude = tl.where(a < 0.015625, subnormal.to(tl.int32, bitcast=True), normal)
    rounded = (magnitude | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return rounded * ue8m0_decode((exponent + 127).to(tl.uint8))[:, None]


@triton.jit
def e4m3_encode(v):  # type: ignore[no-untyped-def]
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 7
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    normal_code = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    subnormal_code = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0.015625, subnormal_code, normal_code)
    code = tl.minimum(code, 126)
    return (code | sign).to(tl.uint8)


@triton.jit
def _with_sign(magnitude, negative):  # type: ignore[no-untyped-def]
    # Sets the sign bit directly: Triton lowers unary minus to 0 − x, which turns −0 into +0.
    bits = magnitude.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_decode(byte):  # type: ignore[no-untyped-def]
    c = byte.to(tl.int32) & 0xFF
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((c & 0x7F) == 0x7F, (0x7FC00000 + c * 0).to(tl.float32, bitcast=True), magnitude)
    return _with_sign(magnitude, (c & 0x80) != 0)


@triton.jit
def e4m3_value(byte, NATIVE: tl.constexpr):  # type: ignore[no-untyped-def]
    # e4m3_decode(byte); NATIVE: by the hardware conversion (e4m3 to FP16 to FP32, about 1.5 instructions an element
    # against e4m3_decode's ~18), the same FP32 value for every finite code and a NaN of another payload for the NaN
    # codes (FP32 arithmetic on a GPU returns its one canonical NaN whatever the payload, so no kernel output keeps it).
    # The interpreter needs the bit decoding: its e4m3 cast turns the NaN codes into 480.
    if NATIVE:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_decode(byte)


@triton.jit
def ue8m0_decode(byte):  # type: ignore[no-untyped-def]
    b = byte.to(tl.int32) & 0xFF
    bits = tl.where(b == 0, 1 << 22, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_decode(code):  # type: ignore[no-untyped-def]
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return _with_sign(magnitude, (code & 8) != 0)


@triton.jit
def e2m1_encode(v):  # type: ignore[no-untyped-def]
    # Nearest e2m1 grid point, ties to the even code: strict comparisons where the lower neighbour's code is
    # even, inclusive where the upper one's is (same table as the reference's e2m1_encode).
    a = tl.abs(v)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)
