"""Ascend interleaved-pair RoPE through ``torch_npu.npu_rotary_mul(..., rotary_mode="interleave")``."""

from __future__ import annotations

import torch

from deepinfer_kernels.ascend._npu import torch_npu

__all__ = ["apply_rope"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Rotate interleaved pairs with ``npu_rotary_mul`` in its TND layout.

    ``npu_rotary_mul`` computes ``x·r1 + rotate(x)·r2`` with ``rotate`` mapping ``(x[2i], x[2i+1])`` to ``(−x[2i+1],
    x[2i])``, so ``r1``/``r2`` are the FP32 cos/sin tables with every entry repeated twice ([T, 1, D]). The input is
    widened to FP32 so the table keeps FP32 precision (docs/design/model.md, "RoPE and YaRN") and the result is rounded
    once to ``x``'s dtype. The NPU does a multiply and an add instead of the reference's fma: results can differ from
    the reference by 1 ulp of the output dtype. Documented limits of the op: D < 896, fewer than 1000 heads.

    Args:
        x: [num_tokens, num_heads, rope_dim] bf16 or fp32 on the NPU, unit stride in the last dimension.
        cos: [num_tokens, rope_dim // 2] fp32.
        sin: [num_tokens, rope_dim // 2] fp32.
        out: [num_tokens, num_heads, rope_dim], x's dtype; written (it may be ``x``: the op reads an FP32 copy).
    """
    r1 = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    r2 = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    out.copy_(torch_npu().npu_rotary_mul(x.float().contiguous(), r1, r2, rotary_mode="interleave"))
