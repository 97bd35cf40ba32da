"""Row formats: bytes identical to the quantization ops' layouts, hand-worked FP4/e4m3 bytes, the fused store."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels.testing import assert_bitwise_equal, random_normal

F = dk.RowFormat


def _spread(shape: tuple[int, int], seed: int) -> torch.Tensor:
    x = random_normal(shape, seed=seed)
    x *= torch.logspace(-6, 6, shape[0])[:, None]
    x[0] = 0.0
    x[1, :7] = -0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_are_the_per_token_group_layout(dtype: torch.dtype) -> None:
    x = _spread((37, 96), seed=1).to(dtype)
    q, scale = dk.quantize_fp8_per_token_group(x, 32)
    rows = dk.encode_rows(x, F.FP8)
    assert rows.shape == (37, 96 + 3) and dk.bytes_per_row(F.FP8, 96) == 99
    assert_bitwise_equal(rows, torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1))
    assert_bitwise_equal(dk.decode_rows(rows, F.FP8), dk.dequantize_fp8_per_token_group(q, scale))


def test_fp4_ue8m0_rows_are_the_mxfp4_layout() -> None:
    x = _spread((29, 128), seed=2)
    packed, scale = dk.quantize_mxfp4(x)
    rows = dk.encode_rows(x, F.FP4_UE8M0)
    assert rows.shape == (29, 68)
    assert_bitwise_equal(rows, torch.cat([packed.view(torch.uint8), scale.view(torch.uint8)], dim=-1))
    assert_bitwise_equal(dk.decode_rows(rows, F.FP4_UE8M0), dk.dequantize_mxfp4(packed, scale))


def test_fp4_e4m3_rows_by_hand() -> None:
    # Group 0: amax 3 → scale e4m3(0.5) = 0x30; x/scale = 2·x. Group 1: all zero → floor scale 2^−9 = e4m3 0x01.
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([3.0, -0.25, 0.375, 1.0, -3.0, 0.125])
    rows = dk.encode_rows(x, F.FP4_E4M3)
    # codes: 6 → 7, −0.5 → 0x9, 0.75 → 1.5 boundary tie → even code 2 (1.0), 2 → 4, −6 → 0xF, 0.25 → tie → 0 (even).
    assert rows[0, :3].tolist() == [0x97, 0x42, 0x0F]
    assert rows[0, 16:].tolist() == [0x30, 0x01]
    expected = torch.zeros(32)
    expected[:6] = torch.tensor([3.0, -0.25, 0.5, 1.0, -3.0, 0.0])
    assert_bitwise_equal(dk.decode_rows(rows, F.FP4_E4M3)[0].abs(), expected.abs())


@pytest.mark.parametrize("fmt", list(F))
def test_decoded_values_are_bf16_exact_and_stable(fmt: dk.RowFormat) -> None:
    decoded = dk.decode_rows(dk.encode_rows(_spread((41, 64), seed=3), fmt), fmt, 64)
    if fmt is F.FP4_E4M3:
        # Its scale is not a power of two, so re-encoding may move the grid; only BF16 exactness holds.
        assert_bitwise_equal(decoded.to(torch.bfloat16).float(), decoded)
        return
    # Power-of-two scales: the dequantized values lie on a grid that encodes without loss.
    assert_bitwise_equal(dk.decode_rows(dk.encode_rows(decoded, fmt), fmt), decoded)
    if fmt is not F.RAW_FP32:
        assert_bitwise_equal(decoded.to(torch.bfloat16).float(), decoded)


@pytest.mark.parametrize("fmt", list(F))
def test_round_trip_error_is_bounded(fmt: dk.RowFormat) -> None:
    x = random_normal((50, 64), seed=4)
    err = (dk.decode_rows(dk.encode_rows(x, fmt), fmt) - x).abs()
    group_max = x.abs().view(50, -1, fmt.group_size).amax(-1).repeat_interleave(fmt.group_size, dim=1)
    bound = {F.FP8: 2.0**-4, F.FP4_E4M3: 0.25, F.FP4_UE8M0: 0.34, F.RAW_FP32: 0.0}[fmt]
    assert (err <= bound * group_max + 1e-30).all()


def test_encode_keeps_leading_dims_and_empty_batches() -> None:
    assert dk.encode_rows(torch.zeros(2, 3, 32), F.FP8).shape == (2, 3, 33)
    assert dk.encode_rows(torch.zeros(0, 32), F.FP4_UE8M0).shape == (0, 17)
    assert dk.decode_rows(torch.zeros(0, 4, 17, dtype=torch.uint8), F.FP4_UE8M0).shape == (0, 4, 32)


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of FP4_E4M3's group of 16"):
        dk.encode_rows(torch.zeros(2, 24), F.FP4_E4M3)
    with pytest.raises(ValueError, match="not width=64"):
        dk.decode_rows(torch.zeros(2, 33, dtype=torch.uint8), F.FP8, 64)
    with pytest.raises(TypeError, match="uint8"):
        dk.decode_rows(torch.zeros(2, 33), F.FP8)
    with pytest.raises(ValueError, match="whole number"):
        dk.decode_rows(torch.zeros(2, 34, dtype=torch.uint8), F.FP8)


@pytest.mark.parametrize("fmt", list(F))
def test_store_rows_writes_the_encoding_and_skips_negative_rows(fmt: dk.RowFormat) -> None:
    width = 64
    pool = torch.randint(0, 256, (3, 5, dk.bytes_per_row(fmt, width)), dtype=torch.int32).to(torch.uint8)
    before = pool.clone()
    rows = torch.tensor([7, -1, 0, 14, -1])
    values = random_normal((5, width), seed=5, dtype=torch.bfloat16)
    dk.store_rows(pool, rows, values, fmt)
    flat, flat_before = pool.view(15, -1), before.view(15, -1)
    encoded = dk.encode_rows(values, fmt)
    for i, row in enumerate(rows.tolist()):
        if row >= 0:
            assert_bitwise_equal(flat[row], encoded[i])
    untouched = [r for r in range(15) if r not in (7, 0, 14)]
    assert_bitwise_equal(flat[untouched], flat_before[untouched])


def test_store_rows_refuses_mismatched_pools() -> None:
    pool = torch.zeros(4, 33, dtype=torch.uint8)
    with pytest.raises(ValueError, match="33 bytes but FP8 rows of width 64 need 66"):
        dk.store_rows(pool, torch.tensor([0]), torch.zeros(1, 64), F.FP8)
    with pytest.raises(TypeError, match="rows has dtype"):
        dk.store_rows(pool, torch.tensor([0.0]), torch.zeros(1, 32), F.FP8)
    with pytest.raises(ValueError, match="contiguous"):
        dk.store_rows(torch.zeros(33, 4, dtype=torch.uint8).t(), torch.tensor([0]), torch.zeros(1, 32), F.FP8)
    dk.store_rows(pool, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 32), F.FP8)
