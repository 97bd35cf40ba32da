"""Reference FP8 / MXFP4 quantization and dequantization (docs/design/numerics.md, "Weight formats").

All functions write into preallocated outputs; the public wrappers in ``deepinfer_kernels.quant``
validate and allocate. Quantized e4m3 tensors are ``torch.float8_e4m3fn``; scales are UE8M0 bytes
stored as ``torch.float8_e8m0fnu``; packed MXFP4 is int8 with two e2m1 codes per byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer_kernels.reference.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FP4_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    e2m1_decode,
    e2m1_encode,
    exp2_int,
    scale_exponent,
    ue8m0_bytes_to_float,
)

__all__ = [
    "BLOCK",
    "deinterleave_groups",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_mxfp4",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_mxfp4",
    "ue8m0_to_float",
]

BLOCK = 32  # edge of a weight scale block and width of an MXFP4 scale group


def _scale_bytes(exponent: torch.Tensor) -> torch.Tensor:
    """int32 exponents → UE8M0 bytes viewed as float8_e8m0fnu."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def ue8m0_to_float(scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = 2^(b − 127)`` for UE8M0 bytes ``b`` (float8_e8m0fnu or uint8, any shape); ``out`` is FP32."""
    out.copy_(ue8m0_bytes_to_float(scale.view(torch.uint8)))


def quantize_fp8_block(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize a weight to e4m3 with one UE8M0 scale per 32×32 block.

    Per block: ``e = ⌈log2(max(amax, 1e−4) / 448)⌉`` (the activation-quantization rule applied to the block), ``q =
    e4m3(w·2^−e)``. Partial edge blocks use only their real elements.

    Args:
        w: [out, in] bf16/fp16/fp32.
        q: [out, in] float8_e4m3fn, written.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu, written.
    """
    rows, cols = w.shape
    row_blocks, col_blocks = scale.shape
    wf = F.pad(w.float(), (0, col_blocks * BLOCK - cols, 0, row_blocks * BLOCK - rows))
    blocks = wf.view(row_blocks, BLOCK, col_blocks, BLOCK)
    exponent = scale_exponent(blocks.abs().amax(dim=(1, 3)), FP8_AMAX_FLOOR, E4M3_MAX)
    scaled = blocks * exp2_int(-exponent)[:, None, :, None]
    q.copy_(scaled.view(row_blocks * BLOCK, col_blocks * BLOCK)[:rows, :cols].to(torch.float8_e4m3fn))
    scale.copy_(_scale_bytes(exponent))


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out[o, i] = e4m3_value(q[o, i]) · 2^(scale[o//32, i//32] − 127)`` (docs/design/numerics.md, "Weight formats"),
    rounded once to out's dtype.

    Args:
        q: [out, in] float8_e4m3fn.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu.
        out: [out, in] fp32/bf16/fp16, written.
    """
    rows, cols = q.shape
    factor = ue8m0_bytes_to_float(scale.view(torch.uint8))
    factor = factor.repeat_interleave(BLOCK, dim=0)[:rows].repeat_interleave(BLOCK, dim=1)[:, :cols]
    out.copy_(q.float() * factor)


def deinterleave_groups(q: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [rows, K] = the codes ``q`` [rows, K] with each 32-column group stored even columns first, then odd
    ones (``deepinfer_kernels.GroupCodes`` order ``"deinterleaved"``)."""
    rows, width = q.shape
    pairs = q.view(torch.uint8).view(rows, width // 32, 16, 2).transpose(2, 3)
    out.view(torch.uint8).copy_(pairs.reshape(rows, width))


def quantize_fp8_per_token_group(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Dynamic per-token-group e4m3 quantization (docs/design/numerics.md, "Activation quantization").

    Per group of ``K / scale.shape[1]`` consecutive columns: ``a = max(amax, 1e−4)``,
    ``e = ⌈log2(a/448)⌉`` from the FP32 bits, ``q = e4m3(x · 2^−e)``, scale byte ``e + 127``.

    Args:
        x: [num_rows, K] bf16/fp16/fp32.
        q: [num_rows, K] float8_e4m3fn, written.
        scale: [num_rows, K // group_size] float8_e8m0fnu, written.
    """
    rows, cols = x.shape
    groups = scale.shape[1]
    xg = x.float().reshape(rows, groups, cols // groups)
    exponent = scale_exponent(xg.abs().amax(dim=-1), FP8_AMAX_FLOOR, E4M3_MAX)
    q.copy_((xg * exp2_int(-exponent)[..., None]).reshape(rows, cols).to(torch.float8_e4m3fn))
    scale.copy_(_scale_bytes(exponent))


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out[r, c] = e4m3_value(q[r, c]) · 2^(scale[r, c // group_size] − 127)``
    (docs/design/numerics.md, "Weight formats", "Activation quantization").

    Args:
        q: [num_rows, K] float8_e4m3fn.
        scale: [num_rows, K // group_size] float8_e8m0fnu.
        out: [num_rows, K] fp32/bf16/fp16, written.
    """
    group_size = q.shape[1] // scale.shape[1]
    factor = ue8m0_bytes_to_float(scale.view(torch.uint8)).repeat_interleave(group_size, dim=1)
    out.copy_(q.float() * factor)


def quantize_mxfp4(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Quantize a weight to MXFP4: e2m1 codes packed two per byte, one UE8M0 scale per row and 32 columns.

    Per group: ``a = max(amax, 6·2^−126)``, ``e = ⌈log2(a/6)⌉`` from the FP32 bits (the FP4 constants with
    the activation-quantization ceiling), codes = e2m1 round-to-nearest-even of ``w · 2^−e``. Byte ``j`` of a row holds
    element ``2j`` in its low nibble and ``2j+1`` in its high nibble (docs/design/numerics.md, "Weight formats").

    Args:
        w: [out, in] bf16/fp16/fp32, ``in % 32 == 0``.
        packed: [out, in // 2] int8, written.
        scale: [out, in // 32] float8_e8m0fnu, written.
    """
    rows, cols = w.shape
    wg = w.float().reshape(rows, cols // BLOCK, BLOCK)
    exponent = scale_exponent(wg.abs().amax(dim=-1), FP4_AMAX_FLOOR, E2M1_MAX)
    codes = e2m1_encode(wg * exp2_int(-exponent)[..., None]).reshape(rows, cols)
    packed.copy_((codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8))
    scale.copy_(_scale_bytes(exponent))


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out[o, i] = e2m1_value(o, i) · 2^(scale[o, i // 32] − 127)`` (docs/design/numerics.md, "Weight formats").

    Args:
        packed: [out, in // 2] int8 (low nibble = even element).
        scale: [out, in // 32] float8_e8m0fnu.
        out: [out, in] fp32/bf16/fp16, written.
    """
    rows = packed.shape[0]
    cols = packed.shape[1] * 2
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(rows, cols)
    factor = ue8m0_bytes_to_float(scale.view(torch.uint8)).repeat_interleave(BLOCK, dim=1)
    out.copy_(e2m1_decode(codes) * factor)
