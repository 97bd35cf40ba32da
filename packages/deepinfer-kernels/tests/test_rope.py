"""RoPE: table builders against hand-worked values and in float64, rotation parity across backends, wrapper checks.

Rotation tolerances: the reference emulates the fma in FP64 and the NPU uses a multiply and an add, so results
may differ by 1 ulp of the largest FP32 term before the final rounding; bf16 outputs must agree within 1 bf16 ulp
(rtol 2^−7 plus that absolute slack), fp32 outputs within 2 FP32 ulps of max|x|.
"""

from __future__ import annotations

import math

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_bitwise_equal, assert_close, random_normal

Fast = tuple[Backend, str]


def test_base_frequencies() -> None:
    inv = dk.rope_inverse_frequencies(64, 10000.0)
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    exact = torch.tensor([1.0 / 10000.0 ** (2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert_close(inv, exact, rtol=2.0**-22, atol=0.0)
    assert inv[0].item() == 1.0


def test_yarn_worked_example() -> None:
    # YaRN bounds worked by hand: r = 64, base 160000, L0 = 1024, β_f = 32, β_s = 1 → lo = 4, hi = 14.
    factor = 16.0
    inv = dk.yarn_inverse_frequencies(64, 160000.0, factor, 1024, 32.0, 1.0)
    base = dk.rope_inverse_frequencies(64, 160000.0)
    powers = torch.pow(torch.tensor(160000.0), torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    assert torch.equal(inv[:5], base[:5])  # i ≤ lo keep the original frequency exactly
    assert torch.equal(inv[14:], 1.0 / (factor * powers[14:]))  # i ≥ hi are divided by φ
    ramp = (torch.arange(5, 14, dtype=torch.float32) - 4.0) / 10.0
    blended = (1.0 / (factor * powers[5:14])) * ramp + (1.0 / powers[5:14]) * (1.0 - ramp)
    assert_close(inv[5:14], blended, rtol=2.0**-22, atol=0.0)
    assert torch.all(inv[5:14] < base[5:14]) and torch.all(inv[5:14] > base[5:14] / factor)


def test_yarn_equal_bounds_get_nudged() -> None:
    # With β_f == β_s both corrections coincide; hi is nudged by 0.001 so the ramp is a step, not a 0/0.
    inv = dk.yarn_inverse_frequencies(64, 10000.0, 4.0, 4096, 8.0, 8.0)
    assert torch.isfinite(inv).all()


def test_cos_sin_table() -> None:
    inv = dk.rope_inverse_frequencies(16, 10000.0)
    cos, sin = dk.rope_cos_sin(inv, 3000)
    assert cos.shape == sin.shape == (3000, 8) and cos.dtype == torch.float32
    angles = torch.outer(torch.arange(3000, dtype=torch.float32), inv)  # FP32 angles, as the tables use
    assert_close(cos, torch.cos(angles.double()), rtol=0.0, atol=2.0**-23)
    assert_close(sin, torch.sin(angles.double()), rtol=0.0, atol=2.0**-23)
    assert dk.rope_cos_sin(inv, 0)[0].shape == (0, 8)


def _tables(num_tokens: int, rope_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = random_normal((num_tokens, rope_dim // 2), seed=seed, std=100.0)
    return torch.cos(angles), torch.sin(angles)


@pytest.mark.parametrize(("tokens", "heads", "rope_dim"), [(1, 1, 2), (5, 3, 6), (4, 17, 64), (3, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_apply_rope_parity(fast_backend: Fast, tokens: int, heads: int, rope_dim: int, dtype: torch.dtype) -> None:
    backend, device = fast_backend
    x = random_normal((tokens, heads, rope_dim), seed=tokens * 100 + heads, dtype=dtype, std=4.0)
    cos, sin = _tables(tokens, rope_dim, seed=heads)
    expected = torch.empty_like(x)
    implementation("apply_rope", Backend.REFERENCE)(x, cos, sin, expected)
    actual = torch.empty_like(x, device=device)
    implementation("apply_rope", backend)(x.to(device), cos.to(device), sin.to(device), actual)
    slack = 2 * 2.0**-23 * x.float().abs().max().item()
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 0.0
    assert_close(actual.cpu(), expected, rtol=rtol, atol=slack)


def test_reference_is_the_interleaved_formula() -> None:
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    cos = torch.tensor([[0.5, 0.0]])
    sin = torch.tensor([[0.25, 1.0]])
    out = torch.empty_like(x)
    implementation("apply_rope", Backend.REFERENCE)(x, cos, sin, out)
    # pair 0: (1·0.5 − 2·0.25, 1·0.25 + 2·0.5); pair 1: (3·0 − 4·1, 3·1 + 4·0)
    assert out.flatten().tolist() == [0.0, 1.25, -4.0, 3.0]


def test_inverse_rotation_round_trip(op_device: str) -> None:
    x = random_normal((6, 2, 32), seed=5, device=op_device)
    inv = dk.yarn_inverse_frequencies(32, 160000.0, 16.0, 1024, 32.0, 1.0)
    cos_table, sin_table = dk.rope_cos_sin(inv, 100)
    positions = torch.tensor([0, 1, 7, 50, 98, 99])
    cos, sin = cos_table[positions].to(op_device), sin_table[positions].to(op_device)
    rotated = dk.apply_rope(x, cos, sin)
    back = dk.apply_rope(rotated, cos, -sin)
    assert_close(back, x, rtol=0.0, atol=1e-5)
    assert torch.equal(rotated[0], x[0])  # position 0 is the identity


def test_public_op_shapes_empty_and_2d(op_device: str) -> None:
    cos, sin = (t.to(op_device) for t in _tables(3, 8, seed=6))
    x2 = random_normal((3, 8), seed=7, dtype=torch.bfloat16, device=op_device)
    x3 = x2[:, None, :]
    assert_bitwise_equal(dk.apply_rope(x2, cos, sin), dk.apply_rope(x3, cos, sin)[:, 0])
    wide = random_normal((3, 2, 12), seed=8, dtype=torch.bfloat16, device=op_device)
    sliced = wide[..., 4:]  # non-contiguous rope slice
    assert_bitwise_equal(dk.apply_rope(sliced, cos, sin), dk.apply_rope(sliced.contiguous(), cos, sin))
    empty = dk.apply_rope(*(torch.empty(shape, device=op_device) for shape in ((0, 2, 8), (0, 4), (0, 4))))
    assert empty.shape == (0, 2, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_rotation_of_a_strided_tail(op_device: str, dtype: torch.dtype) -> None:
    """``apply_rope_`` on the rope tail of wider vectors (what the model rotates): the same bits as ``apply_rope``
    there, the other columns untouched; 2-D rows and a slice whose heads cannot be viewed as one dimension too."""
    cos, sin = (t.to(op_device) for t in _tables(5, 16, seed=11))
    wide = random_normal((5, 3, 40), seed=12, dtype=dtype, std=4.0, device=op_device)
    rows = random_normal((5, 24), seed=13, dtype=dtype, std=4.0, device=op_device)
    gapped = random_normal((5, 2, 4, 24), seed=14, dtype=dtype, std=4.0, device=op_device)[:, :, :3]
    for x in (wide, rows, gapped):
        tail = x[..., -16:]
        before = x.clone()
        expected = dk.apply_rope(tail, cos, sin)
        assert dk.apply_rope_(tail, cos, sin) is tail
        assert_bitwise_equal(tail, expected)
        assert_bitwise_equal(x[..., :-16], before[..., :-16])


def _positions(seed: int) -> torch.Tensor:
    """0, 1, a table's far end and random positions up to 2^20 (exact in FP32), in no order."""
    random = torch.randint(0, 1 << 20, (45,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([torch.tensor([0, 1, 2999, (1 << 20) - 1]), random])


def test_reference_table_is_the_cos_sin_tables_rows() -> None:
    """``rope_table``'s planes are the rows of ``rope_cos_sin`` at the positions, bit for bit, and the negated sines;
    int32 positions give the same."""
    inv = dk.yarn_inverse_frequencies(64, 160000.0, 16.0, 1024, 32.0, 1.0)
    positions = torch.tensor([0, 1, 7, 2999, 1234, 5])
    cos, sin = dk.rope_cos_sin(inv, 3000)
    planes = dk.rope_table(positions, inv)
    assert planes.shape == (3, 6, 32) and planes.is_contiguous()
    assert_bitwise_equal(planes[0], cos[positions])
    assert_bitwise_equal(planes[1], sin[positions])
    assert_bitwise_equal(planes[2], -sin[positions])
    assert_bitwise_equal(dk.rope_table(positions.int(), inv), planes)
    assert dk.rope_table(torch.empty(0, dtype=torch.int64), inv).shape == (3, 0, 32)


@pytest.mark.parametrize("rope_dim", [2, 24, 64])
def test_rope_table_triton(triton_device: str, rope_dim: int) -> None:
    """The Triton table against the reference on positions up to 2^20 and both frequency kinds: the same FP32 angles,
    so cos and sin differ only by the math library's rounding (within 2 FP32 ulps of 1); the third plane is exactly
    the negated second; 49 positions span four programs, the last one partial."""
    for seed, inv in enumerate(
        (
            dk.rope_inverse_frequencies(rope_dim, 10000.0),
            dk.yarn_inverse_frequencies(rope_dim, 160000.0, 16.0, 1024, 32.0, 1.0),
        )
    ):
        positions = _positions(seed)
        expected = torch.empty(3, positions.shape[0], rope_dim // 2)
        implementation("rope_table", Backend.REFERENCE)(positions, inv, expected)
        actual = torch.full((3, positions.shape[0], rope_dim // 2), math.nan, device=triton_device)
        implementation("rope_table", Backend.NVIDIA)(positions.to(triton_device), inv.to(triton_device), actual)
        actual = actual.cpu()
        assert_close(actual, expected, rtol=0.0, atol=2 * 2.0**-24)
        assert_bitwise_equal(actual[2], -actual[1])


def test_validation() -> None:
    cos, sin = _tables(3, 8, seed=9)
    with pytest.raises(ValueError, match="must be even"):
        dk.apply_rope(torch.zeros(3, 7), cos, sin)
    with pytest.raises(ValueError, match=r"cos must have shape \(3, 4\)"):
        dk.apply_rope(torch.zeros(3, 8), cos[:2], sin)
    with pytest.raises(TypeError, match=r"cos has dtype torch\.bfloat16"):
        dk.apply_rope(torch.zeros(3, 8), cos.bfloat16(), sin)
    with pytest.raises(TypeError, match=r"positions has dtype torch\.float32"):
        dk.rope_table(torch.zeros(3), dk.rope_inverse_frequencies(8, 10000.0))
    with pytest.raises(ValueError, match="inverse_frequencies must be 1-D"):
        dk.rope_table(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rope_dim must be a positive even int"):
        dk.rope_inverse_frequencies(7, 10000.0)
    with pytest.raises(ValueError, match="factor must be a positive finite number"):
        dk.yarn_inverse_frequencies(64, 10000.0, math.nan, 1024, 32.0, 1.0)
