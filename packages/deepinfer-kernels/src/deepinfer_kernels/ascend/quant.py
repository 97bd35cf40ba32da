"""Ascend FP8 / MXFP4 (de)quantization with torch_npu's MX ops where their semantics match the format.

- Dequantization (FP8 block, FP8 per-token group, MXFP4) uses ``npu_anti_mx_quant`` (value · 2^(b − 127), one
  scale per 32 elements of the last axis). Its output is bf16; every e4m3/e2m1 value times a power of two is
  exact in bf16 while the result is ≥ 2^−126 in magnitude (scale bytes ≥ 10 for e4m3, ≥ 2 for e2m1), so FP32
  and bf16 outputs equal the reference there; below that the NPU's bf16 subnormal handling decides.
- Per-token-group quantization uses ``npu_dynamic_mx_quant(scale_alg=1)``, whose documented scale is the power-of-two
  ceiling of ``amax / 448`` (the activation-quantization rule) but without its amax floor of 1e−4; groups whose amax is
  below the floor are recomputed here with the floor's fixed scale (2^−22, byte 105).
- 32×32-block quantization has no torch_npu op with this scale rule (``npu_dynamic_block_mx_quant``'s FP8
  rule is the OCP floor rule, which can saturate), so it composes PyTorch ops on the NPU: the reference code.
"""

from __future__ import annotations

import torch

from deepinfer_kernels.ascend._npu import BFLOAT16, FLOAT4_E2M1, FLOAT8_E4M3FN, MX_BLOCK, mx_scale_pairs, torch_npu
from deepinfer_kernels.reference import quant as reference_quant
from deepinfer_kernels.reference.formats import E4M3_MAX, FP8_AMAX_FLOOR, exp2_int, scale_exponent

__all__ = [
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_mxfp4",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
]


def quantize_fp8_block(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """32×32-block e4m3 quantization composed of PyTorch ops on the NPU (no matching torch_npu op).

    Args:
        w: [out, in] bf16/fp16/fp32.
        q: [out, in] float8_e4m3fn; written.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu; written.
    """
    reference_quant.quantize_fp8_block(w, q, scale)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """32×32-block e4m3 dequantization: block scales repeated down the rows, then ``npu_anti_mx_quant``.

    Args:
        q: [out, in] float8_e4m3fn.
        scale: [ceil(out/32), ceil(in/32)] float8_e8m0fnu.
        out: [out, in] fp32/bf16/fp16; written.
    """
    row_scales = scale.view(torch.uint8).repeat_interleave(MX_BLOCK, dim=0)[: q.shape[0]]
    mxscale = mx_scale_pairs(row_scales.view(torch.float8_e8m0fnu))
    out.copy_(torch_npu().npu_anti_mx_quant(q, mxscale, axis=-1, dst_type=BFLOAT16, src_type=FLOAT8_E4M3FN))


def quantize_fp8_per_token_group(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Activation quantization with ``npu_dynamic_mx_quant(scale_alg=1)`` plus the amax floor.

    Args:
        x: [num_rows, K] bf16/fp16/fp32.
        q: [num_rows, K] float8_e4m3fn; written.
        scale: [num_rows, K // group_size] float8_e8m0fnu; written.
    """
    rows, cols = x.shape
    groups = scale.shape[1]
    group_size = cols // groups
    y, mxscale = torch_npu().npu_dynamic_mx_quant(
        x, axis=-1, round_mode="rint", dst_type=FLOAT8_E4M3FN, block_size=group_size, scale_alg=1
    )
    npu_scale = mxscale.reshape(rows, -1)[:, :groups].view(torch.uint8)
    # Groups under the floor get the floor's scale; decided per element without a host round trip.
    xg = x.float().view(rows, groups, group_size)
    below_floor = xg.abs().amax(dim=-1) < FP8_AMAX_FLOOR
    floor_exponent = scale_exponent(torch.zeros((), device=x.device), FP8_AMAX_FLOOR, E4M3_MAX)
    floor_q = (xg * exp2_int(-floor_exponent)).to(torch.float8_e4m3fn).view(torch.uint8)
    mixed_q = torch.where(below_floor[..., None], floor_q, y.view(torch.uint8).view(rows, groups, group_size))
    mixed_scale = torch.where(below_floor, (floor_exponent + 127).to(torch.uint8), npu_scale)
    q.view(torch.uint8).copy_(mixed_q.view(rows, cols))
    scale.view(torch.uint8).copy_(mixed_scale)


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Per-token-group e4m3 dequantization with ``npu_anti_mx_quant`` (group scales repeated to per-32).

    Args:
        q: [num_rows, K] float8_e4m3fn.
        scale: [num_rows, K // group_size] float8_e8m0fnu.
        out: [num_rows, K] fp32/bf16/fp16; written.
    """
    repeat = q.shape[1] // scale.shape[1] // MX_BLOCK
    per_block = scale.view(torch.uint8).repeat_interleave(repeat, dim=1).view(torch.float8_e8m0fnu)
    mxscale = mx_scale_pairs(per_block)
    out.copy_(torch_npu().npu_anti_mx_quant(q, mxscale, axis=-1, dst_type=BFLOAT16, src_type=FLOAT8_E4M3FN))


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """MXFP4 dequantization with ``npu_anti_mx_quant(src_type=float4_e2m1)`` (low nibble = even element).

    The nibble order of torch_npu's packed FP4 (low nibble first) is taken from its documentation, not
    verified on hardware.

    Args:
        packed: [out, in / 2] int8.
        scale: [out, in / 32] float8_e8m0fnu.
        out: [out, in] fp32/bf16/fp16; written.
    """
    mxscale = mx_scale_pairs(scale)
    y = torch_npu().npu_anti_mx_quant(
        packed.view(torch.uint8), mxscale, axis=-1, dst_type=BFLOAT16, src_type=FLOAT4_E2M1
    )
    out.copy_(y)
