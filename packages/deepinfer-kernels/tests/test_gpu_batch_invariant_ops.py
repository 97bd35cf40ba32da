"""Batch invariance on a CUDA device (docs/design/numerics.md, "Batch invariance"): inside ``batch_invariant_ops``
every op of the model's CUDA forward gives a row the same bits alone and inside a batch of 64 (and of 300, where
the quantized GEMMs switch from split-K to one program per tile), at every position; a CUDA graph captured inside
the mode replays the same bits. Bitwise comparisons: no tolerance."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _cache_inputs import random_pool
from _gpu_marks import COMPILED_TRITON_ON_GPU

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops

pytestmark = COMPILED_TRITON_ON_GPU

_K = 4096
_POSITIONS = (0, 1, 17, 63)


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    return generator


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed), device="cuda").to(dtype)


def _bytes(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_generator(seed), device="cuda", dtype=torch.int32).to(torch.uint8)


def _assert_rows_invariant(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """``run`` on each row of ``x`` alone and on its first 64 rows and all of them gives each row the same bits."""
    with batch_invariant_ops():
        together = {count: run(x[:count]) for count in (64, x.shape[0])}
        for row in _POSITIONS:
            alone = run(x[row : row + 1])
            for count, result in together.items():
                assert torch.equal(alone[0], result[row]), (row, count)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_torch_products_under_the_mode(in_dtype: torch.dtype) -> None:
    """The products of the model's CUDA path: LM head ``torch.mm(out_dtype=float32)``, FP32 ``@`` (router, BF16
    linears), ``linear`` with bias, the grouped ``einsum`` of the FP8 grouped linear."""
    x = _randn((300, 1024), seed=1, dtype=in_dtype)
    w = _randn((2048, 1024), seed=2, dtype=in_dtype)
    bias = _randn((2048,), seed=3, dtype=in_dtype)
    grouped = _randn((4, 512, 256), seed=4, dtype=in_dtype)
    if in_dtype == torch.bfloat16:
        _assert_rows_invariant(lambda rows: torch.mm(rows, w.t(), out_dtype=torch.float32), x)
    _assert_rows_invariant(lambda rows: rows.float() @ w.float().t(), x)
    _assert_rows_invariant(lambda rows: torch.nn.functional.linear(rows, w, bias), x)
    _assert_rows_invariant(lambda rows: torch.einsum("ngi,goi->ngo", rows.view(-1, 4, 256), grouped), x)


def test_torch_reductions_under_the_mode() -> None:
    x = _randn((300, 5000), seed=5, dtype=torch.float32) * 3
    _assert_rows_invariant(lambda rows: rows.sum(dim=-1), x)
    _assert_rows_invariant(lambda rows: rows.mean(dim=-1), x)
    _assert_rows_invariant(lambda rows: torch.softmax(rows, dim=-1), x)
    _assert_rows_invariant(lambda rows: torch.linalg.vector_norm(rows, dim=-1), x)
    _assert_rows_invariant(lambda rows: rows.view(-1, 4, 1250).float().mean(dim=1), x)


@pytest.mark.parametrize("n", [3000, 384, 40000])
def test_invariant_matmul_rows_at_every_position(n: int) -> None:
    """Every row of a 130-row product equals the row alone (the 16-row tile, K's chunks summed by each tile's last
    program), with K's chunks as programs of their own summed by a second launch (one batch entry) and with one
    program summing them in order (two entries): 11 chunks at 3,000 columns and 16 at the router's 384 on the
    128-row tile; one chunk at 40,000 columns (an LM head's shape) on the 128 × 256 tile."""
    x = _randn((130, _K), seed=6)
    w = _randn((_K, n), seed=7)
    split = dk_matmul(x[None], w[None])[0]
    one_program = dk_matmul(x[None].expand(2, -1, -1), w[None].expand(2, -1, -1))
    assert torch.equal(one_program[0], split) and torch.equal(one_program[1], split)
    for row in range(130):
        assert torch.equal(dk_matmul(x[None, row : row + 1], w[None])[0, 0], split[row]), row


def dk_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The nvidia ``invariant_matmul`` of [B, M, K] and [B, K, N], FP32 out."""
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.float32, device="cuda")
    implementation("invariant_matmul", Backend.NVIDIA)(a, b, out)
    return out


@pytest.mark.parametrize(("n", "k"), [(4608, 5120), (5120, 2304), (512, 5120)])
def test_fp8_block_gemm_rows(n: int, k: int) -> None:
    w_q = (_bytes((n, k), seed=n) & 0xF7).view(torch.float8_e4m3fn)  # clearing bit 3 avoids the NaN code 0x7F
    w_scale = _bytes((n // 32, k // 32), n + 1, 118, 127).view(torch.float8_e8m0fnu)
    x = _randn((300, k), seed=k)
    _assert_rows_invariant(lambda rows: dk.fp8_block_gemm(rows, w_q, w_scale), x)


@pytest.mark.parametrize(("n", "out_dtype"), [(384, torch.float32), (32, torch.bfloat16)])
def test_bf16_gemm_rows(n: int, out_dtype: torch.dtype) -> None:
    """The BF16-weight product (outside the mode a GEMV at one or two rows, cuBLAS beyond) keeps a row's bits."""
    weight = _randn((n, 5120), seed=n)
    x = _randn((300, 5120), seed=n + 1)
    _assert_rows_invariant(lambda rows: dk.bf16_gemm(rows, weight, out_dtype), x)


@pytest.mark.parametrize(("n", "k"), [(4608, 5120), (5120, 2304)])
def test_mxfp4_gemm_rows(n: int, k: int) -> None:
    packed = _bytes((n, k // 2), seed=n).view(torch.int8)
    scale = _bytes((n, k // 32), n + 1, 118, 127).view(torch.float8_e8m0fnu)
    x = _randn((300, k), seed=k + 1)
    _assert_rows_invariant(lambda rows: dk.mxfp4_gemm(rows, packed, scale), x)


def test_mxfp4_grouped_gemm_rows() -> None:
    experts, n = 16, 2048
    packed = _bytes((experts, n, _K // 2), seed=8).view(torch.int8)
    scale = _bytes((experts, n, _K // 32), 9, 118, 127).view(torch.float8_e8m0fnu)
    x = _randn((300, _K), seed=10)
    ids = torch.randint(0, experts, (300,), generator=_generator(11), device="cuda")
    with batch_invariant_ops():
        together = {count: dk.mxfp4_grouped_gemm(x[:count], ids[:count], packed, scale) for count in (64, 300)}
        for row in _POSITIONS:
            alone = dk.mxfp4_grouped_gemm(x[row : row + 1], ids[row : row + 1], packed, scale)
            for count, result in together.items():
                assert torch.equal(alone[0], result[row]), (row, count)


def test_sparse_attention_rows_with_other_key_counts() -> None:
    """A query alone (its own key lists) vs among 64 and 300 queries whose key lists are longer (its rows padded with
    −1 per source): alone and among 64 the key list is split over programs, among 300 one program folds the chunks."""
    heads, width, widths = 64, 512, (128, 4, 2048)
    pools = [random_pool(3000, width, dk.RowFormat.FP8, seed=12 + i, device="cuda") for i in range(3)]
    q = _randn((300, heads, width), seed=15)
    sink = _randn((heads,), seed=16, dtype=torch.float32)
    rows, lengths = [], []
    for i, n in enumerate(widths):
        length = torch.randint(0, n + 1, (300,), generator=_generator(17 + i), device="cuda")
        ids = torch.randint(0, 3000, (300, n), generator=_generator(20 + i), device="cuda")
        rows.append(torch.where(torch.arange(n, device="cuda")[None, :] < length[:, None], ids, -1))
        lengths.append(length)

    def attend(token: slice, own: bool) -> torch.Tensor:
        sources = [
            dk.KeySource(pool, r[token, : int(length[token].max()) if own else None], dk.RowFormat.FP8)
            for pool, r, length in zip(pools, rows, lengths, strict=True)
        ]
        return dk.sparse_attention(q[token], sources, sink, width**-0.5, True)

    with batch_invariant_ops():
        together = {count: attend(slice(0, count), own=False) for count in (64, 300)}
        for row in _POSITIONS:
            alone = attend(slice(row, row + 1), own=True)
            for count, result in together.items():
                assert torch.equal(alone[0], result[row]), (row, count)


def test_a_graph_captured_inside_the_mode_replays_its_bits() -> None:
    x = _randn((64, 1024), seed=17)
    w = _randn((2048, 1024), seed=18)

    def step() -> torch.Tensor:
        return torch.softmax(torch.mm(x, w.t(), out_dtype=torch.float32), dim=-1)

    with batch_invariant_ops():
        eager = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
