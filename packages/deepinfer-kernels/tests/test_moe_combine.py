"""moe_combine: the Triton kernel (interpreter on CPU, compiled on CUDA) equals the reference's sequential torch FP32
adds bit for bit; validation."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import random_normal


def _run(
    backend: Backend, device: str, routed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(routed.shape[0], routed.shape[2], dtype=dtype, device=device)
    implementation("moe_combine", backend)(routed.to(device), None if bias is None else bias.to(device), out)
    return out.cpu()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_triton_equals_the_reference_bitwise(triton_device: str, with_bias: bool, out_dtype: torch.dtype) -> None:
    """Outputs of widely different magnitudes (the order of the FP32 adds shows in the bits), -0 terms, 6 choices,
    a width that is not a multiple of the block."""
    routed = random_normal((7, 6, 1500), seed=1, dtype=torch.bfloat16) * torch.logspace(-3, 3, 6)[None, :, None].to(
        torch.bfloat16
    )
    routed[0, :, :10] = -0.0
    bias = random_normal((7, 1500), seed=2, dtype=torch.bfloat16) if with_bias else None
    fast = _run(Backend.NVIDIA, triton_device, routed, bias, out_dtype)
    ref = _run(Backend.REFERENCE, "cpu", routed, bias, out_dtype)
    bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
    assert torch.equal(fast.view(bits), ref.view(bits))


def test_public_op(op_device: str) -> None:
    routed = random_normal((3, 2, 64), seed=3, dtype=torch.float32).to(op_device)
    bias = random_normal((3, 64), seed=4, dtype=torch.bfloat16).to(op_device)
    out = dk.moe_combine(routed, bias, torch.bfloat16)
    expected = (bias.float() + routed[:, 0] + routed[:, 1]).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert dk.moe_combine(routed[:0], None, torch.float32).shape == (0, 64)


@pytest.mark.parametrize(
    ("routed", "bias", "out_dtype", "error", "message"),
    [
        (torch.zeros(3, 2, 8, dtype=torch.int32), None, torch.float32, TypeError, "routed has dtype torch.int32"),
        (torch.zeros(3, 8), None, torch.float32, ValueError, r"routed must have shape \[n, k, H\]"),
        (torch.zeros(3, 2, 8), torch.zeros(3, 7), torch.float32, ValueError, r"bias must have shape \(3, 8\)"),
        (torch.zeros(3, 2, 8), None, torch.int8, TypeError, "out_dtype has dtype torch.int8"),
    ],
)
def test_validation_names_the_argument(
    routed: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        dk.moe_combine(routed, bias, out_dtype)
