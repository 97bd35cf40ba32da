"""RMSNorm + FP8 quantization (``rms_norm_fp8``): the reference is the separate norm and quantizer by construction;
Triton (interpreter on CPU, compiled on CUDA) equals the Triton ``rms_norm`` and quantizer bit for bit (the same
normalization code, then the quantizer's exact operations on the rounded value), and the reference within the
RMSNorm tolerance of test_norm.py (the FP32 sum of squares is ordered differently)."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import deinterleaved

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_close, random_normal


def _outputs(rows: int, hidden: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    return (
        torch.empty(rows, hidden, dtype=dtype, device=device),
        torch.empty(rows, hidden, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, hidden // 32, dtype=torch.float8_e8m0fnu, device=device),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Column groups of very different size, so the scale bytes differ between groups.
    spread = torch.logspace(-2, 2, hidden // 32).repeat_interleave(32)
    x = (random_normal((rows, hidden), seed=seed, std=3.0) * spread).to(dtype)
    return x, random_normal((hidden,), seed=seed + 1, dtype=torch.bfloat16)


def test_reference_is_the_norm_then_the_quantizer() -> None:
    x, weight = _inputs(5, 96, torch.bfloat16, seed=1)
    y, q, scale = dk.rms_norm_fp8(x.view(5, 1, 96), weight, 1e-6)
    assert y.shape == (5, 1, 96) and q.shape == (5, 1, 96) and scale.shape == (5, 1, 3)
    expected = dk.rms_norm(x, weight, 1e-6)
    expected_q, expected_scale = dk.quantize_fp8_per_token_group(expected)
    assert torch.equal(y.view(5, 96), expected)
    assert torch.equal(_bits(q.view(5, 96)), _bits(expected_q))
    assert torch.equal(_bits(scale.view(5, 3)), _bits(expected_scale))


def test_deinterleaved_out_holds_the_codes_deinterleaved() -> None:
    x, weight = _inputs(4, 128, torch.bfloat16, seed=3)
    out = torch.empty(4, 128, dtype=torch.float8_e4m3fn)
    y, q, scale = dk.rms_norm_fp8(x, weight, 1e-6, deinterleaved_out=out)
    plain = dk.rms_norm_fp8(x, weight, 1e-6)
    for a, b in zip((y, q, scale), plain, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(out), deinterleaved(q))
    with pytest.raises(ValueError, match="deinterleaved_out must be contiguous with x's shape"):
        dk.rms_norm_fp8(x, weight, 1e-6, deinterleaved_out=out[:2])
    with pytest.raises(TypeError, match="deinterleaved_out has dtype"):
        dk.rms_norm_fp8(x, weight, 1e-6, deinterleaved_out=out.view(torch.uint8))


def test_rms_norm_fp8_checks_arguments() -> None:
    x, weight = _inputs(2, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        dk.rms_norm_fp8(x[:, :40], weight[:40], 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        dk.rms_norm_fp8(x, weight[:32], 1e-6)
    with pytest.raises(ValueError, match="eps"):
        dk.rms_norm_fp8(x, weight, 0.0)
    with pytest.raises(TypeError):
        dk.rms_norm_fp8(x.half(), weight, 1e-6)


@pytest.mark.parametrize(
    ("rows", "hidden", "dtype"), [(1, 32, torch.bfloat16), (7, 96, torch.bfloat16), (3, 160, torch.float32)]
)
def test_rms_norm_fp8_triton(triton_device: str, rows: int, hidden: int, dtype: torch.dtype) -> None:
    x, weight = _inputs(rows, hidden, dtype, seed=rows + hidden)
    x, weight = x.to(triton_device), weight.to(triton_device)
    fused = _outputs(rows, hidden, dtype, triton_device)
    implementation("rms_norm_fp8", Backend.NVIDIA)(x, weight, 1e-6, *fused)
    separate = _outputs(rows, hidden, dtype, triton_device)
    implementation("rms_norm", Backend.NVIDIA)(x, weight, 1e-6, separate[0])
    implementation("quantize_fp8_per_token_group", Backend.NVIDIA)(separate[0], separate[1], separate[2])
    for a, b in zip(fused, separate, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    # The de-interleaved second copy leaves the first outputs' bits as they were.
    both, codes = _outputs(rows, hidden, dtype, triton_device), torch.empty_like(fused[1])
    implementation("rms_norm_fp8", Backend.NVIDIA)(x, weight, 1e-6, *both, codes)
    for a, b in zip(both, fused, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(codes), deinterleaved(fused[1]))
    reference = _outputs(rows, hidden, dtype, "cpu")
    implementation("rms_norm_fp8", Backend.REFERENCE)(x.cpu(), weight.cpu(), 1e-6, *reference)
    assert_close(fused[0].cpu(), reference[0], rtol=2.0**-7 if dtype == torch.bfloat16 else 2.0**-21, atol=1e-30)
