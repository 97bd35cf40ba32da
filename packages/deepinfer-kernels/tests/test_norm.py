"""RMSNorm: fast backends vs reference on fresh seeded inputs, exact reference numerics, wrapper checks.

Tolerances: the backends sum x² in a different order (and the NPU's rsqrt is not correctly rounded), so ρ may
differ in the last FP32 bits; outputs must agree within 1 ulp of the output dtype (bf16: rtol 2^−7; fp32:
rtol 2^−21), and the cosine difference must be below 1e−7.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_close, cosine_difference, random_normal

Fast = tuple[Backend, str]
_RTOL = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-21}


@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (3, 7), (17, 100), (4, 257)])
@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_rms_norm_parity(
    fast_backend: Fast, rows: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    backend, device = fast_backend
    x = random_normal((rows, hidden), seed=rows * 1000 + hidden, dtype=dtype, std=3.0)
    weight = random_normal((hidden,), seed=hidden, dtype=weight_dtype)
    eps = 1e-6
    expected = torch.empty_like(x)
    implementation("rms_norm", Backend.REFERENCE)(x, weight, eps, expected)
    actual = torch.empty_like(x, device=device)
    implementation("rms_norm", backend)(x.to(device), weight.to(device), eps, actual)
    assert_close(actual.cpu(), expected, rtol=_RTOL[dtype], atol=1e-30)
    assert cosine_difference(actual.cpu(), expected) < 1e-7


def test_reference_matches_float64_formula() -> None:
    x = random_normal((5, 64), seed=1, dtype=torch.bfloat16)
    weight = random_normal((64,), seed=2, dtype=torch.bfloat16)
    eps = 1e-6
    out = torch.empty_like(x)
    implementation("rms_norm", Backend.REFERENCE)(x, weight, eps, out)
    xd = x.double()
    rho = 1.0 / torch.sqrt((xd * xd).mean(-1, keepdim=True) + float(torch.tensor(eps, dtype=torch.float32)))
    # One rounding of the FP32 product: within half a bf16 ulp of the exact value, plus FP32 slack.
    assert_close(out, xd * rho * weight.double(), rtol=2.0**-8 + 2.0**-20, atol=0.0)


def test_public_op_shapes_and_empty(op_device: str) -> None:
    x = random_normal((2, 3, 16), seed=3, dtype=torch.bfloat16, device=op_device)
    weight = torch.ones(16, dtype=torch.bfloat16, device=op_device)
    out = dk.rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == torch.bfloat16 and out.device == x.device
    expected = torch.empty(6, 16, dtype=torch.bfloat16)
    implementation("rms_norm", Backend.REFERENCE)(x.view(6, 16).cpu(), weight.cpu(), 1e-6, expected)
    assert_close(out.view(6, 16), expected, rtol=2.0**-7, atol=1e-30)
    assert dk.rms_norm(torch.empty(0, 16, dtype=torch.bfloat16, device=op_device), weight, 1e-6).shape == (0, 16)
    strided = random_normal((16, 4), seed=4, dtype=torch.bfloat16, device=op_device).t()
    assert_close(dk.rms_norm(strided, weight, 1e-6), dk.rms_norm(strided.contiguous(), weight, 1e-6), rtol=0, atol=0)


def test_validation() -> None:
    weight = torch.ones(8)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        dk.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(TypeError, match=r"x has dtype torch\.float16"):
        dk.rms_norm(torch.zeros(2, 8, dtype=torch.float16), weight, 1e-6)
    with pytest.raises(ValueError, match="eps must be a positive finite float"):
        dk.rms_norm(torch.zeros(2, 8), weight, 0.0)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        dk.rms_norm(torch.zeros(2, 0), torch.ones(0), 1e-6)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        dk.rms_norm([1.0], weight, 1e-6)  # type: ignore[arg-type]
