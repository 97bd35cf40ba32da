"""Compiled ``rms_norm_fp8`` at the model's norm widths: bitwise equal to the compiled ``rms_norm`` followed by the
compiled quantizer, and the chain norm → FP8 GEMM on the quantized copy equal to norm → ``fp8_block_gemm``."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import deinterleaved
from _gpu_marks import COMPILED_TRITON_ON_GPU

import deepinfer_kernels as dk

pytestmark = COMPILED_TRITON_ON_GPU


def _inputs(rows: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    x = (torch.randn((rows, hidden), generator=generator, device="cuda") * 4).to(torch.bfloat16)
    weight = torch.randn((hidden,), generator=generator, device="cuda").to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("with_deinterleaved", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("hidden", [5120, 1280, 1024])
def test_rms_norm_fp8_gpu_equals_norm_then_quantizer(rows: int, hidden: int, with_deinterleaved: bool) -> None:
    """Also with the de-interleaved second copy, which must leave the other outputs' bits as they are."""
    x, weight = _inputs(rows, hidden, seed=rows + hidden)
    second = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda") if with_deinterleaved else None
    y, q, scale = dk.rms_norm_fp8(x, weight, 1e-6, deinterleaved_out=second)
    expected = dk.rms_norm(x, weight, 1e-6)
    expected_q, expected_scale = dk.quantize_fp8_per_token_group(expected)
    assert torch.equal(y, expected)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), expected_scale.view(torch.uint8))
    if second is not None:
        assert torch.equal(second.view(torch.uint8), deinterleaved(expected_q))


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_norm_then_quantized_gemm_equals_norm_then_gemm(rows: int) -> None:
    x, weight = _inputs(rows, 5120, seed=rows)
    generator = torch.Generator(device="cuda")
    generator.manual_seed(rows + 1)
    raw = torch.randint(0, 256, (1536, 5120), generator=generator, device="cuda", dtype=torch.int32).to(torch.uint8)
    w_q = (raw & 0xF7).view(torch.float8_e4m3fn)
    w_scale = torch.full((48, 160), 120, dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
    y, q, scale = dk.rms_norm_fp8(x, weight, 1e-6)
    normed = dk.rms_norm(x, weight, 1e-6)
    assert torch.equal(y, normed)
    assert torch.equal(dk.fp8_block_gemm_quantized(q, scale, w_q, w_scale), dk.fp8_block_gemm(normed, w_q, w_scale))
