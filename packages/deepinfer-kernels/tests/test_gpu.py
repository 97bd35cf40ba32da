"""Triton kernels compiled for a real CUDA device (skipped without one), compared with the reference on the CPU."""

from __future__ import annotations

import pytest
import torch
from _gpu_marks import COMPILED_TRITON_ON_GPU

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import (
    assert_bitwise_equal,
    assert_close,
    random_e4m3,
    random_mxfp4_packed,
    random_normal,
    random_ue8m0,
)

pytestmark = COMPILED_TRITON_ON_GPU


def _both(op: str, inputs: tuple[torch.Tensor | float, ...], outputs: tuple[torch.Tensor, ...]):
    gpu_out = tuple(torch.empty_like(o, device="cuda") for o in outputs)
    implementation(op, Backend.NVIDIA)(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs), *gpu_out)
    torch.cuda.synchronize()
    ref_out = tuple(torch.empty_like(o) for o in outputs)
    implementation(op, Backend.REFERENCE)(*inputs, *ref_out)
    return tuple(o.cpu() for o in gpu_out), ref_out


@pytest.mark.parametrize("shape", [(7, 7168), (129, 512), (1, 1)])
def test_rms_norm_gpu(shape: tuple[int, int]) -> None:
    x = random_normal(shape, seed=1, dtype=torch.bfloat16, std=3.0)
    w = random_normal(shape[-1:], seed=2, dtype=torch.bfloat16)
    (gpu,), (ref,) = _both("rms_norm", (x, w, 1e-6), (torch.empty_like(x),))
    assert_close(gpu, ref, rtol=2.0**-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rope_gpu(dtype: torch.dtype) -> None:
    x = random_normal((300, 64, 64), seed=3, dtype=dtype)
    inv = dk.yarn_inverse_frequencies(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    cos, sin = dk.rope_cos_sin(inv, 300)
    (gpu,), (ref,) = _both("apply_rope", (x, cos, sin), (torch.empty_like(x),))
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    assert_close(gpu, ref, rtol=rtol, atol=2 * 2.0**-23 * x.float().abs().max().item())


def test_fp8_block_gpu() -> None:
    w = random_normal((1000, 2050), seed=4, dtype=torch.bfloat16, std=0.02)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((32, 65), dtype=torch.float8_e8m0fnu)
    (q_gpu, s_gpu), (q_ref, s_ref) = _both("quantize_fp8_block", (w,), (q, s))
    assert_bitwise_equal(q_gpu, q_ref)
    assert_bitwise_equal(s_gpu, s_ref)
    q = random_e4m3((1000, 2050), seed=5)
    s = random_ue8m0((32, 65), seed=6)
    (out_gpu,), (out_ref,) = _both("dequantize_fp8_block", (q, s), (torch.empty(q.shape, dtype=torch.bfloat16),))
    assert_bitwise_equal(out_gpu, out_ref)


@pytest.mark.parametrize("group", [32, 128])
def test_fp8_group_gpu(group: int) -> None:
    x = random_normal((333, 4096), seed=7, dtype=torch.bfloat16) * torch.logspace(-6, 3, 4096).to(torch.bfloat16)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((333, 4096 // group), dtype=torch.float8_e8m0fnu)
    (q_gpu, s_gpu), (q_ref, s_ref) = _both("quantize_fp8_per_token_group", (x,), (q, s))
    assert_bitwise_equal(q_gpu, q_ref)
    assert_bitwise_equal(s_gpu, s_ref)
    (out_gpu,), (out_ref,) = _both("dequantize_fp8_per_token_group", (q_ref, s_ref), (torch.empty(x.shape),))
    assert_bitwise_equal(out_gpu, out_ref)


def test_mxfp4_gpu() -> None:
    packed = random_mxfp4_packed((512, 1024), seed=8)
    s = random_ue8m0((512, 64), seed=9)
    (out_gpu,), (out_ref,) = _both("dequantize_mxfp4", (packed, s), (torch.empty((512, 2048), dtype=torch.bfloat16),))
    assert_bitwise_equal(out_gpu, out_ref)


def test_quantize_mxfp4_gpu() -> None:
    w = random_normal((512, 2048), seed=10, dtype=torch.bfloat16) * torch.logspace(-4, 2, 2048).to(torch.bfloat16)
    packed = torch.empty((512, 1024), dtype=torch.int8)
    s = torch.empty((512, 64), dtype=torch.float8_e8m0fnu)
    (p_gpu, s_gpu), (p_ref, s_ref) = _both("quantize_mxfp4", (w,), (packed, s))
    assert_bitwise_equal(p_gpu, p_ref)
    assert_bitwise_equal(s_gpu, s_ref)
