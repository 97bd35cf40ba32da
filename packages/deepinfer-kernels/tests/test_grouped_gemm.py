"""mxfp4_grouped_gemm: every row equals mxfp4_gemm of that row with its expert's weight; -1 rows are zero."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import abs_product, assert_gemm_close, dequantized_activation, group_codes

import deepinfer_kernels as dk
from deepinfer_kernels.testing import assert_bitwise_equal, random_mxfp4_packed, random_normal, random_ue8m0


def _experts(experts: int, n: int, k: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    packed = random_mxfp4_packed((experts, n, k // 2), seed=seed, device=device)
    scale = random_ue8m0((experts, n, k // 32), seed=seed + 1, low=118, high=126, device=device)
    return packed, scale


def _per_row(x: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = []
    for m, expert in enumerate(ids.tolist()):
        if expert < 0:
            rows.append(torch.zeros(1, packed.shape[1], dtype=torch.bfloat16, device=x.device))
        else:
            rows.append(dk.mxfp4_gemm(x[m : m + 1], packed[expert], scale[expert]))
    return torch.cat(rows) if rows else torch.empty(0, packed.shape[1], dtype=torch.bfloat16, device=x.device)


def _assert_matches_rows(
    y: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor
) -> None:
    """Bitwise equal to the per-row loop on the reference (CPU); on CUDA, where Triton serves both ops with
    possibly different tile shapes, within the FP32-accumulation tolerance of _gemm_support."""
    expected = _per_row(x, ids, packed, scale)
    if y.device.type == "cpu":
        assert_bitwise_equal(y, expected)
        return
    x_hat = dequantized_activation(x)
    magnitude = torch.zeros(y.shape, dtype=torch.float64, device=y.device)
    for m, expert in enumerate(ids.tolist()):
        if expert >= 0:
            magnitude[m] = abs_product(x_hat[m : m + 1], dk.dequantize_mxfp4(packed[expert], scale[expert]))[0]
    assert_gemm_close(y, expected, magnitude, x.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_per_row_gemm(op_device: str, dtype: torch.dtype) -> None:
    experts, n, k, m = 5, 24, 96, 13
    packed, scale = _experts(experts, n, k, seed=1, device=op_device)
    x = random_normal((m, k), seed=3, dtype=dtype, device=op_device)
    # Expert 3 has no rows, -1 rows belong to no local expert, rows of one expert are not contiguous.
    ids = torch.tensor([0, 4, -1, 0, 1, 2, 4, -1, 1, 0, 2, 4, 0], device=op_device)
    y = dk.mxfp4_grouped_gemm(x, ids, packed, scale)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _assert_matches_rows(y, x, ids, packed, scale)
    assert torch.all(y[ids == -1] == 0)


def test_expert_rows_give_the_bare_ids_result(op_device: str) -> None:
    """The public op on an ``ExpertRows``: w13- and w2-like calls over one store equal the calls on the bare ids bit
    for bit (the nvidia backend keeps its tile tables in the store, the reference nothing). 42 rows: more than one MMA
    tile holds, so the nvidia backend builds tables (a call whose rows fit one tile needs none)."""
    packed, scale = _experts(4, 32, 64, seed=5, device=op_device)
    wide = _experts(4, 64, 64, seed=6, device=op_device)
    x = random_normal((42, 64), seed=7, dtype=torch.bfloat16, device=op_device)
    ids = torch.tensor([3, 0, -1, 3, 1, 0, 3] * 6, device=op_device)
    shared = dk.ExpertRows(ids)
    assert torch.equal(dk.mxfp4_grouped_gemm(x, shared, packed, scale), dk.mxfp4_grouped_gemm(x, ids, packed, scale))
    assert torch.equal(dk.mxfp4_grouped_gemm(x, shared, *wide), dk.mxfp4_grouped_gemm(x, ids, *wide))
    assert len(shared.derived) == (1 if op_device == "cuda" else 0)


def test_repeated_rows_equal_the_rows_copied(op_device: str) -> None:
    """``repeats``: product row i reads x's row i // repeats (a token's top-k rows), bit for bit the call on the rows
    copied (13 tokens × 3 choices, some without a local expert)."""
    packed, scale = _experts(5, 24, 96, seed=11, device=op_device)
    x = random_normal((13, 96), seed=12, dtype=torch.bfloat16, device=op_device)
    ids = torch.randint(-1, 5, (39,), generator=torch.Generator().manual_seed(13)).to(op_device)
    y = dk.mxfp4_grouped_gemm(x, dk.ExpertRows(ids), packed, scale, repeats=3)
    assert torch.equal(y, dk.mxfp4_grouped_gemm(x.repeat_interleave(3, dim=0), ids, packed, scale))
    with pytest.raises(ValueError, match=r"expert_ids must have shape \(26,\)"):
        dk.mxfp4_grouped_gemm(x, ids, packed, scale, repeats=2)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        dk.mxfp4_grouped_gemm(x, ids, packed, scale, repeats=0)


def test_replicated_experts_and_uint8(op_device: str) -> None:
    packed, scale = _experts(1, 16, 64, seed=4, device=op_device)
    packed, scale = packed.expand(3, -1, -1).contiguous(), scale.expand(3, -1, -1).contiguous()
    x = random_normal((4, 64), seed=5, dtype=torch.bfloat16, device=op_device).repeat(2, 1)
    ids = torch.tensor([0, 1, 2, 0, 2, 1, 0, 0], device=op_device)
    y = dk.mxfp4_grouped_gemm(x, ids, packed.view(torch.uint8), scale)
    # Replicas of one expert give identical rows for identical inputs.
    assert_bitwise_equal(y[:4].cpu(), y[4:].cpu())
    _assert_matches_rows(y, x, ids, packed, scale)


def test_all_local_rows_equal_the_plain_ids(op_device: str) -> None:
    """``ExpertRows(all_local=True)`` (every id held, no -1) gives the bits of the call on the bare ids."""
    packed, scale = _experts(4, 32, 64, seed=14, device=op_device)
    x = random_normal((10, 64), seed=15, dtype=torch.bfloat16, device=op_device)
    ids = torch.tensor([3, 0, 2, 3, 1, 0, 3, 2, 2, 1], device=op_device)
    y = dk.mxfp4_grouped_gemm(x, dk.ExpertRows(ids, all_local=True), packed, scale)
    assert torch.equal(y, dk.mxfp4_grouped_gemm(x, ids, packed, scale))


def test_empty_and_all_unassigned(op_device: str) -> None:
    packed, scale = _experts(2, 8, 32, seed=6, device=op_device)
    x = random_normal((3, 32), seed=7, dtype=torch.bfloat16, device=op_device)
    empty = dk.mxfp4_grouped_gemm(x[:0], torch.empty(0, dtype=torch.int64, device=op_device), packed, scale)
    assert empty.shape == (0, 8) and empty.dtype == torch.bfloat16
    none = dk.mxfp4_grouped_gemm(x, torch.full((3,), -1, device=op_device), packed, scale)
    assert torch.equal(none.cpu(), torch.zeros(3, 8, dtype=torch.bfloat16))


def test_validation() -> None:
    packed, scale = _experts(2, 8, 64, seed=8, device="cpu")
    x = random_normal((3, 64), seed=9, dtype=torch.bfloat16)
    ids = torch.tensor([0, 1, -1])
    with pytest.raises(ValueError, match=r"expert_ids\[1\] is 2; allowed: -1 \(no local expert\) or 0\.\.1"):
        dk.mxfp4_grouped_gemm(x, torch.tensor([0, 2, 0]), packed, scale)
    with pytest.raises(ValueError, match=r"expert_ids\[0\] is -2"):
        dk.mxfp4_grouped_gemm(x, torch.tensor([-2, 0, 0]), packed, scale)
    with pytest.raises(ValueError, match=r"expert_ids\[2\] is -1; allowed: 0\.\.1 \(every expert local\)"):
        dk.mxfp4_grouped_gemm(x, dk.ExpertRows(ids, all_local=True), packed, scale)
    with pytest.raises(TypeError, match=r"expert_ids has dtype torch\.int32"):
        dk.mxfp4_grouped_gemm(x, ids.int(), packed, scale)
    with pytest.raises(TypeError, match=r"x has dtype torch\.float16"):
        dk.mxfp4_grouped_gemm(x.half(), ids, packed, scale)
    with pytest.raises(ValueError, match="expert_ids must have shape"):
        dk.mxfp4_grouped_gemm(x, ids[:2], packed, scale)
    with pytest.raises(ValueError, match="x has 32 columns"):
        dk.mxfp4_grouped_gemm(x[:, :32], ids, packed, scale)
    with pytest.raises(ValueError, match="packed must be 3-D"):
        dk.mxfp4_grouped_gemm(x, ids, packed[0], scale)
    with pytest.raises(ValueError, match="scale must have shape"):
        dk.mxfp4_grouped_gemm(x, ids, packed, scale[:1])
    with pytest.raises(ValueError, match="multiple of 32"):
        dk.mxfp4_grouped_gemm(x[:, :48], ids, packed[:, :, :24], scale)
    with pytest.raises(ValueError, match="x must be 2-D"):
        dk.mxfp4_grouped_gemm(x[None], ids, packed, scale)


def test_dequantized_grouped_gemm_equals_the_reference_bitwise() -> None:
    experts, n, k = 4, 24, 96
    packed, scale = _experts(experts, n, k, seed=10, device="cpu")
    w_hat = torch.stack([dk.dequantize_mxfp4(packed[e], scale[e]) for e in range(experts)])
    x = random_normal((9, k), seed=11, dtype=torch.bfloat16)
    ids = torch.tensor([3, 0, -1, 3, 1, 0, 3, -1, 1])
    expected = dk.mxfp4_grouped_gemm(x, ids, packed, scale)
    assert_bitwise_equal(dk.dequantized_grouped_gemm(x, ids, w_hat), expected)
    assert_bitwise_equal(dk.dequantized_grouped_gemm(x, ids, w_hat.double()), expected)
    with pytest.raises(ValueError, match=r"expert_ids\[0\] is 4; allowed: -1 \(no local expert\) or 0\.\.3"):
        dk.dequantized_grouped_gemm(x, torch.full((9,), 4), w_hat)
    with pytest.raises(TypeError, match=r"w_hat has dtype torch\.bfloat16"):
        dk.dequantized_grouped_gemm(x, ids, w_hat.bfloat16())
    with pytest.raises(ValueError, match="w_hat must be 3-D"):
        dk.dequantized_grouped_gemm(x, ids, w_hat[0])
    with pytest.raises(ValueError, match="x has 64 columns"):
        dk.dequantized_grouped_gemm(x[:, :64], ids, w_hat)


@pytest.mark.parametrize("order", ["columns", "deinterleaved"])
def test_group_codes_values_are_the_quantized_values(order: dk.CodeOrder) -> None:
    x = random_normal((5, 96), seed=21, std=3.0)
    q, scale = dk.quantize_fp8_per_token_group(x)
    assert_bitwise_equal(group_codes(x, order).values(), dk.dequantize_fp8_per_token_group(q, scale))


@pytest.mark.parametrize("order", ["columns", "deinterleaved"])
@pytest.mark.parametrize(("tokens", "repeats"), [(1, 6), (13, 3), (40, 1)])
def test_codes_give_the_values_result(op_device: str, order: dk.CodeOrder, tokens: int, repeats: int) -> None:
    """The product of codes is the product of the values they were quantized from, bit for bit, in the order the
    backend reads (taken as they are) and in the other (multiplied as their values)."""
    packed, scale = _experts(6, 64, 128, seed=22, device=op_device)
    x = random_normal((tokens, 128), seed=23, std=2.0, device=op_device)
    ids = torch.randint(-1, 6, (tokens * repeats,), generator=torch.Generator().manual_seed(24)).to(op_device)
    expected = dk.mxfp4_grouped_gemm(x, ids, packed, scale, repeats)
    assert_bitwise_equal(dk.mxfp4_grouped_gemm(group_codes(x, order), ids, packed, scale, repeats), expected)


def test_code_order(op_device: str) -> None:
    """None on the reference (it quantizes the values it is given); on CUDA a decode's tiles read codes (the scaled
    preset's ``w2`` at 6 rows) and the sorted-copy tiles of an 8K prefill's 128 rows an expert the values."""
    packed = torch.zeros((16, 5120, 2304 // 2), dtype=torch.uint8, device=op_device)
    scale = torch.zeros((16, 5120, 2304 // 32), dtype=torch.float8_e8m0fnu, device=op_device)
    decode, prefill = dk.mxfp4_grouped_code_order(6, packed, scale), dk.mxfp4_grouped_code_order(2048, packed, scale)
    if op_device == "cpu":
        assert decode is None and prefill is None
    else:
        assert decode in ("columns", "deinterleaved") and prefill is None
    with pytest.raises(ValueError, match="rows must be a non-negative int"):
        dk.mxfp4_grouped_code_order(-1, packed, scale)
    with pytest.raises(ValueError, match="disagree"):
        dk.mxfp4_grouped_code_order(6, packed, scale[:, :, :8])


def test_codes_validation() -> None:
    packed, scale = _experts(2, 8, 64, seed=25, device="cpu")
    codes = group_codes(random_normal((3, 64), seed=26), "columns")
    ids = torch.tensor([0, 1, -1])
    with pytest.raises(TypeError, match=r"x\.q has dtype torch\.uint8"):
        dk.mxfp4_grouped_gemm(dk.GroupCodes(codes.q.view(torch.uint8), codes.scale), ids, packed, scale)
    with pytest.raises(ValueError, match=r"x\.scale must have shape \(3, 2\)"):
        dk.mxfp4_grouped_gemm(dk.GroupCodes(codes.q, codes.scale[:, :1]), ids, packed, scale)
    with pytest.raises(ValueError, match=r"x\.order must be"):
        dk.mxfp4_grouped_gemm(dk.GroupCodes(codes.q, codes.scale, "rows"), ids, packed, scale)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x has 64 columns"):
        dk.mxfp4_grouped_gemm(codes, ids, packed[:, :, :16], scale[:, :, :1])
