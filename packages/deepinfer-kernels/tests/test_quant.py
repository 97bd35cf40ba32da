"""FP8 / MXFP4 ops: fast backends vs reference (bit-exact), format properties, public-wrapper checks."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import (
    assert_bitwise_equal,
    random_e4m3,
    random_mxfp4_packed,
    random_normal,
    random_ue8m0,
)

Fast = tuple[Backend, str]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _run(op: str, backend: Backend, device: str, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]):
    """Run ``op`` on ``backend`` (tensors moved to ``device``) and on the reference; return both output tuples."""
    fast_out = tuple(torch.empty_like(o, device=device) for o in outputs)
    implementation(op, backend)(*(t.to(device) for t in inputs), *fast_out)
    ref_out = tuple(torch.empty_like(o) for o in outputs)
    implementation(op, Backend.REFERENCE)(*inputs, *ref_out)
    return tuple(o.cpu() for o in fast_out), ref_out


def _with_outliers(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values with a few large and a few tiny groups, so scales span many exponents."""
    x = random_normal(shape, seed=seed) * torch.logspace(-6, 3, shape[-1]).roll(seed % shape[-1])
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (64, 96), (70, 45)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_fp8_block_parity(fast_backend: Fast, shape: tuple[int, int], dtype: torch.dtype) -> None:
    backend, device = fast_backend
    w = _with_outliers(shape, seed=11, dtype=dtype)
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((_cdiv(shape[0], 32), _cdiv(shape[1], 32)), dtype=torch.float8_e8m0fnu)
    (q_fast, s_fast), (q_ref, s_ref) = _run("quantize_fp8_block", backend, device, (w,), (q, scale))
    assert_bitwise_equal(q_fast, q_ref, "q")
    assert_bitwise_equal(s_fast, s_ref, "scale")


@pytest.mark.parametrize("shape", [(1, 1), (31, 33), (70, 45), (40, 200)])  # 200 columns: 7 blocks, 2 programs
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_block_parity(fast_backend: Fast, shape: tuple[int, int], out_dtype: torch.dtype) -> None:
    backend, device = fast_backend
    q = random_e4m3(shape, seed=12)
    scale = random_ue8m0((_cdiv(shape[0], 32), _cdiv(shape[1], 32)), seed=13)
    (out_fast,), (out_ref,) = _run(
        "dequantize_fp8_block", backend, device, (q, scale), (torch.empty(shape, dtype=out_dtype),)
    )
    assert_bitwise_equal(out_fast, out_ref)


# Beyond 64 rows the Triton kernels take 8 groups a program: 70 rows of 10 groups (a partial group tile) and 2 groups of
# 128 columns.
_WIDE_GROUP_CASES = [(70, 320, 32), (100, 256, 128)]


