"""Triton quantized GEMMs (interpreter on CPU, or compiled on CUDA) vs the reference; tolerance in _gemm_support."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
from _gemm_support import abs_product, assert_gemm_close, dequantized_activation, group_codes

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import (
    assert_bitwise_equal,
    random_e4m3,
    random_mxfp4_packed,
    random_normal,
    random_ue8m0,
)

if TYPE_CHECKING:  # the cuda package imports Triton, which the ascend target's environment lacks
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig


def _activation(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal rows whose 32-column groups span 2^−10 … 2^10, so activation scales differ between groups."""
    spread = torch.logspace(-3, 3, k // 32).repeat_interleave(32).roll(seed)
    return (random_normal((m, k), seed=seed) * spread).to(dtype)


def _both(op: str, device: str, *inputs: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fast = out.clone().to(device)
    implementation(op, Backend.NVIDIA)(*(t.to(device) for t in inputs), fast)
    ref = out.clone()
    implementation(op, Backend.REFERENCE)(*inputs, ref)
    return fast.cpu(), ref


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 40, 96, torch.bfloat16), (20, 70, 256, torch.float32)])
def test_fp8_block_gemm_triton(triton_device: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = _activation(m, k, seed=m, dtype=dtype)
    # Scale bytes 100…140 (2^−27 … 2^13) with every e4m3 code: the in-kernel bf16 dequantization must stay exact.
    w_q = random_e4m3((n, k), seed=n)
    w_scale = random_ue8m0((-(-n // 32), k // 32), seed=k)
    fast, ref = _both("fp8_block_gemm", triton_device, x, w_q, w_scale, out=torch.empty(m, n, dtype=torch.bfloat16))
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32).double()
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), w_hat), k)


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 40, 96, torch.float32), (20, 70, 256, torch.bfloat16)])
def test_mxfp4_gemm_triton(triton_device: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = _activation(m, k, seed=m + 1, dtype=dtype)
    packed = random_mxfp4_packed((n, k // 2), seed=n + 1)
    scale = random_ue8m0((n, k // 32), seed=k + 1)
    fast, ref = _both("mxfp4_gemm", triton_device, x, packed, scale, out=torch.empty(m, n, dtype=torch.bfloat16))
    w_hat = dk.dequantize_mxfp4(packed, scale).double()
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), w_hat), k)


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "out_dtype"),
    [
        (1, 40, 96, torch.bfloat16, torch.float32),
        (2, 70, 520, torch.bfloat16, torch.bfloat16),
        (1, 33, 256, torch.float32, torch.float32),
        (5, 70, 256, torch.bfloat16, torch.bfloat16),
        (1, 4097, 2048, torch.bfloat16, torch.float32),
        (2, 4097, 2048, torch.bfloat16, torch.bfloat16),
    ],
)
def test_bf16_gemm_triton(
    triton_device: str, m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    """The BF16-weight product (the GEMV at one row, at two up to a 16 MiB weight, else cuBLAS) against the FP64
    product: within FP32 sums' bound of it (one more product rounding for an FP32 x), and the reference likewise."""
    x = random_normal((m, k), seed=m + 2).to(dtype)
    weight = (random_normal((n, k), seed=n + 2) * torch.logspace(-3, 3, k).roll(m)).to(torch.bfloat16)
    fast, ref = _both("bf16_gemm", triton_device, x, weight, out=torch.empty(m, n, dtype=out_dtype))
    exact = x.double() @ weight.double().t()
    bits = 8 if out_dtype == torch.bfloat16 else 24
    terms = k if dtype == torch.bfloat16 else k + 1
    for got in (fast, ref):
        assert_gemm_close(got, exact.to(out_dtype), abs_product(x, weight), terms, significant_bits=bits)


def test_bf16_gemv_tiles_and_rows_give_the_same_bits(triton_device: str) -> None:
    """The GEMV's K chunks are added in chunk order whether they run as split-K programs or in one program, and a row's
    sums do not depend on the other row of a two-row call."""
    from deepinfer_kernels.cuda.gemm_tiles import gemv_tile

    x = random_normal((2, 1040), seed=40).to(torch.bfloat16).to(triton_device)
    weight = random_normal((72, 1040), seed=41).to(torch.bfloat16).to(triton_device)
    gemm = implementation("bf16_gemm", Backend.NVIDIA)
    outs = []
    for rows, cfg in ((2, gemv_tile(32, 4, 3)), (2, gemv_tile(16, 4, 3, split_grid=False)), (1, gemv_tile(32, 4, 2))):
        out = torch.empty(rows, 72, dtype=torch.float32, device=triton_device)
        gemm(x[:rows], weight, out, config=cfg)
        outs.append(out)
    assert_bitwise_equal(outs[0], outs[1])
    assert_bitwise_equal(outs[0][:1], outs[2])


def test_bf16_gemm_inside_the_invariant_mode_takes_the_modes_product(triton_device: str) -> None:
    """Inside ``batch_invariant_ops`` one row runs the mode's product, not the GEMV (whose sums are in another order):
    ``invariant_matmul`` on CUDA, an FP64 product rounded once on CPU tensors."""
    from deepinfer_kernels.batch_invariant import batch_invariant_ops
    from deepinfer_kernels.invariant_products import invariant_matmul

    x = random_normal((1, 1040), seed=42).to(torch.bfloat16).to(triton_device)
    weight = random_normal((72, 1040), seed=43).to(torch.bfloat16).to(triton_device)
    out = torch.empty(1, 72, dtype=torch.float32, device=triton_device)
    with batch_invariant_ops():
        implementation("bf16_gemm", Backend.NVIDIA)(x, weight, out)
        expected = (
            invariant_matmul(x, weight.t(), torch.float32)
            if triton_device == "cuda"
            else (x.double() @ weight.double().t()).float()
        )
    assert_bitwise_equal(out, expected)


def _check_grouped(triton_device: str, n: int, k: int, seed: int, config: BlockConfig | None = None) -> None:
    """The grouped GEMM over 6 experts against the reference: expert 5 replicates expert 1 (a row through it gets the
    same values), expert 3 has no rows, -1 rows have no expert (left at zero), expert 0 has more rows than a 16-row
    tile."""
    experts = 6
    packed = random_mxfp4_packed((experts, n, k // 2), seed=seed)
    scale = random_ue8m0((experts, n, k // 32), seed=seed + 1)
    packed[5], scale[5] = packed[1], scale[1]
    ids = torch.tensor([0, 5, -1, 1, 0, 2, 0, 4, 0, 0, 1, 0, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0])
    x = _activation(ids.numel(), k, seed=seed + 2, dtype=torch.bfloat16)
    x[23] = x[3]
    inputs = (x, ids, packed, scale)
    # NaN first: the GEMM writes every row, zeros for the rows of no expert.
    fast = torch.full((ids.numel(), n), float("nan"), dtype=torch.bfloat16, device=triton_device)
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(*(t.to(triton_device) for t in inputs), fast, config=config)
    fast = fast.cpu()
    ref = torch.zeros_like(fast)
    implementation("mxfp4_grouped_gemm", Backend.REFERENCE)(*inputs, ref)
    x_hat = dequantized_activation(x)
    magnitude = torch.zeros(ids.numel(), n, dtype=torch.float64)
    for m, expert in enumerate(ids.tolist()):
        if expert >= 0:
            magnitude[m] = abs_product(x_hat[m : m + 1], dk.dequantize_mxfp4(packed[expert], scale[expert]))[0]
    assert_gemm_close(fast, ref, magnitude, k)
    assert torch.equal(fast[ids < 0], torch.zeros(2, n, dtype=torch.bfloat16))
    assert torch.equal(fast[23], fast[3])


def test_mxfp4_grouped_gemm_triton(triton_device: str) -> None:
    _check_grouped(triton_device, 40, 128, seed=2)


@pytest.mark.parametrize("block_k", [64, 128])
@pytest.mark.parametrize(("n", "k"), [(96, 160), (128, 256)])
def test_grouped_bf16_tiles_meet_the_reference_bound(triton_device: str, n: int, k: int, block_k: int) -> None:
    """``swap_bf16``: the rows of each tile read from the BF16 copy in expert order (every column permuted as the
    weight operand's decoding orders it), with partial N and K steps (96 × 160) and without (128 × 256: no masks but
    the rows'), an expert over two tiles."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    cfg = BlockConfig(16, 64, num_warps=4, num_stages=2, split_grid=False, block_k=block_k, decoding="swap_bf16")
    _check_grouped(triton_device, n, k, seed=12, config=cfg)


@pytest.mark.parametrize(
    ("tokens", "decoding", "block_m", "gemv"),
    [
        (5, "scaled_bf16", 16, False),
        (20, "scaled_bf16", 16, False),
        (20, "swap_fp8", 16, False),
        (20, "swap_bf16", 16, False),
        (20, "gluon_bf16", 32, False),
        (5, "gluon_fp8", 16, False),
        (20, "gluon_fp8", 16, False),
        (2, "scaled_bf16", 2, True),
    ],
)
def test_repeated_rows_read_the_tokens(
    triton_device: str, tokens: int, decoding: str, block_m: int, gemv: bool
) -> None:
    """``repeats`` (a token's top-k rows read the token): bit for bit the call on the token rows copied, with every row
    in one tile (5 tokens × 3: no tables) and over tables (20 × 3), each kernel reading row ``r // 3`` of the codes
    (the MMA tiles, the Gluon tile where it runs — ``swap_fp8`` elsewhere —, the FMA GEMV), and on ``swap_bf16``'s copy
    gathered from the tokens (which the BF16 Gluon tile reads, ``swap_bf16`` where it cannot run); and the same bits
    from the tokens' ``GroupCodes`` in the order the tiles read."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig
    from deepinfer_kernels.cuda.grouped_gemm import tile_code_order

    n, k, experts = 64, 256, 4
    packed = random_mxfp4_packed((experts, n, k // 2), seed=30)
    scale = random_ue8m0((experts, n, k // 32), seed=31)
    x = _activation(tokens, k, seed=32, dtype=torch.bfloat16)
    ids = torch.randint(-1, experts, (3 * tokens,), generator=torch.Generator().manual_seed(33))
    gluon = decoding in ("gluon_fp8", "gluon_bf16")
    cfg = BlockConfig(
        block_m, 64, num_warps=4, num_stages=3 if gluon else 2, split_grid=gemv, gemv=gemv,
        block_k=128 if gluon else 64, decoding=decoding,
    )  # fmt: skip
    gemm = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    inputs = [t.to(triton_device) for t in (ids, packed, scale)]
    repeated = torch.zeros(3 * tokens, n, dtype=torch.bfloat16, device=triton_device)
    gemm(x.to(triton_device), *inputs, repeated, config=cfg, repeats=3)
    copied = torch.zeros_like(repeated)
    gemm(x.repeat_interleave(3, dim=0).to(triton_device), *inputs, copied, config=cfg)
    assert torch.equal(repeated, copied) and bool((repeated != 0).any())
    # Codes in the order the tiles read are taken as they are: the same bits (the other order is multiplied as its
    # values, test_grouped_gemm.py).
    order = tile_code_order(cfg)
    if order is not None:
        codes = torch.zeros_like(repeated)
        gemm(group_codes(x.to(triton_device), order), *inputs, codes, config=cfg, repeats=3)
        assert torch.equal(codes, repeated), order


@pytest.mark.parametrize("rows", [3, 70])
def test_quantized_values_are_the_dequantized_codes(triton_device: str, rows: int) -> None:
    """The ``dequant_bf16`` GEMMs' operand from one quantize-and-dequantize launch equals the quantizer's codes
    dequantized, bit for bit, for one-group and eight-group programs (3, 70 rows of 10 groups)."""
    from deepinfer_kernels.cuda import quant

    x = _activation(rows, 320, seed=21, dtype=torch.bfloat16) * torch.logspace(-5, 5, rows)[:, None].bfloat16()
    expected = dk.dequantize_fp8_per_token_group(*dk.quantize_fp8_per_token_group(x), out_dtype=torch.bfloat16)
    actual = torch.empty(rows, 320, dtype=torch.bfloat16, device=triton_device)
    quant.quantized_values(x.to(triton_device), actual)
    assert torch.equal(actual.cpu().view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_values_round_every_e4m3_value_and_tie_as_the_codes(triton_device: str, dtype: torch.dtype) -> None:
    """``quantized_values`` rounds the scaled values in place (``_formats.fp8_group_values``) instead of encoding and
    decoding: every finite e4m3 value (subnormals, ±0, 448), the midpoint above each (ties to even), values just below
    448 and above it (464 takes the next scale) and random values, at three group scales, give the dequantized codes'
    bits."""
    from deepinfer_kernels.cuda import quant

    codes = torch.arange(256, dtype=torch.uint8)
    values = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float()
    ordered = values.abs().unique()
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    above = torch.cat([midpoints, torch.tensor([464.0, 447.9, 2.0**-10, 3 * 2.0**-10])])
    special = torch.cat([values, above, -above, torch.tensor([-0.0, 0.0])])
    special = torch.cat([special, random_normal((256 - special.numel() % 256,), seed=5, std=100.0)])
    # Rows of 256 (8 groups); each group's amax is its largest value, so the scale varies with the row's factor.
    rows = special.reshape(-1, 256)
    x = torch.cat([rows, rows * 2.0**-20, rows * 3.0e5]).to(dtype)
    expected = dk.dequantize_fp8_per_token_group(*dk.quantize_fp8_per_token_group(x), out_dtype=dtype)
    actual = torch.empty_like(x, device=triton_device)
    quant.quantized_values(x.to(triton_device), actual)
    assert_bitwise_equal(actual.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sorted_bf16_activation_is_the_dequantized_activation_reordered(triton_device: str, dtype: torch.dtype) -> None:
    """``swap_bf16``'s copy, quantized and dequantized in one launch, holds exactly the quantizer's x̂ (bit for bit)
    with its rows in the tables' order and each group's columns in ``word_pair_columns`` order; 37 rows (a partial
    row tile) of 10 groups (a partial group tile), rows of very different magnitudes."""
    from deepinfer_kernels.cuda.swap_bf16 import sorted_bf16_activation

    rows, k = 37, 320
    x = _activation(rows, k, seed=19, dtype=dtype) * torch.logspace(-6, 6, rows)[:, None].to(dtype)
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(20))
    x_hat = dk.dequantize_fp8_per_token_group(*dk.quantize_fp8_per_token_group(x), out_dtype=torch.bfloat16)
    j = torch.arange(32)
    o = j // 8
    columns = 8 * ((j % 8) // 2) + 4 * (o % 2) + o // 2 + 2 * (j % 2)  # word_pair_columns within a group
    expected = x_hat[order].view(rows, k // 32, 32)[:, :, columns].reshape(rows, k)
    actual = sorted_bf16_activation(x.to(triton_device), order.to(triton_device)).cpu()
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("rows", [3, 70])
def test_deinterleaved_codes_are_the_column_order_codes_reordered(triton_device: str, rows: int) -> None:
    """The quantizer stores the MXFP4 kernels' de-interleaved order itself (each group's even columns, then its odd
    ones): the same bytes as the column-order codes reordered, for one-group and eight-group programs (3, 70 rows)."""
    from deepinfer_kernels.cuda.gemm import deinterleaved_activation, quantized_activation

    x = _activation(rows, 320, seed=15, dtype=torch.bfloat16).to(triton_device)
    (q, scale), (q_de, scale_de) = quantized_activation(x), deinterleaved_activation(x)
    assert torch.equal(scale_de, scale)
    assert torch.equal(q_de, q.view(rows, 10, 16, 2).transpose(2, 3).reshape(rows, 320))


def test_grouped_triton_ids_outside_range_give_zero_rows(triton_device: str) -> None:
    packed = random_mxfp4_packed((2, 32, 32), seed=5).to(triton_device)
    scale = random_ue8m0((2, 32, 2), seed=6).to(triton_device)
    x = random_normal((4, 64), seed=7, dtype=torch.bfloat16, device=triton_device)
    out = torch.full((4, 32), float("nan"), dtype=torch.bfloat16, device=triton_device)
    ids = torch.tensor([2, 0, -5, 1], device=triton_device)
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed, scale, out)
    assert torch.all(out[[0, 2]] == 0)
    assert torch.all(out[[1, 3]] != 0) and not out.isnan().any()
    out.fill_(float("nan"))
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed[:0], scale[:0], out)  # no local experts
    assert torch.all(out == 0)


@pytest.mark.parametrize(("rows", "block_m", "gemv"), [(6, 16, False), (40, 16, False), (6, 2, True)])
def test_grouped_all_local_writes_every_row_without_the_zero_launch(
    triton_device: str, rows: int, block_m: int, gemv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``all_local`` (every id held) leaves out the zero-row launch: each row is still written, by its tile, bit for
    bit as without it, over an output that starts as NaN. Rows in one tile (the scan), tile tables, FMA GEMV."""
    from deepinfer_kernels.cuda import grouped_gemm
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    experts, n, k = 5, 48, 128
    packed = random_mxfp4_packed((experts, n, k // 2), seed=60).to(triton_device)
    scale = random_ue8m0((experts, n, k // 32), seed=61).to(triton_device)
    ids = torch.randint(0, experts, (rows,), generator=torch.Generator().manual_seed(62)).to(triton_device)
    x = _activation(rows, k, seed=63, dtype=torch.bfloat16).to(triton_device)
    cfg = BlockConfig(block_m, 32, num_warps=4, num_stages=2, split_grid=gemv, gemv=gemv)
    gemm = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    default = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=triton_device)
    gemm(x, ids, packed, scale, default, config=cfg)
    local = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=triton_device)
    with monkeypatch.context() as patched:
        patched.setattr(grouped_gemm, "_zero_unrouted_rows", lambda *_: pytest.fail("the zero-row launch ran"))
        gemm(x, ids, packed, scale, local, config=cfg, all_local=True)
    assert not local.isnan().any()
    assert torch.equal(local, default)


@pytest.mark.parametrize("decoding", ["scaled_bf16", "group_fp16"])
@pytest.mark.parametrize("split_grid", [False, True])
def test_grouped_rows_in_one_tile_skip_the_tables(triton_device: str, decoding: str, split_grid: bool) -> None:
    """At most one tile of rows: programs find their expert's rows by scanning the ids (no tile tables). Each row
    equals the same row computed through the tables inside a larger call with the same tiles, bit for bit; rows of
    no expert (-1, out of range) stay zero; an expert's rows need not be adjacent or start at row 0."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    experts, n, k = 4, 64, 512
    packed = random_mxfp4_packed((experts, n, k // 2), seed=50).to(triton_device)
    scale = random_ue8m0((experts, n, k // 32), seed=51).to(triton_device)
    ids = torch.tensor([-1, 2, 0, 2, 7, 3, 2, 0, -1, 3, 2], device=triton_device)
    more = torch.randint(-1, experts, (30,), generator=torch.Generator().manual_seed(52)).to(triton_device)
    x = _activation(ids.numel() + more.numel(), k, seed=53, dtype=torch.bfloat16).to(triton_device)
    cfg = BlockConfig(16, 32, num_warps=4, num_stages=2, split_grid=split_grid, decoding=decoding)
    gemm = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    small = torch.zeros(ids.numel(), n, dtype=torch.bfloat16, device=triton_device)
    gemm(x[: ids.numel()], ids, packed, scale, small, config=cfg)
    large = torch.zeros(x.shape[0], n, dtype=torch.bfloat16, device=triton_device)
    gemm(x, torch.cat([ids, more]), packed, scale, large, config=cfg)
    assert torch.equal(small, large[: ids.numel()])
    served = (ids >= 0) & (ids < experts)
    assert torch.all(small[~served] == 0) and torch.all((small[served] != 0).any(dim=1))
    ref = torch.zeros(ids.numel(), n, dtype=torch.bfloat16)
    local = torch.where(served, ids, -1).cpu()  # the reference accepts only -1 for rows of no local expert
    implementation("mxfp4_grouped_gemm", Backend.REFERENCE)(
        x[: ids.numel()].cpu(), local, packed.cpu(), scale.cpu(), ref
    )
    x_hat = dequantized_activation(x[: ids.numel()].cpu())
    bound = torch.zeros(ids.numel(), n, dtype=torch.float64)
    for m, expert in enumerate(ids.tolist()):
        if 0 <= expert < experts:
            bound[m] = abs_product(x_hat[m : m + 1], dk.dequantize_mxfp4(packed[expert].cpu(), scale[expert].cpu()))[0]
    assert_gemm_close(small.cpu(), ref, bound, k)


def _served_rows(
    ids: torch.Tensor, order: torch.Tensor, tiles: tuple[torch.Tensor, ...], experts: int, rows: int
) -> list[int]:
    """The rows the tiles (tile_expert, tile_start, tile_end) serve, checking that each working tile has 1 … ``rows``
    positions, all of its expert."""
    served = []
    for expert_id, start, end in zip(*(t.tolist() for t in tiles), strict=True):
        if expert_id == experts:
            continue
        assert 0 < end - start <= rows
        assert all(int(ids[order[p]]) == expert_id for p in range(start, end))
        served.extend(int(order[p]) for p in range(start, end))
    return served


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize(
    ("m", "experts", "block_m"),
    [(1, 256, 16), (50, 4, 16), (37, 8, 4), (9, 3, 64), (150, 384, 16), (130, 5, 16), (700, 256, 16), (1536, 384, 16)],
)
def test_expert_tiles_cover_each_routed_row_once(
    triton_device: str, m: int, experts: int, block_m: int, one_launch: bool
) -> None:
    from deepinfer_kernels.cuda.grouped_gemm import expert_tiles
    from deepinfer_kernels.cuda.grouped_tiles import expert_tiles_one_launch

    ids = torch.randint(-1, experts, (m,), generator=torch.Generator().manual_seed(m))
    tables = expert_tiles_one_launch if one_launch else expert_tiles
    order, tile_expert, start, end = (t.cpu() for t in tables(ids.to(triton_device), experts, block_m))
    assert tile_expert.numel() == -(-m // block_m) + min(experts, m)
    bucket = torch.where(ids < 0, experts, ids)[order]
    assert torch.equal(torch.sort(order).values, torch.arange(m))
    # Stable: sorted by expert, original order within an expert.
    assert torch.all((bucket[1:] > bucket[:-1]) | ((bucket[1:] == bucket[:-1]) & (order[1:] > order[:-1])))
    served = _served_rows(ids, order, (tile_expert, start, end), experts, block_m)
    assert sorted(served) == [r for r in range(m) if int(ids[r]) >= 0]
    if one_launch:
        # The same tables as the PyTorch ops wherever a tile has rows.
        torch_tables = expert_tiles(ids, experts, block_m)
        assert torch.equal(order, torch_tables[0])
        real = tile_expert < experts
        for mine, theirs in zip((tile_expert, start, end), torch_tables[1:], strict=True):
            assert torch.equal(mine[real], theirs[real])


@pytest.mark.parametrize(
    ("m", "experts", "block_m", "tail_m"), [(50, 4, 32, 16), (300, 6, 32, 16), (700, 5, 128, 32), (9, 3, 64, 16)]
)
def test_tail_tiles_take_the_rows_past_whole_tiles(
    triton_device: str, m: int, experts: int, block_m: int, tail_m: int
) -> None:
    """With ``tail_m`` the whole tiles and the tail tiles together serve each routed row once, over the same order; an
    expert's rows past its whole tiles are one tail tile when 1 … ``tail_m``, else one more (partial) whole tile."""
    from deepinfer_kernels.cuda.grouped_gemm import expert_tiles, tail_tiles

    ids = torch.randint(-1, experts, (m,), generator=torch.Generator().manual_seed(m + block_m))
    order, tile_expert, start, end = (t.cpu() for t in expert_tiles(ids.to(triton_device), experts, block_m, tail_m))
    assert torch.equal(order, expert_tiles(ids, experts, block_m)[0])
    tail_expert, tail_start, tail_end = (t.cpu() for t in tail_tiles(ids.to(triton_device), experts, block_m, tail_m))
    assert tail_expert.numel() == experts
    served = _served_rows(ids, order, (tile_expert, start, end), experts, block_m)
    served += _served_rows(ids, order, (tail_expert, tail_start, tail_end), experts, tail_m)
    assert sorted(served) == [r for r in range(m) if int(ids[r]) >= 0]
    for expert in range(experts):
        rest = int((ids == expert).sum()) % block_m
        assert (int(tail_expert[expert]) == expert) == (0 < rest <= tail_m)


@pytest.mark.parametrize("tail_m", [0, 16])
def test_grouped_bf16_tail_tiles_meet_the_reference_bound(triton_device: str, tail_m: int) -> None:
    """``swap_bf16`` with and without tail tiles (32-row tiles): an expert of 37 rows (a whole tile and a tail), of 40
    (whole and tail), of 20 (one partial whole tile), of 3 (only a tail), rows of no expert; against the reference."""
    from deepinfer_kernels.cuda.gemm_tiles import swap_bf16_tile

    experts, n, k = 5, 64, 256
    ids = torch.cat([torch.full((count,), e) for e, count in enumerate((37, 40, 20, 3))] + [torch.tensor([-1, -1])])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(60))]
    packed = random_mxfp4_packed((experts, n, k // 2), seed=61)
    scale = random_ue8m0((experts, n, k // 32), seed=62)
    x = _activation(ids.numel(), k, seed=63, dtype=torch.bfloat16)
    fast = torch.full((ids.numel(), n), float("nan"), dtype=torch.bfloat16, device=triton_device)
    cfg = swap_bf16_tile(32, 64, 4, tail_m=tail_m)
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(
        *(t.to(triton_device) for t in (x, ids, packed, scale)), fast, config=cfg
    )
    ref = torch.zeros(ids.numel(), n, dtype=torch.bfloat16)
    implementation("mxfp4_grouped_gemm", Backend.REFERENCE)(x, ids, packed, scale, ref)
    x_hat = dequantized_activation(x)
    bound = torch.zeros(ids.numel(), n, dtype=torch.float64)
    for row, expert in enumerate(ids.tolist()):
        if expert >= 0:
            bound[row] = abs_product(x_hat[row : row + 1], dk.dequantize_mxfp4(packed[expert], scale[expert]))[0]
    assert_gemm_close(fast.cpu(), ref, bound, k)
    assert torch.equal(fast.cpu()[ids < 0], torch.zeros(2, n, dtype=torch.bfloat16))


def test_tail_m_is_checked(triton_device: str) -> None:
    """tail_m: 16, 32 or 64 rows, below block_m, on swap_bf16 tiles only."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, swap_bf16_tile

    for bad in (8, 48, 128):
        with pytest.raises(ValueError, match="tail_m"):
            swap_bf16_tile(128, 128, 8, tail_m=bad)
    with pytest.raises(ValueError, match="tail_m"):
        BlockConfig(32, 64, 4, 2, split_grid=False, decoding="swap_fp8", tail_m=16)


@pytest.mark.parametrize(("scale_byte", "x_exponent"), [(10, 100), (127, 0), (240, -10)])
def test_weight_scale_range_edges(triton_device: str, scale_byte: int, x_exponent: int) -> None:
    """In-kernel bf16 dequantization is exact for weight scale bytes across the documented range [10, 240] (the
    activation is sized so the products stay finite and normal)."""
    m, n, k = 2, 32, 64
    x = (random_normal((m, k), seed=scale_byte) * 2.0**x_exponent).to(torch.bfloat16)
    x_hat = dequantized_activation(x)
    scale_bytes = torch.full((n, k // 32), scale_byte, dtype=torch.uint8)
    w_q = random_e4m3((n, k), seed=8)
    w_scale = scale_bytes[:1].view(torch.float8_e8m0fnu)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    fast, ref = _both("fp8_block_gemm", triton_device, x, w_q, w_scale, out=out)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert torch.isfinite(ref.float()).all() and (ref != 0).any()
    assert_gemm_close(fast, ref, abs_product(x_hat, w_hat), k)
    packed = random_mxfp4_packed((n, k // 2), seed=9)
    scale = scale_bytes.view(torch.float8_e8m0fnu)
    fast, ref = _both("mxfp4_gemm", triton_device, x, packed, scale, out=out)
    assert torch.isfinite(ref.float()).all() and (ref != 0).any()
    assert_gemm_close(fast, ref, abs_product(x_hat, dk.dequantize_mxfp4(packed, scale)), k)


def test_nan_weight_code_gives_nan_column(triton_device: str) -> None:
    x = random_normal((3, 64), seed=10, dtype=torch.bfloat16)
    w_q = random_e4m3((40, 64), seed=11)
    w_q.view(torch.uint8)[5, 7] = 0x7F
    w_scale = random_ue8m0((2, 2), seed=12, low=120, high=127)
    fast, ref = _both("fp8_block_gemm", triton_device, x, w_q, w_scale, out=torch.empty(3, 40, dtype=torch.bfloat16))
    assert torch.isnan(ref[:, 5]).all() and torch.isnan(fast[:, 5]).all()
    assert not torch.isnan(fast[:, :5]).any() and not torch.isnan(fast[:, 6:]).any()


@pytest.mark.parametrize(("k", "chunks"), [(1024, 4), (2560, 10)])
@pytest.mark.parametrize("gemv", [False, True])
@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm", "mxfp4_grouped_gemm"])
def test_split_k_matches_one_program_bitwise(triton_device: str, op: str, gemv: bool, k: int, chunks: int) -> None:
    """K = 1024 runs in 4 chunks, 2560 in 10 (cuda.gemm_tiles.k_chunk; the last program loads the chunk sums 8 at a
    time): chunks as programs of their own, summed by each tile's last program, give the same bits as one program
    summing the chunks in order, twice in a row (the tickets are back to zero after a launch), and both meet the
    reference's tolerance (MMA and FMA kernels)."""
    from deepinfer_kernels.cuda.gemm_operands import split_counters
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, k_chunk

    m, n = 3, 64
    assert k // k_chunk(n, k) == chunks
    x = _activation(m, k, seed=13, dtype=torch.bfloat16)
    if op == "fp8_block_gemm":
        weights: tuple[torch.Tensor, ...] = (random_e4m3((n, k), seed=14), random_ue8m0((n // 32, k // 32), seed=15))
        w_hat = dk.dequantize_fp8_block(*weights, out_dtype=torch.float32)
        inputs: tuple[torch.Tensor, ...] = (x, *weights)
    else:
        weights = (random_mxfp4_packed((n, k // 2), seed=16), random_ue8m0((n, k // 32), seed=17))
        w_hat = dk.dequantize_mxfp4(*weights)
        inputs = (x, *weights)
        if op == "mxfp4_grouped_gemm":
            # Two experts (the second a copy of the first), one row without an expert.
            inputs = (x, torch.tensor([1, -1, 0]), *(torch.stack([w, w]) for w in weights))
    results = []
    for split_grid in (True, True, False):
        cfg = BlockConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, split_grid=split_grid, gemv=gemv)
        out = torch.zeros(m, n, dtype=torch.bfloat16, device=triton_device)
        implementation(op, Backend.NVIDIA)(*(t.to(triton_device) for t in inputs), out, config=cfg)
        results.append(out.cpu())
        assert not split_counters(out.device, 0).any()
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    ref = torch.zeros(m, n, dtype=torch.bfloat16)
    implementation(op, Backend.REFERENCE)(*inputs, ref)
    assert_gemm_close(results[0], ref, abs_product(dequantized_activation(x), w_hat.double()), k)
    if op == "mxfp4_grouped_gemm":
        assert torch.all(results[0][1] == 0)


@pytest.mark.parametrize("split_grid", [False, True])
@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm", "mxfp4_grouped_gemm"])
def test_every_decoding_meets_the_reference_bound(triton_device: str, op: str, split_grid: bool) -> None:
    """MMA tiles with each operand decoding meet the reference's bound (only the FP32 summation order may differ, and
    on a GPU the FP8 tensor cores' per-group sums); K = 1024 in 4 chunks, 37 rows over three row tiles, rows without
    an expert left at zero."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, decodings

    m, n, k = 37, 96, 1024
    x = _activation(m, k, seed=23, dtype=torch.bfloat16)
    ids = torch.randint(-1, 2, (m,), generator=torch.Generator().manual_seed(28))
    if op == "fp8_block_gemm":
        weights = (random_e4m3((n, k), seed=24), random_ue8m0((n // 32, k // 32), seed=25))
        w_hats = [dk.dequantize_fp8_block(*weights, out_dtype=torch.float32)]
        inputs: tuple[torch.Tensor, ...] = (x, *weights)
    else:
        weights = (random_mxfp4_packed((n, k // 2), seed=24), random_ue8m0((n, k // 32), seed=25))
        second = (random_mxfp4_packed((n, k // 2), seed=26), random_ue8m0((n, k // 32), seed=27))
        w_hats = [dk.dequantize_mxfp4(*weights), dk.dequantize_mxfp4(*second)]
        inputs = (x, *weights)
        if op == "mxfp4_grouped_gemm":
            inputs = (x, ids, *(torch.stack(pair) for pair in zip(weights, second, strict=True)))
    results = []
    # swap_fp8's tile is at least its wgmma's 64 weight rows wide.
    configs = [
        BlockConfig(16, 64 if d == "swap_fp8" else 32, num_warps=4, num_stages=2, split_grid=split_grid, decoding=d)
        for d in decodings(op)
        if d not in ("gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16")
    ]
    if "swap_ab" in decodings(op):  # its K step of two groups too
        configs.append(BlockConfig(16, 64, 4, 2, split_grid=split_grid, block_k=64, decoding="swap_ab"))
    if "gluon_fp8" in decodings(op):  # 16 rows a warp (swap_fp8 where Gluon cannot run; grouped: K in one program)
        configs.append(BlockConfig(16, 64, 4, 3, split_grid=split_grid, decoding="gluon_fp8"))
    # The decodings that never split run once, in the unsplit case.
    if "dequant_bf16" in decodings(op) and not split_grid:  # no tile: one GEMM on the dequantized operands
        configs.append(BlockConfig(16, 32, 4, 1, split_grid=False, decoding="dequant_bf16"))
    if "swap_bf16" in decodings(op) and not split_grid:  # weight-first like swap_fp8, K in one program
        configs.append(BlockConfig(16, 64, 4, 2, split_grid=False, block_k=64, decoding="swap_bf16"))
    if "gluon_bf16" in decodings(op) and not split_grid:  # 16 rows a warp (swap_bf16 where Gluon cannot run)
        configs.append(BlockConfig(32, 64, 4, 3, split_grid=False, decoding="gluon_bf16"))
    for cfg in configs:
        out = torch.zeros(m, n, dtype=torch.bfloat16, device=triton_device)
        implementation(op, Backend.NVIDIA)(*(t.to(triton_device) for t in inputs), out, config=cfg)
        results.append(out.cpu())
    ref = torch.zeros(m, n, dtype=torch.bfloat16)
    implementation(op, Backend.REFERENCE)(*inputs, ref)
    x_hat = dequantized_activation(x)
    bound = abs_product(x_hat, w_hats[0].double())
    if op == "mxfp4_grouped_gemm":
        bound = torch.where((ids == 1)[:, None], abs_product(x_hat, w_hats[1].double()), bound)
        assert all(torch.all(result[ids == -1] == 0) for result in results)
    for cfg, result in zip(configs, results, strict=True):
        # The FP8 tensor cores sum each 32-column group with 13 mantissa bits (_gemm_support); exact in the interpreter.
        fp8_mma = cfg.decoding in ("group_fp8", "swap_fp8", "gluon_fp8")
        assert_gemm_close(result, ref, bound, k, group_accumulation=2.0**-8 if fp8_mma else 0.0, what=cfg.decoding)


@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm"])
def test_gemv_row_bits_do_not_depend_on_the_row_count(triton_device: str, op: str) -> None:
    """The FMA kernels sum every row in the same order whatever the rows per program: row r of a 5-row call (8 rows
    per program) equals the 1-row call on that row, bit for bit (the tile table uses them for 1-2 rows; forced here)."""
    m, n, k = 5, 64, 512
    x = _activation(m, k, seed=18, dtype=torch.bfloat16)
    if op == "fp8_block_gemm":
        weights = (random_e4m3((n, k), seed=19), random_ue8m0((n // 32, k // 32), seed=20))
    else:
        weights = (random_mxfp4_packed((n, k // 2), seed=21), random_ue8m0((n, k // 32), seed=22))
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    cfg = BlockConfig(block_m=16, block_n=32, num_warps=4, num_stages=3, split_grid=True, gemv=True)
    impl = implementation(op, Backend.NVIDIA)
    device_weights = tuple(w.to(triton_device) for w in weights)
    together = torch.empty(m, n, dtype=torch.bfloat16, device=triton_device)
    impl(x.to(triton_device), *device_weights, together, config=cfg)
    for r in (0, 3):
        alone = torch.empty(1, n, dtype=torch.bfloat16, device=triton_device)
        impl(x[r : r + 1].to(triton_device), *device_weights, alone, config=cfg)
        assert torch.equal(alone[0].cpu(), together[r].cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups", [1, 2])
def test_quantizing_gemv_equals_the_gemv_on_the_quantizers_codes(
    triton_device: str, dtype: torch.dtype, groups: int
) -> None:
    """The FMA GEMV on an unquantized activation quantizes it as it reads it: the bits of the GEMV on the quantizer's
    codes (``fp8_block_gemm_quantized``), for 1 and 2 rows, dense and grouped (``fp8_block_grouped_gemm``, FP32 out),
    split and whole, with a zero group, a group reaching the e4m3 maximum and a K tail past the last full step."""
    from deepinfer_kernels.cuda.gemm import fp8_block_launch
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    n, k = 64, 352
    weights = (random_e4m3((n, k), seed=40), random_ue8m0((n // 32, k // 32), seed=41))
    device_weights = tuple(w.to(triton_device) for w in weights)
    for m in (1, 2):
        x = _activation(m, groups * k, seed=42 + m, dtype=dtype)
        x[:, 32:64] = 0.0
        x[0, 64:96] = torch.linspace(-448.0, 448.0, 32)
        q, q_scale = dk.quantize_fp8_per_token_group(x.to(triton_device))
        for split_grid in (True, False):
            cfg = BlockConfig(block_m=2, block_n=32, num_warps=4, num_stages=3, split_grid=split_grid, gemv=True)
            out_dtype = torch.bfloat16 if groups == 1 else torch.float32
            fused = torch.full((m, n), float("nan"), dtype=out_dtype, device=triton_device)
            codes = fused.clone()
            if groups == 1:
                implementation("fp8_block_gemm", Backend.NVIDIA)(
                    x.to(triton_device), *device_weights, fused, config=cfg
                )
                implementation("fp8_block_gemm_quantized", Backend.NVIDIA)(
                    q, q_scale, *device_weights, codes, config=cfg
                )
            else:
                wide = (weights[0].repeat(groups, 1).to(triton_device), weights[1].repeat(groups, 1).to(triton_device))
                fused = torch.full((m, groups * n), float("nan"), dtype=out_dtype, device=triton_device)
                codes = fused.clone()
                grouped = implementation("fp8_block_grouped_gemm", Backend.NVIDIA)
                grouped(x.to(triton_device), *wide, fused, config=cfg)
                fp8_block_launch(
                    q.view(torch.uint8), q_scale.view(torch.uint8), *wide, codes, groups=groups, config=cfg
                )
            assert not torch.isnan(fused).any()
            assert torch.equal(fused.cpu(), codes.cpu()), (m, split_grid)


def test_expert_rows_share_the_tile_tables(triton_device: str) -> None:
    """Two grouped GEMMs over one ``ExpertRows`` store (a MoE's w13 and w2): the second reuses the first's tile
    tables (one entry in ``derived``; replacing them with tables of no work zeroes its result, so they are read), and
    both equal the calls without a store bit for bit. 20 rows: more than one 16-row tile, so tables are built."""
    m, k, n = 20, 256, 64
    x = _activation(m, k, seed=40, dtype=torch.bfloat16).to(triton_device)
    ids = torch.tensor([2, -1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 2, 2, -1, 0, 0, 1, 2, 1, 0]).to(triton_device)
    first = (random_mxfp4_packed((3, n, k // 2), seed=41), random_ue8m0((3, n, k // 32), seed=42))
    second = (random_mxfp4_packed((3, 2 * n, k // 2), seed=43), random_ue8m0((3, 2 * n, k // 32), seed=44))
    gemm = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)

    def run(weights: tuple[torch.Tensor, ...], derived: dict | None) -> torch.Tensor:
        out = torch.zeros(m, weights[0].shape[1], dtype=torch.bfloat16, device=triton_device)
        gemm(x, ids, *(w.to(triton_device) for w in weights), out, derived=derived)
        return out

    shared = dk.ExpertRows(ids).derived
    y1 = run(first, shared)
    assert len(shared) == 1
    y2 = run(second, shared)
    assert len(shared) == 1
    assert torch.equal(y1, run(first, None)) and torch.equal(y2, run(second, None))
    ((key, ((order, tile_expert, start, end), tails)),) = shared.items()
    shared[key] = ((order, torch.full_like(tile_expert, 3), start, end), tails)  # expert 3 of 3: every tile exits
    assert torch.all(run(second, shared) == 0)
