"""Ascend backend: torch_npu ops (and PyTorch composed on the NPU where torch_npu has no matching op).

Imported only when the ascend backend is selected. Nothing here has run on a real NPU yet; the call sites
are exercised on CPU through ``deepinfer_kernels.testing_npu_double``.
"""

from __future__ import annotations

from deepinfer_kernels._registry import Backend, OpRegistry
from deepinfer_kernels.ascend import gemm, norm, quant, rope

__all__ = ["register"]


def register(registry: OpRegistry) -> None:
    """Register the Ascend implementations (quantize_mxfp4, ue8m0_to_float and the GEMMs fall
    back to the reference; the de-rotated grouped GEMM rotates with this backend's RoPE, then runs the reference's)."""
    ascend = Backend.ASCEND
    registry.register("rms_norm", ascend, norm.rms_norm)
    registry.register("apply_rope", ascend, rope.apply_rope)
    registry.register("rotated_fp8_block_grouped_gemm", ascend, gemm.rotated_fp8_block_grouped_gemm)
    registry.register("quantize_fp8_block", ascend, quant.quantize_fp8_block)
    registry.register("dequantize_fp8_block", ascend, quant.dequantize_fp8_block)
    registry.register("quantize_fp8_per_token_group", ascend, quant.quantize_fp8_per_token_group)
    registry.register("dequantize_fp8_per_token_group", ascend, quant.dequantize_fp8_per_token_group)
    registry.register("dequantize_mxfp4", ascend, quant.dequantize_mxfp4)
