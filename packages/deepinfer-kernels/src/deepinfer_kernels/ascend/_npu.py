"""Access to ``torch_npu`` for the Ascend implementations, plus its MX dtype codes.

``torch_npu`` is looked up in ``sys.modules`` on every call (through ``importlib``), never bound at import
time, so tests can install and remove the CPU double (``deepinfer_kernels.testing_npu_double``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["BFLOAT16", "FLOAT4_E2M1", "FLOAT8_E4M3FN", "MX_BLOCK", "mx_scale_pairs", "torch_npu"]

# dtype codes of torch_npu's MX ops: torch_npu's own codes for the FP8/FP4 element types, torch's
# ScalarType code for the bf16 output.
FLOAT8_E4M3FN = 292
FLOAT4_E2M1 = 296
BFLOAT16 = 15
MX_BLOCK = 32  # torch_npu's MX dequantization always uses one scale per 32 elements


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (real, or the test double when installed)."""
    return importlib.import_module("torch_npu")


def mx_scale_pairs(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Reshape per-32 UE8M0 scales to torch_npu's MX layout: pairs along a new last axis.

    Args:
        scale_bytes: [rows, num_blocks] float8_e8m0fnu.

    Returns:
        [rows, ceil(num_blocks / 2), 2] float8_e8m0fnu (an odd count is padded with byte 0).
    """
    raw = scale_bytes.view(torch.uint8)
    raw = F.pad(raw, (0, raw.shape[-1] % 2))
    return raw.unflatten(-1, (raw.shape[-1] // 2, 2)).view(torch.float8_e8m0fnu)
