"""The reference model's inline number formats, RMSNorm and RoPE agree bit for bit with deepinfer_kernels' ops.

The reference model spells its math out independently; these tests pin both definitions to each other on the CPU
(reference) backend of the kernel package.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as kernels
from deepinfer_kernels import testing
from deepinfer_model import reference as ref


def _normal(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_ue8m0_decoding():
    scale = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    testing.assert_bitwise_equal(ref.ue8m0_to_float(scale), kernels.ue8m0_to_float(scale))


@pytest.mark.parametrize("shape", [(64, 96), (40, 50)])
def test_fp8_block_dequantization(shape):
    weight, scale = kernels.quantize_fp8_block(_normal(shape, 1, 0.05))
    testing.assert_bitwise_equal(ref.dequantize_fp8_block(weight, scale), kernels.dequantize_fp8_block(weight, scale))


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 300.0])
def test_fp8_activation_quantization(magnitude):
    x = _normal((7, 256), 2, magnitude).bfloat16()
    q, scale = kernels.quantize_fp8_per_token_group(x)
    testing.assert_bitwise_equal(ref.fp8_quant_dequant(x), kernels.dequantize_fp8_per_token_group(q, scale))


def test_mxfp4_dequantization():
    packed, scale = kernels.quantize_mxfp4(_normal((32, 128), 3, 0.1))
    testing.assert_bitwise_equal(ref.dequantize_mxfp4(packed, scale), kernels.dequantize_mxfp4(packed, scale))


def test_rms_norm():
    x = _normal((9, 256), 4, 3.0).bfloat16()
    weight = (1 + _normal((256,), 5, 0.1)).bfloat16()
    testing.assert_bitwise_equal(ref.rms_norm(x, weight, 1e-6), kernels.rms_norm(x, weight, 1e-6))


def test_rope_tables():
    testing.assert_bitwise_equal(ref.rope_inv_freq(64, 10000.0), kernels.rope_inverse_frequencies(64, 10000.0))
    yarn = ref.yarn_inv_freq(64, 160000.0, 16.0, 65536, 32, 1)
    testing.assert_bitwise_equal(yarn, kernels.yarn_inverse_frequencies(64, 160000.0, 16.0, 65536, 32, 1))
    for actual, expected in zip(ref.rope_cos_sin(yarn, 5000), kernels.rope_cos_sin(yarn, 5000), strict=True):
        testing.assert_bitwise_equal(actual, expected)


def test_apply_rope_on_the_rope_span():
    x = _normal((6, 4, 128), 6).bfloat16()
    cos, sin = ref.rope_cos_sin(ref.rope_inv_freq(64, 10000.0), 6)
    ours = ref.apply_rope(x, cos[:, None], sin[:, None])
    testing.assert_bitwise_equal(ours[..., 64:], kernels.apply_rope(x[..., 64:], cos, sin))
