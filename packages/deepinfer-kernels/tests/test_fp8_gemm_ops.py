"""Grouped FP32-output FP8 GEMM and the FP8 GEMM on a quantized activation: reference properties, argument checks,
Triton (interpreter on CPU, compiled on CUDA) vs the reference; tolerance in _gemm_support (an FP32 ulp for the FP32
output)."""

from __future__ import annotations

import pytest
import torch
from _gemm_support import abs_product, assert_gemm_close, dequantized_activation

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.testing import random_e4m3, random_normal, random_ue8m0


def _activation(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal rows whose 32-column groups span 2^−10 … 2^10, so activation scales differ between groups."""
    spread = torch.logspace(-3, 3, k // 32).repeat_interleave(32).roll(seed)
    return (random_normal((m, k), seed=seed) * spread).to(dtype)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_e4m3((n, k), seed=seed), random_ue8m0((-(-n // 32), k // 32), seed=seed + 1)


def _block_diagonal(w_hat: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, K] grouped weight → [N, G·K] dense weight with zeros outside each group's columns."""
    n, k = w_hat.shape
    dense = torch.zeros(n, groups * k, dtype=w_hat.dtype)
    for g in range(groups):
        rows = slice(g * n // groups, (g + 1) * n // groups)
        dense[rows, g * k : (g + 1) * k] = w_hat[rows]
    return dense


def test_reference_grouped_gemm_is_the_block_diagonal_product() -> None:
    groups, n, k = 3, 96, 64
    x = _activation(5, groups * k, seed=1, dtype=torch.bfloat16)
    w_q, w_scale = _weight(n, k, seed=2)
    out = dk.fp8_block_grouped_gemm(x, w_q, w_scale, groups)
    dense = _block_diagonal(dk.dequantize_fp8_block(w_q, w_scale).double(), groups)
    # Products with the zeros add nothing, so the FP64 sums (exact here) are the same.
    assert out.dtype == torch.float32
    assert torch.equal(out, (dequantized_activation(x) @ dense.t()).float())


def test_grouped_gemm_keeps_leading_dims_and_checks_arguments() -> None:
    w_q, w_scale = _weight(64, 32, seed=3)
    x = _activation(6, 64, seed=4, dtype=torch.float32).view(2, 3, 64)
    assert dk.fp8_block_grouped_gemm(x, w_q, w_scale, 2).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="groups must be"):
        dk.fp8_block_grouped_gemm(x, w_q, w_scale, 3)
    with pytest.raises(ValueError, match="groups·K"):
        dk.fp8_block_grouped_gemm(x[..., :32], w_q, w_scale, 2)
    with pytest.raises(ValueError, match="w_scale must have shape"):
        dk.fp8_block_grouped_gemm(x, w_q, w_scale[:1], 2)
    with pytest.raises(TypeError):
        dk.fp8_block_grouped_gemm(x.half(), w_q, w_scale, 2)


def test_reference_quantized_gemm_equals_fp8_block_gemm() -> None:
    x = _activation(7, 96, seed=5, dtype=torch.bfloat16).view(7, 96)
    w_q, w_scale = _weight(40, 96, seed=6)
    q, q_scale = dk.quantize_fp8_per_token_group(x)
    assert torch.equal(dk.fp8_block_gemm_quantized(q, q_scale, w_q, w_scale), dk.fp8_block_gemm(x, w_q, w_scale))
    with pytest.raises(TypeError):
        dk.fp8_block_gemm_quantized(x, q_scale, w_q, w_scale)
    with pytest.raises(ValueError, match="q_scale must have shape"):
        dk.fp8_block_gemm_quantized(q, q_scale[:, :1], w_q, w_scale)
    with pytest.raises(ValueError, match="columns"):
        dk.fp8_block_gemm_quantized(q[:, :64], q_scale[:, :2], w_q, w_scale)


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.bfloat16), (2, torch.float32), (20, torch.bfloat16)])
def test_fp8_block_grouped_gemm_triton(triton_device: str, m: int, dtype: torch.dtype) -> None:
    groups, n, k = 3, 192, 96
    x = _activation(m, groups * k, seed=m + 10, dtype=dtype)
    w_q, w_scale = _weight(n, k, seed=m + 11)
    fast = torch.empty(m, n, dtype=torch.float32, device=triton_device)
    implementation("fp8_block_grouped_gemm", Backend.NVIDIA)(
        x.to(triton_device), w_q.to(triton_device), w_scale.to(triton_device), fast
    )
    ref = torch.empty(m, n, dtype=torch.float32)
    implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    dense = _block_diagonal(dk.dequantize_fp8_block(w_q, w_scale).double(), groups)
    assert_gemm_close(fast.cpu(), ref, abs_product(dequantized_activation(x), dense), k, significant_bits=24)


