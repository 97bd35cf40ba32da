"""The grouped FP32-output FP8 GEMM after a rotation of each head's tail (``rotated_fp8_block_grouped_gemm``, the
attention output's de-rotation with ``wo_a``): the reference is ``apply_rope`` into an FP32 copy, then the grouped
GEMM, bit for bit; the Triton op (interpreter on CPU, compiled on CUDA) gives the bits of its own grouped GEMM on
Triton's rotated FP32 copy, whether its tile rotates inside the ``x̂`` launch (``dequant_bf16``, ``swap_bf16``) or
reads the copy; the Ascend one (through the torch_npu double) rotates with its own ``apply_rope``; argument checks."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import random_e4m3, random_normal, random_ue8m0
from deepinfer_kernels.testing_npu_double import NpuDouble


def _heads(tokens: int, heads: int, width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values whose 32-column groups span 2^−10 … 2^10, with signed zeros in every head (a rotation must keep
    the zeros it does not touch as they are)."""
    spread = torch.logspace(-3, 3, width // 32).repeat_interleave(32).roll(seed)
    x = random_normal((tokens, heads, width), seed=seed) * spread
    x[:, :, 1] = -0.0
    x[:, :, width - 1] = -0.0
    x[:, :, 0] = 0.0
    return x.to(dtype)


def _table(tokens: int, rope_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotations by random angles, sines negated as the inverse rotation has them."""
    angles = random_normal((tokens, rope_dim // 2), seed=seed) * 3.0
    return torch.cos(angles), -torch.sin(angles)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_e4m3((n, k), seed=seed), random_ue8m0((-(-n // 32), k // 32), seed=seed + 1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The public ``apply_rope`` of each head's tail into an FP32 copy of x, [T, H·D]."""
    rotated = x.float().clone()
    tail = rotated[..., x.shape[2] - 2 * cos.shape[1] :]
    tail.copy_(dk.apply_rope(tail, cos, sin))
    return rotated.view(x.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_apply_rope_into_fp32_then_the_grouped_gemm(dtype: torch.dtype) -> None:
    groups, heads, width, rope_dim = 2, 4, 96, 32
    x = _heads(5, heads, width, seed=1, dtype=dtype)
    cos, sin = _table(5, rope_dim, seed=2)
    w_q, w_scale = _weight(64, heads * width // groups, seed=3)
    out = dk.rotated_fp8_block_grouped_gemm(x, cos, sin, w_q, w_scale, groups)
    assert out.dtype == torch.float32 and out.shape == (5, 64)
    assert torch.equal(out, dk.fp8_block_grouped_gemm(_rotated(x, cos, sin), w_q, w_scale, groups))
    assert not torch.equal(out, dk.fp8_block_grouped_gemm(x.reshape(5, -1), w_q, w_scale, groups))


def test_arguments_are_checked() -> None:
    x = _heads(3, 2, 64, seed=4, dtype=torch.bfloat16)
    cos, sin = _table(3, 32, seed=5)
    w_q, w_scale = _weight(64, 64, seed=6)
    assert dk.rotated_fp8_block_grouped_gemm(x[:0], cos[:0], sin[:0], w_q, w_scale, 2).shape == (0, 64)
    with pytest.raises(ValueError, match=r"x must be \[T, H, D\]"):
        dk.rotated_fp8_block_grouped_gemm(x.view(3, -1), cos, sin, w_q, w_scale, 2)
    with pytest.raises(ValueError, match="cos must be"):
        dk.rotated_fp8_block_grouped_gemm(x, cos[:2], sin[:2], w_q, w_scale, 2)
    with pytest.raises(ValueError, match="sin must be"):
        dk.rotated_fp8_block_grouped_gemm(x, cos, sin[:2], w_q, w_scale, 2)
    with pytest.raises(ValueError, match="cos must be"):
        dk.rotated_fp8_block_grouped_gemm(x, *_table(3, 128, seed=7), w_q, w_scale, 2)
    with pytest.raises(ValueError, match="one shape"):
        dk.rotated_fp8_block_grouped_gemm(x, cos, sin[:, :8], w_q, w_scale, 2)
    with pytest.raises(TypeError):
        dk.rotated_fp8_block_grouped_gemm(x, cos.double(), sin, w_q, w_scale, 2)
    with pytest.raises(ValueError, match="groups·K"):
        dk.rotated_fp8_block_grouped_gemm(x, cos, sin, w_q, w_scale, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "heads", "width", "rope_dim"), [(1, 2, 64, 64), (5, 3, 128, 64), (70, 2, 96, 16), (17, 4, 64, 64)]
)
def test_quantized_values_rotate_as_apply_rope_into_an_fp32_copy(
    triton_device: str, dtype: torch.dtype, rows: int, heads: int, width: int, rope_dim: int
) -> None:
    """Triton's rotated FP32 copy is its ``apply_rope`` kernel on an FP32 copy's tails, and x̂ with the rotation
    inside its launch equals x̂ of that copy, bit for bit: tails of two groups, of half a group, and whole heads; one
    group a program (at most 64 rows) and eight (70 rows: a program's columns then end inside a head)."""
    from deepinfer_kernels.cuda.quant import quantized_values, rotated_copy
    from deepinfer_kernels.cuda.rope import HeadRotation

    x = _heads(rows, heads, width, seed=rows, dtype=dtype).view(rows, -1).to(triton_device)
    cos, sin = (t.to(triton_device) for t in _table(rows, rope_dim, seed=rows + 1))
    rotation = HeadRotation(cos, sin, width)
    fused = torch.empty(x.shape, dtype=torch.bfloat16, device=triton_device)
    quantized_values(x, fused, rotation=rotation)
    copy = rotated_copy(x, rotation)
    expected = x.float().clone().view(rows, heads, width)
    tail = expected[..., width - rope_dim :]
    implementation("apply_rope", Backend.NVIDIA)(tail, cos, sin, tail)
    assert torch.equal(copy.view(torch.int32), expected.view(rows, -1).view(torch.int32))
    unfused = torch.empty_like(fused)
    quantized_values(copy, unfused)
    assert torch.equal(fused.view(torch.int16), unfused.view(torch.int16))
    plain = torch.empty_like(fused)
    quantized_values(x, plain)
    assert not torch.equal(fused, plain)
    with pytest.raises(ValueError, match="rotation or order"):
        quantized_values(x, fused, rotation=rotation, order=torch.arange(rows, device=triton_device))


@pytest.mark.parametrize("decoding", ["dequant_bf16", "swap_bf16", None])
@pytest.mark.parametrize("rows", [1, 37])
def test_triton_op_equals_its_grouped_gemm_on_the_rotated_copy(
    triton_device: str, decoding: str | None, rows: int
) -> None:
    """The fused tiles (x̂ rotated in its launch) and the others (the default tile: the GEMV at one row, an MMA tile at
    37) give the bits of the Triton grouped GEMM with the same tile on ``rotated_copy``."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
    from deepinfer_kernels.cuda.quant import rotated_copy
    from deepinfer_kernels.cuda.rope import HeadRotation

    groups, heads, width, rope_dim, n = 2, 4, 128, 64, 128
    configs = {
        "dequant_bf16": BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=False, decoding="dequant_bf16"),
        "swap_bf16": BlockConfig(16, 64, num_warps=4, num_stages=2, split_grid=False, block_k=64, decoding="swap_bf16"),
    }
    config = {"config": configs[decoding]} if decoding else {}
    x = _heads(rows, heads, width, seed=rows + 40, dtype=torch.bfloat16).to(triton_device)
    cos, sin = (t.to(triton_device) for t in _table(rows, rope_dim, seed=rows + 41))
    w_q, w_scale = (t.to(triton_device) for t in _weight(n, heads * width // groups, seed=rows + 42))
    fused = torch.empty((rows, n), dtype=torch.float32, device=triton_device)
    implementation("rotated_fp8_block_grouped_gemm", Backend.NVIDIA)(x, cos, sin, w_q, w_scale, fused, **config)
    copy = rotated_copy(x.view(rows, -1), HeadRotation(cos, sin, width))
    expected = torch.empty_like(fused)
    implementation("fp8_block_grouped_gemm", Backend.NVIDIA)(copy, w_q, w_scale, expected, **config)
    assert torch.equal(fused.view(torch.int32), expected.view(torch.int32))


def test_ascend_rotates_with_its_rope_then_runs_the_reference_gemm(npu_double: NpuDouble) -> None:
    """On Ascend the rotation is ``npu_rotary_mul``'s (``ascend.rope``), the GEMM the reference's: the bits of the
    model's two steps before the op."""
    groups, heads, width, rope_dim = 2, 4, 64, 32
    x = _heads(6, heads, width, seed=50, dtype=torch.bfloat16)
    cos, sin = _table(6, rope_dim, seed=51)
    w_q, w_scale = _weight(64, heads * width // groups, seed=52)
    out = torch.empty((6, 64), dtype=torch.float32)
    implementation("rotated_fp8_block_grouped_gemm", Backend.ASCEND)(x, cos, sin, w_q, w_scale, out)
    rotated = x.float().clone()
    tail = rotated[..., width - rope_dim :]
    implementation("apply_rope", Backend.ASCEND)(tail, cos, sin, tail)
    expected = torch.empty_like(out)
    implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(rotated.view(6, -1), w_q, w_scale, expected)
    assert torch.equal(out, expected)
    assert not torch.equal(out, dk.fp8_block_grouped_gemm(x.reshape(6, -1), w_q, w_scale, groups))