@pytest.mark.parametrize(
    ("rows", "cols", "group"), [(1, 32, 32), (19, 96, 32), (5, 256, 128), (3, 256, 32), *_WIDE_GROUP_CASES]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_fp8_per_token_group_parity(
    fast_backend: Fast, rows: int, cols: int, group: int, dtype: torch.dtype
) -> None:
    backend, device = fast_backend
    x = _with_outliers((rows, cols), seed=14, dtype=dtype)
    x[0, :group] = 0.0  # an all-zero group takes the amax floor
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    scale = torch.empty((rows, cols // group), dtype=torch.float8_e8m0fnu)
    (q_fast, s_fast), (q_ref, s_ref) = _run("quantize_fp8_per_token_group", backend, device, (x,), (q, scale))
    assert_bitwise_equal(q_fast, q_ref, "q")
    assert_bitwise_equal(s_fast, s_ref, "scale")


@pytest.mark.parametrize(("rows", "cols", "group"), [(1, 32, 32), (19, 96, 32), (5, 256, 128), *_WIDE_GROUP_CASES])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_fp8_per_token_group_parity(
    fast_backend: Fast, rows: int, cols: int, group: int, out_dtype: torch.dtype
) -> None:
    backend, device = fast_backend
    q = random_e4m3((rows, cols), seed=15)
    scale = random_ue8m0((rows, cols // group), seed=16)
    out = torch.empty((rows, cols), dtype=out_dtype)
    (out_fast,), (out_ref,) = _run("dequantize_fp8_per_token_group", backend, device, (q, scale), (out,))
    assert_bitwise_equal(out_fast, out_ref)


# Scale bytes from the subnormal factor 2^−127 (byte 0) to NaN (255), each with all 256 codes NaN codes included.
_EDGE_SCALE_BYTES = (0, 1, 2, 9, 100, 127, 140, 200, 253, 254, 255)


def _assert_equal_but_nan_payloads(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # A NaN's sign and payload are the platform's (the CPU reference rounds an FP32 NaN to bf16 0xFFFF, the bit
    # arithmetic gives 0x7FC0, a GPU's FP32 arithmetic its canonical NaN), so there only NaN-ness is compared.
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    assert_bitwise_equal(actual.masked_fill(nan, 0.0), expected.masked_fill(nan, 0.0))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_dequantizers_decode_every_code_at_edge_scales(triton_device: str, out_dtype: torch.dtype) -> None:
    # The compiled kernels decode e4m3 by the hardware conversion and round to bf16 by the hardware's; the interpreter
    # by bit arithmetic: both against the reference on every code, subnormal, huge and NaN factors. (The Ascend path
    # matches the reference only from scale byte 10 on: ascend.quant says why.)
    backend, device = Backend.NVIDIA, triton_device
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    scale_bytes = torch.tensor(_EDGE_SCALE_BYTES, dtype=torch.uint8)
    # Per token group: 8 rows a scale byte (88 rows: the wide-group programs), 256 columns of all codes.
    rows = scale_bytes.repeat_interleave(8)
    q = codes.view(torch.uint8).repeat(rows.numel(), 1).view(torch.float8_e4m3fn)
    scale = rows[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    (out_fast,), (out_ref,) = _run(
        "dequantize_fp8_per_token_group", backend, device, (q, scale), (torch.empty(q.shape, dtype=out_dtype),)
    )
    _assert_equal_but_nan_payloads(out_fast, out_ref)
    # 32×32 blocks: one block row a scale byte.
    q = codes.view(torch.uint8).repeat(32 * scale_bytes.numel(), 1).view(torch.float8_e4m3fn)
    scale = scale_bytes[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    (out_fast,), (out_ref,) = _run(
        "dequantize_fp8_block", backend, device, (q, scale), (torch.empty(q.shape, dtype=out_dtype),)
    )
    _assert_equal_but_nan_payloads(out_fast, out_ref)


@pytest.mark.parametrize("shape", [(1, 32), (17, 96), (33, 64)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_mxfp4_parity(fast_backend: Fast, shape: tuple[int, int], out_dtype: torch.dtype) -> None:
    backend, device = fast_backend
    rows, cols = shape
    packed = random_mxfp4_packed((rows, cols // 2), seed=17)
    scale = random_ue8m0((rows, cols // 32), seed=18)
    (out_fast,), (out_ref,) = _run(
        "dequantize_mxfp4", backend, device, (packed, scale), (torch.empty(shape, dtype=out_dtype),)
    )
    assert_bitwise_equal(out_fast, out_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_group_roundtrip_and_tight_scales(op_device: str, dtype: torch.dtype) -> None:
    x = _with_outliers((9, 128), seed=19, dtype=dtype)
    q, scale = dk.quantize_fp8_per_token_group(x.to(op_device))
    back = dk.dequantize_fp8_per_token_group(q, scale).cpu()
    q = q.cpu()
    xf = x.float()
    amax = xf.view(9, 4, 32).abs().amax(-1).clamp_min(1e-4).repeat_interleave(32, dim=1)
    assert torch.all((back - xf).abs() <= xf.abs() / 16 + amax / 2**15)
    qf = q.float().view(9, 4, 32).abs().amax(-1)
    # The power-of-two ceiling is tight: the largest code of a group above the floor lands in [224, 448].
    above_floor = xf.view(9, 4, 32).abs().amax(-1) >= 1e-4
    assert torch.all(qf <= 448)
    assert torch.all(qf[above_floor] >= 224)


def test_mxfp4_roundtrip(op_device: str) -> None:
    w = _with_outliers((7, 96), seed=20, dtype=torch.float32)
    packed, scale = dk.quantize_mxfp4(w.to(op_device))
    back = dk.dequantize_mxfp4(packed, scale).cpu()
    amax = w.view(7, 3, 32).abs().amax(-1).repeat_interleave(32, dim=1)
    assert torch.all((back - w).abs() <= w.abs() / 4 + amax / 12)


def test_fp8_block_roundtrip(op_device: str) -> None:
    w = random_normal((45, 70), seed=21, std=0.05)
    q, scale = dk.quantize_fp8_block(w.to(op_device))
    back = dk.dequantize_fp8_block(q, scale, out_dtype=torch.float32).cpu()
    assert torch.all((back - w).abs() <= w.abs() / 16 + 2**-20)


def test_empty_inputs(op_device: str) -> None:
    q, scale = dk.quantize_fp8_block(torch.empty(0, 40, device=op_device))
    assert q.shape == (0, 40) and scale.shape == (0, 2)
    assert dk.dequantize_fp8_block(q, scale).shape == (0, 40)
    q, scale = dk.quantize_fp8_per_token_group(torch.empty(0, 64, dtype=torch.bfloat16, device=op_device))
    assert q.shape == (0, 64) and scale.shape == (0, 2)
    assert dk.dequantize_fp8_per_token_group(q, scale, out_dtype=torch.bfloat16).shape == (0, 64)
    packed, scale = dk.quantize_mxfp4(torch.empty(0, 64, device=op_device))
    assert packed.shape == (0, 32) and scale.shape == (0, 2)
    assert dk.dequantize_mxfp4(packed, scale).shape == (0, 64)
    assert dk.ue8m0_to_float(torch.empty(0, dtype=torch.uint8, device=op_device)).shape == (0,)


def test_leading_dims_are_kept(op_device: str) -> None:
    x = random_normal((2, 3, 64), seed=22, dtype=torch.bfloat16)
    q, scale = (t.cpu() for t in dk.quantize_fp8_per_token_group(x.to(op_device)))
    assert q.shape == (2, 3, 64) and scale.shape == (2, 3, 2)
    ref_q = torch.empty(6, 64, dtype=torch.float8_e4m3fn)
    ref_s = torch.empty(6, 2, dtype=torch.float8_e8m0fnu)
    implementation("quantize_fp8_per_token_group", Backend.REFERENCE)(x.view(6, 64), ref_q, ref_s)
    assert_bitwise_equal(q.view(6, 64), ref_q)
    assert_bitwise_equal(scale.view(6, 2), ref_s)


def test_public_ops_match_reference_on_session_backend(op_device: str) -> None:
    w = random_normal((40, 64), seed=23)
    q, scale = (t.cpu() for t in dk.quantize_fp8_block(w.to(op_device)))
    ref_q = torch.empty_like(q)
    ref_s = torch.empty_like(scale)
    implementation("quantize_fp8_block", Backend.REFERENCE)(w, ref_q, ref_s)
    assert_bitwise_equal(q, ref_q)
    assert_bitwise_equal(scale, ref_s)


def test_wrapper_validation() -> None:
    with pytest.raises(TypeError, match=r"w has dtype torch\.int32"):
        dk.quantize_fp8_block(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be 2-D"):
        dk.quantize_fp8_block(torch.zeros(4))
    with pytest.raises(ValueError, match="group_size must be one of"):
        dk.quantize_fp8_per_token_group(torch.zeros(2, 64), group_size=16)
    with pytest.raises(ValueError, match="multiple of group_size=32"):
        dk.quantize_fp8_per_token_group(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="must be a multiple of 32"):
        dk.quantize_mxfp4(torch.zeros(2, 48))
    q = torch.zeros(40, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 2\)"):
        dk.dequantize_fp8_block(q, torch.zeros(1, 2).to(torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="out_dtype"):
        dk.dequantize_fp8_block(q, torch.ones(2, 2).to(torch.float8_e8m0fnu), out_dtype=torch.int8)
    with pytest.raises(ValueError, match="does not match q"):
        dk.dequantize_fp8_per_token_group(q, torch.ones(40, 3).to(torch.float8_e8m0fnu))
    with pytest.raises(TypeError, match="scale has dtype"):
        dk.ue8m0_to_float(torch.zeros(3))


@pytest.mark.parametrize("shape", [(1, 32), (17, 96), (33, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_mxfp4_triton_parity(triton_device: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, cols = shape
    w = _with_outliers(shape, seed=24, dtype=dtype)
    w[0, :32] = 0.0  # an all-zero group takes the FP4 amax floor
    w[-1, -1] = -0.0
    packed = torch.empty((rows, cols // 2), dtype=torch.int8)
    scale = torch.empty((rows, cols // 32), dtype=torch.float8_e8m0fnu)
    (p_fast, s_fast), (p_ref, s_ref) = _run("quantize_mxfp4", Backend.NVIDIA, triton_device, (w,), (packed, scale))
    assert_bitwise_equal(p_fast, p_ref, "packed")
    assert_bitwise_equal(s_fast, s_ref, "scale")
