"""SwiGLU + FP8 quantization (``swiglu_clamped_fp8``): the reference is ``swiglu_clamped`` then the quantizer by
construction; Triton (interpreter on CPU, compiled on CUDA in the gpu-marked test) equals the Triton
``swiglu_clamped`` followed by the Triton quantizer bit for bit (the same device code for the products, the
quantizer's operations on the FP32 products). Against the reference the codes can differ where the compiled ``exp``
moves a product across an e4m3 rounding boundary (test_moe_small_ops.py's SwiGLU tolerance, 2^−18 relative)."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import deinterleaved
from _gpu_marks import compiled_triton_on_gpu

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import random_normal


def _inputs(rows: int, half: int, weighted: bool, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = random_normal((rows, 2 * half), seed=seed, std=4.0, dtype=torch.bfloat16).to(device)
    weight = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 1)).to(device) if weighted else None
    return t, weight


def _fused_and_separate(
    backend: Backend, t: torch.Tensor, limit: float | None, weight: torch.Tensor | None
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    rows, half = t.shape[0], t.shape[1] // 2

    def empty() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.empty(rows, half, dtype=torch.float8_e4m3fn, device=t.device),
            torch.empty(rows, half // 32, dtype=torch.float8_e8m0fnu, device=t.device),
        )

    fused, separate = empty(), empty()
    implementation("swiglu_clamped_fp8", backend)(t, limit, weight, *fused)
    act = torch.empty(rows, half, dtype=torch.float32, device=t.device)
    implementation("swiglu_clamped", backend)(t, limit, weight, act)
    implementation("quantize_fp8_per_token_group", backend)(act, *separate)
    return fused, separate


def _assert_same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_reference_and_public_op() -> None:
    t, weight = _inputs(3, 64, True, seed=1, device="cpu")
    q, scale = dk.swiglu_clamped_fp8(t, 10.0, weight)
    _assert_same_bits((q, scale), dk.quantize_fp8_per_token_group(dk.swiglu_clamped(t, 10.0, weight)))
    with pytest.raises(ValueError, match="multiple of 32"):
        dk.swiglu_clamped_fp8(t[:, :80], 10.0)
    with pytest.raises(ValueError, match="limit"):
        dk.swiglu_clamped_fp8(t, -1.0)
    with pytest.raises(ValueError, match="row_weight"):
        dk.swiglu_clamped_fp8(t, None, weight[:2])


@pytest.mark.parametrize(
    ("rows", "half", "limit", "weighted"),
    [(1, 32, None, False), (5, 96, 10.0, True), (2, 1056, 10.0, False), (5, 768, 10.0, True)],
)
def test_swiglu_fp8_triton_equals_swiglu_then_quantizer(
    triton_device: str, rows: int, half: int, limit: float | None, weighted: bool
) -> None:
    t, weight = _inputs(rows, half, weighted, seed=rows + half, device=triton_device)
    fused, separate = _fused_and_separate(Backend.NVIDIA, t, limit, weight)
    _assert_same_bits(fused, separate)


@compiled_triton_on_gpu
@pytest.mark.parametrize("rows", [1, 64, 1000])
@pytest.mark.parametrize("half", [2048, 2304, 3072])
def test_swiglu_fp8_gpu_equals_swiglu_then_quantizer(rows: int, half: int) -> None:
    t, weight = _inputs(rows, half, True, seed=rows + half, device="cuda")
    fused, separate = _fused_and_separate(Backend.NVIDIA, t, 10.0, weight)
    _assert_same_bits(fused, separate)


def _deinterleave_cases(backend: Backend, device: str, rows: int, half: int) -> None:
    """``deinterleave``: the same scales and each group's codes even columns first, then odd ones."""
    t, weight = _inputs(rows, half, True, seed=rows * half, device=device)
    plain = _fused_and_separate(backend, t, 10.0, weight)[0]
    q, scale = torch.empty_like(plain[0]), torch.empty_like(plain[1])
    implementation("swiglu_clamped_fp8", backend)(t, 10.0, weight, q, scale, True)
    assert torch.equal(q.view(torch.uint8), deinterleaved(plain[0]))
    assert torch.equal(scale.view(torch.uint8), plain[1].view(torch.uint8))


def test_deinterleave_reference_and_public_op() -> None:
    _deinterleave_cases(Backend.REFERENCE, "cpu", 3, 96)
    t, weight = _inputs(2, 64, False, seed=9, device="cpu")
    q, _ = dk.swiglu_clamped_fp8(t, None, weight, deinterleave=True)
    assert torch.equal(q.view(torch.uint8), deinterleaved(dk.swiglu_clamped_fp8(t, None, weight)[0]))
    with pytest.raises(TypeError, match="deinterleave must be a bool"):
        dk.swiglu_clamped_fp8(t, None, deinterleave=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rows", "half"), [(1, 32), (6, 768), (5, 1056)])
def test_deinterleave_triton(triton_device: str, rows: int, half: int) -> None:
    _deinterleave_cases(Backend.NVIDIA, triton_device, rows, half)


@compiled_triton_on_gpu
@pytest.mark.parametrize(("rows", "half"), [(6, 2304), (384, 2048), (1000, 3072)])
def test_deinterleave_gpu(rows: int, half: int) -> None:
    _deinterleave_cases(Backend.NVIDIA, "cuda", rows, half)