def test_grouped_tile_wider_than_a_group_is_narrowed(triton_device: str) -> None:
    from deepinfer_kernels.cuda.fp8_gemm_ops import fp8_block_grouped_gemm
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    groups, n, k = 4, 128, 64
    x = _activation(3, groups * k, seed=12, dtype=torch.bfloat16)
    w_q, w_scale = _weight(n, k, seed=13)
    ref = torch.empty(3, n, dtype=torch.float32)
    implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    dense = _block_diagonal(dk.dequantize_fp8_block(w_q, w_scale).double(), groups)
    wide = BlockConfig(block_m=16, block_n=128, num_warps=4, num_stages=2, split_grid=False)
    fast = torch.empty(3, n, dtype=torch.float32, device=triton_device)
    inputs = (t.to(triton_device) for t in (x, w_q, w_scale))
    fp8_block_grouped_gemm(*inputs, fast, config=wide)
    assert_gemm_close(fast.cpu(), ref, abs_product(dequantized_activation(x), dense), k, significant_bits=24)


@pytest.mark.parametrize("dequantized", [False, True])
@pytest.mark.parametrize("m", [1, 20])
def test_fp8_block_gemm_quantized_triton_equals_fp8_block_gemm(triton_device: str, m: int, dequantized: bool) -> None:
    """The GEMM on given codes and on the activation agree bit for bit: on the tuned tiles, and on ``dequant_bf16``
    (codes dequantized, against x̂ from one quantize-and-dequantize launch)."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    cfg = BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=False, decoding="dequant_bf16")
    config = {"config": cfg} if dequantized else {}
    x = _activation(m, 256, seed=m + 20, dtype=torch.bfloat16).to(triton_device)
    w_q, w_scale = (t.to(triton_device) for t in _weight(70, 256, seed=m + 21))
    q, q_scale = dk.quantize_fp8_per_token_group(x)
    from_codes = torch.empty(m, 70, dtype=torch.bfloat16, device=triton_device)
    implementation("fp8_block_gemm_quantized", Backend.NVIDIA)(q, q_scale, w_q, w_scale, from_codes, **config)
    from_x = torch.empty_like(from_codes)
    implementation("fp8_block_gemm", Backend.NVIDIA)(x, w_q, w_scale, from_x, **config)
    assert torch.equal(from_codes, from_x)


def test_dequantized_bf16_launches_meet_the_bound(triton_device: str) -> None:
    """The cuBLAS path (``dequant_bf16``: both operands dequantized into BF16, one GEMM with FP32 sums) for the grouped
    FP32-output GEMM and for the dense GEMM on codes with a row stride wider than their columns."""
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    cfg = BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=False, decoding="dequant_bf16")
    groups, n, k, m = 3, 192, 96, 37
    x = _activation(m, groups * k, seed=30, dtype=torch.bfloat16)
    w_q, w_scale = _weight(n, k, seed=31)
    fast = torch.empty(m, n, dtype=torch.float32, device=triton_device)
    inputs = [t.to(triton_device) for t in (x, w_q, w_scale)]
    implementation("fp8_block_grouped_gemm", Backend.NVIDIA)(*inputs, fast, config=cfg)
    ref = torch.empty(m, n, dtype=torch.float32)
    implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    dense = _block_diagonal(dk.dequantize_fp8_block(w_q, w_scale).double(), groups)
    assert_gemm_close(fast.cpu(), ref, abs_product(dequantized_activation(x), dense), k, significant_bits=24)

    q, q_scale = dk.quantize_fp8_per_token_group(x[:, :k].contiguous())
    wide_q = torch.zeros(m, 2 * k, dtype=q.dtype)
    wide_q[:, :k] = q
    w_q, w_scale = _weight(70, k, seed=32)
    codes = [t.to(triton_device) for t in (wide_q, q_scale, w_q, w_scale)]
    codes[0] = codes[0][:, :k]
    fast = torch.empty(m, 70, dtype=torch.bfloat16, device=triton_device)
    implementation("fp8_block_gemm_quantized", Backend.NVIDIA)(*codes, fast, config=cfg)
    ref = torch.empty(m, 70, dtype=torch.bfloat16)
    implementation("fp8_block_gemm_quantized", Backend.REFERENCE)(q, q_scale, w_q, w_scale, ref)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert_gemm_close(fast.cpu(), ref, abs_product(dequantized_activation(x[:, :k]), w_hat), k)


@pytest.mark.parametrize(("groups", "n", "k"), [(1, 128, 256), (1, 70, 96), (3, 192, 96), (4, 512, 128)])
def test_swap_bf16_fp8_tiles_meet_the_bound_and_read_codes_as_the_activation(
    triton_device: str, groups: int, n: int, k: int
) -> None:
    """``swap_bf16`` for the FP8 block GEMM (the weight decoded into the MMA's first operand, x̂ as a BF16 copy, K in
    the MMA's FP32 accumulator): within the reference's bound dense (BF16 output) and grouped (FP32 output), with
    whole tiles (no masks but the rows') and partial N and K steps, 37 rows over three row tiles; the launch on the
    activation's codes gives the same bits as the one on the activation."""
    from deepinfer_kernels.cuda.gemm import fp8_block_activation_launch, fp8_block_launch
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

    cfg = BlockConfig(16, 64, num_warps=4, num_stages=2, split_grid=False, block_k=64, decoding="swap_bf16")
    m = 37
    x = _activation(m, groups * k, seed=n + k, dtype=torch.bfloat16)
    w_q, w_scale = _weight(n, k, seed=n + k + 1)
    out_dtype = torch.bfloat16 if groups == 1 else torch.float32
    inputs = [t.to(triton_device) for t in (x, w_q, w_scale)]
    from_x = torch.empty(m, n, dtype=out_dtype, device=triton_device)
    fp8_block_activation_launch(inputs[0], *inputs[1:], from_x, groups=groups, config=cfg)
    q, q_scale = (t.view(torch.uint8) for t in dk.quantize_fp8_per_token_group(inputs[0]))
    from_codes = torch.empty_like(from_x)
    fp8_block_launch(q, q_scale, *inputs[1:], from_codes, groups=groups, config=cfg)
    assert torch.equal(from_codes, from_x)
    ref = torch.empty(m, n, dtype=out_dtype)
    if groups == 1:
        implementation("fp8_block_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    else:
        implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    dense = _block_diagonal(dk.dequantize_fp8_block(w_q, w_scale).double(), groups)
    bound = abs_product(dequantized_activation(x), dense)
    assert_gemm_close(from_x.cpu(), ref, bound, k, significant_bits=8 if groups == 1 else 24)


@pytest.mark.parametrize("k", [1024, 1056])
def test_swap_bf16_fp8_split_k_adds_its_chunks_in_order(triton_device: str, k: int) -> None:
    """Split-K ``swap_bf16`` (the FP8 weight's K in ``k_chunk`` chunks: 4 of 256 columns at 1,024; 512, 512 and 32 at
    1,056, a partial K step) gives the FP32 bits of one-program launches on each chunk's columns added from zero in
    chunk order (added in another order, or K as one run, they differ), in 16- and 64-row tiles; inside
    ``batch_invariant_ops`` an unsplit launch makes the same additions in one program; a row alone gets the bits it
    has among 70; rounded to BF16 the sums meet the reference's bound."""
    from deepinfer_kernels.cuda.gemm import fp8_block_activation_launch
    from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, k_chunk

    n, m = 128, 70
    chunk = k_chunk(n, k)
    assert chunk < k
    x = _activation(m, k, seed=k, dtype=torch.bfloat16)
    w_q, w_scale = _weight(n, k, seed=k + 1)

    def run(cols: slice, rows: slice, block_m: int, split: bool) -> torch.Tensor:
        cfg = BlockConfig(block_m, 64, num_warps=4, num_stages=2, split_grid=split, block_k=64, decoding="swap_bf16")
        groups = slice(cols.start // 32, cols.stop // 32)
        inputs = [t.contiguous().to(triton_device) for t in (x[rows, cols], w_q[:, cols], w_scale[:, groups])]
        out = torch.full((inputs[0].shape[0], n), float("nan"), dtype=torch.float32, device=triton_device)
        fp8_block_activation_launch(*inputs, out, config=cfg)
        return out.cpu()

    everything = slice(0, m)
    starts = range(0, k, chunk)
    for block_m in (16, 64):
        chunk_sums = [run(slice(c, min(c + chunk, k)), everything, block_m, split=False) for c in starts]
        in_order = torch.zeros(m, n)
        for part in chunk_sums:
            in_order += part
        split = run(slice(0, k), everything, block_m, split=True)
        assert torch.equal(split, in_order), block_m
        assert not torch.equal(split, sum(reversed(chunk_sums), torch.zeros(m, n))), block_m
        assert not torch.equal(split, run(slice(0, k), everything, block_m, split=False)), block_m
        with batch_invariant_ops():
            assert torch.equal(split, run(slice(0, k), everything, block_m, split=False)), block_m
    together = run(slice(0, k), everything, 16, split=True)
    for row in (0, 37, 69):
        assert torch.equal(run(slice(0, k), slice(row, row + 1), 16, split=True)[0], together[row]), row
    ref = torch.empty(m, n, dtype=torch.bfloat16)
    implementation("fp8_block_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert_gemm_close(together.to(torch.bfloat16), ref, abs_product(dequantized_activation(x), w_hat), k)


@pytest.mark.parametrize("before", [True, False])
def test_fp32_split_k_sums_turns_bf16_reductions_off_and_restores_the_flag(before: bool) -> None:
    from deepinfer_kernels.cuda.dequantized_gemm import fp32_split_k_sums

    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = before
    try:
        with fp32_split_k_sums():
            assert matmul.allow_bf16_reduced_precision_reduction is False
        assert matmul.allow_bf16_reduced_precision_reduction is before
        with pytest.raises(RuntimeError), fp32_split_k_sums():
            raise RuntimeError("a failing GEMM")
        assert matmul.allow_bf16_reduced_precision_reduction is before
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved
