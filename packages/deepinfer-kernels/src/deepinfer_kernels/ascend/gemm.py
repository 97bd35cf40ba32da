"""Ascend GEMM entry points. The quantized GEMMs have no NPU kernel of their own here (the reference's run on the
NPU's tensors); the de-rotated grouped GEMM rotates with this backend's ``apply_rope`` (``npu_rotary_mul``) first, as
the model's separate de-rotation did before the op existed."""

from __future__ import annotations

import torch

from deepinfer_kernels.ascend import rope
from deepinfer_kernels.reference import gemm as reference_gemm

__all__ = ["rotated_fp8_block_grouped_gemm"]


def rotated_fp8_block_grouped_gemm(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``reference.gemm.rotated_fp8_block_grouped_gemm`` with the rotation by ``ascend.rope.apply_rope``."""
    rotated = reference_gemm.rotated_fp32_copy(x, cos, sin, rope.apply_rope)
    reference_gemm.fp8_block_grouped_gemm(rotated, w_q, w_scale, out)
