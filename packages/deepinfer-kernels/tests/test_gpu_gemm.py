"""Compiled Triton GEMMs on a CUDA device at model sizes, vs the reference (run on the same device, FP64 sums).

Tolerance: see _gemm_support (one bf16 ulp of the reference plus the FP32 accumulation bound).
"""

from __future__ import annotations

import pytest
import torch
from _gemm_support import abs_product, assert_gemm_close, dequantized_activation
from _gpu_marks import COMPILED_TRITON_ON_GPU

import deepinfer_kernels as dk
from deepinfer_kernels import _registry
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, swap_bf16_tile

pytestmark = COMPILED_TRITON_ON_GPU

_K = 4096


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cuda")
    generator.manual_seed(seed)
    return generator


def _activation(m: int, seed: int) -> torch.Tensor:
    return torch.randn((m, _K), generator=_generator(seed), device="cuda").to(torch.bfloat16)


def _bytes(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=_generator(seed), device="cuda", dtype=torch.int32).to(torch.uint8)


def _mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes [..., N, K/2] int8 and scales [..., N, K/32] with bytes 118…126 (like real weights)."""
    packed = _bytes((*shape, _K // 2), seed).view(torch.int8)
    scale = _bytes((*shape, _K // 32), seed + 1, 118, 127).view(torch.float8_e8m0fnu)
    return packed, scale


def _run(op: str, backend: Backend, m: int, n: int, *inputs: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    implementation(op, backend)(*inputs, out)
    return out


@pytest.mark.parametrize("m", [1, 2, 8, 64, 512])
@pytest.mark.parametrize("n", [4096, 2048])
def test_fp8_block_gemm_gpu(m: int, n: int) -> None:
    x = _activation(m, seed=m)
    w_q = (_bytes((n, _K), seed=n) & 0xF7).view(torch.float8_e4m3fn)  # clearing bit 3 avoids the NaN code 0x7F
    w_scale = _bytes((n // 32, _K // 32), n + 1, 118, 127).view(torch.float8_e8m0fnu)
    fast = _run("fp8_block_gemm", Backend.NVIDIA, m, n, x, w_q, w_scale)
    ref = _run("fp8_block_gemm", Backend.REFERENCE, m, n, x, w_q, w_scale)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), w_hat), _K)


@pytest.mark.parametrize("m", [1, 2, 8, 64, 512])
@pytest.mark.parametrize("n", [4096, 2048])
def test_mxfp4_gemm_gpu(m: int, n: int) -> None:
    x = _activation(m, seed=m + 1)
    packed, scale = _mxfp4((n,), seed=n + 2)
    fast = _run("mxfp4_gemm", Backend.NVIDIA, m, n, x, packed, scale)
    ref = _run("mxfp4_gemm", Backend.REFERENCE, m, n, x, packed, scale)
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), dk.dequantize_mxfp4(packed, scale)), _K)


def _grouped_magnitude(x: torch.Tensor, ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_hat = dequantized_activation(x)
    magnitude = torch.zeros(x.shape[0], packed.shape[1], dtype=torch.float64, device="cuda")
    for expert in torch.unique(ids[ids >= 0]).tolist():
        rows = torch.nonzero(ids == expert).squeeze(1)
        magnitude[rows] = abs_product(x_hat[rows], dk.dequantize_mxfp4(packed[expert], scale[expert]))
    return magnitude


def _ids(m: int, experts: int, seed: int) -> torch.Tensor:
    """Expert ids with about one row in eight unassigned (-1)."""
    ids = torch.randint(0, experts, (m,), generator=_generator(seed), device="cuda")
    drop = torch.randint(0, 8, (m,), generator=_generator(seed + 1), device="cuda") == 0
    return torch.where(drop, -1, ids)


@pytest.mark.parametrize("m", [1, 64, 512])
@pytest.mark.parametrize("experts", [16, 256])
def test_mxfp4_grouped_gemm_gpu(m: int, experts: int) -> None:
    n = 2048
    packed, scale = _mxfp4((experts, n), seed=experts)
    x = _activation(m, seed=m + 3)
    ids = _ids(m, experts, seed=m + experts)
    fast = _run("mxfp4_grouped_gemm", Backend.NVIDIA, m, n, x, ids, packed, scale)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
    assert_gemm_close(fast, ref, _grouped_magnitude(x, ids, packed, scale), _K)
    assert torch.all(fast[ids < 0] == 0)


@pytest.mark.parametrize("m", [6, 96])
def test_mxfp4_grouped_gemm_cuda_graph_replay(m: int) -> None:
    """Replays of one capture with new ids and inputs; 6 rows run split-K (zeroed partials in the graph), 96 not."""
    _registry.reset()
    assert _registry.resolve("mxfp4_grouped_gemm", "cuda") is implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    experts, n = 32, 2048
    packed, scale = _mxfp4((experts, n), seed=5)
    x = _activation(m, seed=6)
    ids = _ids(m, experts, seed=7)
    dk.mxfp4_grouped_gemm(x, ids, packed, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dk.mxfp4_grouped_gemm(x, ids, packed, scale)
    for seed in (8, 9, 10):
        ids.copy_(_ids(m, experts, seed=seed))
        x.copy_(_activation(m, seed=seed + 100))
        graph.replay()
        torch.cuda.synchronize()
        ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
        assert_gemm_close(out, ref, _grouped_magnitude(x, ids, packed, scale), _K)
    ids.fill_(-1)
    graph.replay()
    assert torch.all(out == 0)


def _check_grouped_wo_a(m: int, seeds: tuple[int, int, int], config: BlockConfig | None = None) -> None:
    """The attention's wo_a shape: 8 groups of [1024, 4096], FP32 output (tolerance with an FP32 ulp)."""
    groups, n = 8, 8192
    x = torch.randn((m, groups * _K), generator=_generator(seeds[0]), device="cuda").to(torch.bfloat16)
    w_q = (_bytes((n, _K), seed=seeds[1]) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((n // 32, _K // 32), seeds[2], 118, 127).view(torch.float8_e8m0fnu)
    fast = torch.zeros(m, n, dtype=torch.float32, device="cuda")
    implementation("fp8_block_grouped_gemm", Backend.NVIDIA)(x, w_q, w_scale, fast, config=config)
    ref = torch.zeros_like(fast)
    implementation("fp8_block_grouped_gemm", Backend.REFERENCE)(x, w_q, w_scale, ref)
    x_hat = dequantized_activation(x).view(m, groups, _K).abs()
    w_hat = dk.dequantize_fp8_block(w_q, w_scale).double().view(groups, n // groups, _K).abs()
    magnitude = torch.einsum("mgk,gnk->mgn", x_hat, w_hat).reshape(m, n)
    assert_gemm_close(fast, ref, magnitude, _K, significant_bits=24)


@pytest.mark.parametrize("m", [1, 2, 8, 64, 512])
def test_fp8_block_grouped_gemm_gpu(m: int) -> None:
    _check_grouped_wo_a(m, (m + 3, 8192 + m, 8192 + 2))


@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_fp8_block_gemm_quantized_gpu_equals_fp8_block_gemm(m: int) -> None:
    x = _activation(m, seed=m + 5)
    w_q = (_bytes((4096, _K), seed=m + 6) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((4096 // 32, _K // 32), m + 7, 118, 127).view(torch.float8_e8m0fnu)
    q, q_scale = dk.quantize_fp8_per_token_group(x)
    assert torch.equal(dk.fp8_block_gemm_quantized(q, q_scale, w_q, w_scale), dk.fp8_block_gemm(x, w_q, w_scale))


_DEQUANT_BF16 = BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=False, decoding="dequant_bf16")


# The FP8 block GEMM's BF16 paths: the cuBLAS GEMM on both operands dequantized, and the weight decoded in the MMA's
# registers against x̂ (cuda.swap_bf16) in a 64-, 128- and 256-row tile, and the split-K 16- and 64-row tiles the
# decode buckets take.
_BF16_FP8 = [
    _DEQUANT_BF16,
    BlockConfig(16, 64, num_warps=4, num_stages=3, split_grid=True, block_k=64, decoding="swap_bf16"),
    BlockConfig(64, 128, num_warps=8, num_stages=3, split_grid=True, block_k=64, decoding="swap_bf16"),
    BlockConfig(64, 128, num_warps=8, num_stages=3, split_grid=False, block_k=64, decoding="swap_bf16"),
    BlockConfig(128, 128, num_warps=8, num_stages=3, split_grid=False, block_k=64, decoding="swap_bf16"),
    BlockConfig(256, 128, num_warps=8, num_stages=3, split_grid=False, block_k=64, decoding="swap_bf16"),
]


@pytest.mark.parametrize("cfg", _BF16_FP8, ids=lambda c: f"{c.decoding}-m{c.block_m}{'-split' * c.split_grid}")
@pytest.mark.parametrize("m", [300, 4096])
def test_bf16_fp8_gemms_meet_the_fp32_bound(m: int, cfg: BlockConfig) -> None:
    """The BF16 paths (exact BF16 operands, FP32 sums, FP32 result rounded once) meet the FP32 accumulation bound on
    random inputs, with no FP8-MMA term: dense with a BF16 output and grouped (wo_a's 8 groups of [1024, 4096]) with
    an FP32 one."""
    x = _activation(m, seed=m + 40)
    w_q = (_bytes((4096, _K), seed=m + 41) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((4096 // 32, _K // 32), m + 42, 118, 127).view(torch.float8_e8m0fnu)
    fast = torch.zeros(m, 4096, dtype=torch.bfloat16, device="cuda")
    implementation("fp8_block_gemm", Backend.NVIDIA)(x, w_q, w_scale, fast, config=cfg)
    ref = _run("fp8_block_gemm", Backend.REFERENCE, m, 4096, x, w_q, w_scale)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), w_hat), _K, what=cfg.decoding)
    _check_grouped_wo_a(m, (m + 43, m + 44, m + 45), config=cfg)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_dequantized_bf16_split_k_sums_stay_fp32(m: int) -> None:
    """Few rows over a long K is where cuBLAS splits K: its partial sums must be added in FP32 although the output is
    BF16 (``fp32_split_k_sums``), with torch's default (reduced-precision reductions allowed) in force around it."""
    k, n = 16384, 1024
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    x = torch.randn((m, k), generator=_generator(m + 70), device="cuda").to(torch.bfloat16)
    w_q = (_bytes((n, k), seed=m + 71) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((n // 32, k // 32), m + 72, 118, 127).view(torch.float8_e8m0fnu)
    fast = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    implementation("fp8_block_gemm", Backend.NVIDIA)(x, w_q, w_scale, fast, config=_DEQUANT_BF16)
    ref = _run("fp8_block_gemm", Backend.REFERENCE, m, n, x, w_q, w_scale)
    w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
    assert_gemm_close(fast, ref, abs_product(dequantized_activation(x), w_hat), k, what="dequant_bf16")
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction  # restored


def test_swap_bf16_fp8_rows_keep_their_bits_in_every_tile() -> None:
    """Whether ``swap_bf16`` FP8 tiles could serve the batch-invariant mode: with K in the weight shape's chunks, a
    row's FP32 sums are the same bits alone in a 16-row tile and among 300 rows in split 16- and 64-row tiles of 64
    and 128 weight rows and in unsplit 64- and 256-row tiles that add the chunks in one program (inside
    ``batch_invariant_ops``). The tokens are the BF16 wgmma's N side, so this holds if the tensor core's sums of an
    output do not depend on N (as the FP8 ``swap_fp8`` tiles' do not)."""
    m, n, k = 300, 4096, 5120
    x = torch.randn((m, k), generator=_generator(60), device="cuda").to(torch.bfloat16)
    w_q = (_bytes((n, k), seed=61) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((n // 32, k // 32), 62, 118, 127).view(torch.float8_e8m0fnu)
    gemm = implementation("fp8_block_gemm", Backend.NVIDIA)

    def run(rows: torch.Tensor, block_m: int, block_n: int, warps: int, split: bool) -> torch.Tensor:
        cfg = BlockConfig(block_m, block_n, warps, 3, split_grid=split, block_k=64, decoding="swap_bf16")
        out = torch.full((rows.shape[0], n), float("nan"), dtype=torch.float32, device="cuda")
        with batch_invariant_ops():
            gemm(rows, w_q, w_scale, out, config=cfg)
        return out

    tiles = [(16, 64, 4, True), (16, 128, 8, True), (64, 64, 4, True), (64, 128, 8, True), (64, 64, 4, False)]
    tiles += [(64, 128, 8, False), (256, 128, 8, False)]
    together = [run(x, *tile) for tile in tiles]
    for row in (0, 1, 17, 63, 299):
        alone = run(x[row : row + 1], *tiles[0])[0]
        for tile, result in zip(tiles, together, strict=True):
            assert torch.equal(alone, result[row]), (row, tile)


def test_dequantized_bf16_replays_in_a_cuda_graph() -> None:
    """A decode step of 256 rows captures the cuBLAS path (its BF16 copies come from the graph's pool): replays with
    new inputs equal eager calls bit for bit."""
    m, n = 256, 4096
    w_q = (_bytes((n, _K), seed=50) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((n // 32, _K // 32), 51, 118, 127).view(torch.float8_e8m0fnu)
    x = _activation(m, seed=52)
    gemm = implementation("fp8_block_gemm", Backend.NVIDIA)
    out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    gemm(x, w_q, w_scale, out, config=_DEQUANT_BF16)  # compile and create cuBLAS's handle outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(x, w_q, w_scale, out, config=_DEQUANT_BF16)
    for seed in (53, 54):
        x.copy_(_activation(m, seed=seed))
        graph.replay()
        eager = torch.zeros_like(out)
        gemm(x, w_q, w_scale, eager, config=_DEQUANT_BF16)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


# The FP8 tensor-core decodings' tiles, over several row and column tiles: group_fp8 at the prefill tile, swap_fp8
# (transposed, for few rows) at the grouped GEMM's decode tile.
_FP8_MMA = {
    "group_fp8": BlockConfig(128, 128, num_warps=8, num_stages=3, split_grid=False, block_k=64, decoding="group_fp8"),
    "swap_fp8": BlockConfig(16, 128, num_warps=4, num_stages=4, split_grid=False, block_k=64, decoding="swap_fp8"),
}


def _integer_activation(m: int, seed: int) -> torch.Tensor:
    """Integers in [−8, 8]: quantized to e4m3 codes that are multiples of 32 (at most 448), so that with e2m1 or small
    integer e4m3 weights every 32-column group sum fits 13 bits and Hopper's FP8 MMA sums it exactly."""
    return torch.randint(-8, 9, (m, _K), generator=_generator(seed), device="cuda").to(torch.bfloat16)


def _fp8_mma_case(op: str, m: int, exact: bool, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int]:
    """(inputs, S, N) of one group_fp8 check: dense FP8-block, dense MXFP4 or grouped MXFP4 (16 experts)."""
    x = _integer_activation(m, seed) if exact else _activation(m, seed)
    n = 2048
    if op == "fp8_block_gemm":
        if exact:
            codes = torch.randint(-16, 17, (n, _K), generator=_generator(seed + 1), device="cuda")
            w_q = codes.float().to(torch.float8_e4m3fn)
        else:
            w_q = (_bytes((n, _K), seed=seed + 1) & 0xF7).view(torch.float8_e4m3fn)
        w_scale = _bytes((n // 32, _K // 32), seed + 2, 118, 127).view(torch.float8_e8m0fnu)
        w_hat = dk.dequantize_fp8_block(w_q, w_scale, out_dtype=torch.float32)
        return (x, w_q, w_scale), abs_product(dequantized_activation(x), w_hat), n
    if op == "mxfp4_gemm":
        packed, scale = _mxfp4((n,), seed=seed + 1)
        return (x, packed, scale), abs_product(dequantized_activation(x), dk.dequantize_mxfp4(packed, scale)), n
    packed, scale = _mxfp4((16, n), seed=seed + 1)
    ids = _ids(m, 16, seed=seed + 3)
    return (x, ids, packed, scale), _grouped_magnitude(x, ids, packed, scale), n


@pytest.mark.parametrize("decoding", sorted(_FP8_MMA))
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm", "mxfp4_grouped_gemm"])
def test_fp8_tensor_core_decoding_meets_the_bound(op: str, exact: bool, decoding: str) -> None:
    """``group_fp8`` and ``swap_fp8`` (e4m3 codes straight into the FP8 tensor cores, e2m1 codes turned into e4m3): on
    inputs whose group sums fit 13 bits they meet the FP32 accumulation bound (any wrong code, column order or scale
    breaks it); on random inputs the bound with the FP8 MMA's per-group term (_gemm_support)."""
    m = 600  # five row tiles of 128, the last one partial
    inputs, magnitude, n = _fp8_mma_case(op, m, exact, seed=len(op) + exact)
    fast = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    implementation(op, Backend.NVIDIA)(*inputs, fast, config=_FP8_MMA[decoding])
    ref = _run(op, Backend.REFERENCE, m, n, *inputs)
    assert_gemm_close(fast, ref, magnitude, _K, group_accumulation=0.0 if exact else 2.0**-8)
    if op == "mxfp4_grouped_gemm":
        assert torch.all(fast[inputs[1] < 0] == 0)


@pytest.mark.parametrize(
    "cfg",
    [
        BlockConfig(64, 128, num_warps=8, num_stages=3, split_grid=False, block_k=64, decoding="swap_bf16"),
        BlockConfig(128, 64, num_warps=4, num_stages=3, split_grid=False, block_k=64, decoding="swap_bf16"),
        swap_bf16_tile(64, 128, 8, tail_m=16),
        swap_bf16_tile(32, 128, 8, tail_m=16),
    ],
    ids=lambda c: f"m{c.block_m}-n{c.block_n}-t{c.tail_m}",
)
@pytest.mark.parametrize("n", [2048, 2000])
def test_grouped_bf16_tiles_meet_the_fp32_bound(cfg: BlockConfig, n: int) -> None:
    """``swap_bf16`` (BF16 copy of the activation in expert order, K in the MMA's FP32 accumulator): the FP32 bound on
    random inputs with no FP8-MMA term, 1,200 rows over 16 experts (about 75 an expert: several tiles each, partial
    ones), N a multiple of the tile (unmasked loads) and not, with tail tiles (an expert's last 11 or so rows) and
    without; rows without an expert stay zero."""
    experts, m = 16, 1200
    packed, scale = _mxfp4((experts, n), seed=60)
    x = _activation(m, seed=61)
    ids = _ids(m, experts, seed=62)
    fast = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed, scale, fast, config=cfg)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
    assert_gemm_close(fast, ref, _grouped_magnitude(x, ids, packed, scale), _K)
    assert torch.all(fast[ids < 0] == 0)


# The explicit-layout Gluon kernel's tiles (cuda.grouped_wgmma): one and two warpgroups, 8, 16 and 32 rows, K steps
# of four, eight and sixteen groups, rings of two to four slots.
_GLUON_TILES = [
    BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(16, 64, num_warps=4, num_stages=4, split_grid=False, block_k=256, decoding="gluon_fp8"),
    BlockConfig(8, 128, num_warps=8, num_stages=2, split_grid=False, block_k=256, decoding="gluon_fp8"),
    BlockConfig(16, 128, num_warps=8, num_stages=3, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(32, 64, num_warps=4, num_stages=2, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(8, 64, num_warps=4, num_stages=2, split_grid=False, block_k=512, decoding="gluon_fp8"),
]


@pytest.mark.parametrize("cfg", _GLUON_TILES, ids=lambda c: f"m{c.block_m}-w{c.num_warps}-k{c.block_k}")
@pytest.mark.parametrize("m", [1, 6, 64, 600])
def test_gluon_grouped_gemm_meets_the_reference_bound(m: int, cfg: BlockConfig) -> None:
    """The Gluon kernel on random inputs: within the reference's bound with the FP8 MMA's per-group term, one tile of
    all rows (1 and 6 rows) or tile tables (64, 600), zero rows for unassigned ids, N not a multiple of its tile."""
    experts, n = 16, 2000
    packed, scale = _mxfp4((experts, n), seed=m + cfg.block_k)
    x = _activation(m, seed=m + 50)
    ids = _ids(m, experts, seed=m + 51)
    fast = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed, scale, fast, config=cfg)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
    assert_gemm_close(fast, ref, _grouped_magnitude(x, ids, packed, scale), _K, group_accumulation=2.0**-8)
    assert torch.all(fast[ids < 0] == 0)


@pytest.mark.parametrize("cfg", _GLUON_TILES, ids=lambda c: f"m{c.block_m}-w{c.num_warps}-k{c.block_k}")
def test_gluon_grouped_gemm_equals_swap_fp8_bitwise(cfg: BlockConfig) -> None:
    """The Gluon kernel computes the swap_fp8 tile's products, group sums and factor order: the same bits as the Triton
    tile of 16 rows."""
    experts, n, m = 16, 2048, 64
    packed, scale = _mxfp4((experts, n), seed=60)
    x = _activation(m, seed=61)
    ids = _ids(m, experts, seed=62)
    results = []
    for tile in (cfg, _FP8_MMA["swap_fp8"]):
        out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
        implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed, scale, out, config=tile)
        results.append(out)
    assert torch.equal(results[0], results[1])


def test_gluon_grouped_gemm_exact_sums_meet_the_fp32_bound() -> None:
    """Integer inputs whose group sums fit the FP8 MMA's accumulator: any wrong code, column order, row or scale of the
    Gluon kernel breaks the FP32 accumulation bound."""
    inputs, magnitude, n = _fp8_mma_case("mxfp4_grouped_gemm", 600, exact=True, seed=77)
    for cfg in _GLUON_TILES:
        fast = torch.zeros(600, n, dtype=torch.bfloat16, device="cuda")
        implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(*inputs, fast, config=cfg)
        ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, 600, n, *inputs)
        assert_gemm_close(fast, ref, magnitude, _K, group_accumulation=0.0)


def test_gluon_grouped_gemm_rows_alone_equal_rows_in_a_batch() -> None:
    """A row's bits do not depend on the batch: alone (one program scans for it) and among 384 rows over 64 experts
    (tile tables), bit for bit."""
    experts, n, m = 64, 1024, 384
    packed, scale = _mxfp4((experts, n), seed=90)
    x = _activation(m, seed=91)
    ids = _ids(m, experts, seed=92).clamp(min=0)
    cfg = _GLUON_TILES[0]
    impl = implementation("mxfp4_grouped_gemm", Backend.NVIDIA)
    together = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
    impl(x, ids, packed, scale, together, config=cfg)
    for r in (0, 17, 383):
        alone = torch.zeros(1, n, dtype=torch.bfloat16, device="cuda")
        impl(x[r : r + 1], ids[r : r + 1], packed, scale, alone, config=cfg)
        assert torch.equal(alone[0], together[r])


def test_gluon_grouped_gemm_shortens_a_k_step_that_does_not_divide_k() -> None:
    """K not a multiple of the tile's K step (the tiny preset's w2 has K = 128 against 256; here 384) runs in shorter
    steps, N not a multiple of the tile's rows masks them: within the reference bound and equal to the Triton
    swap_fp8 tile bit for bit."""
    experts, n, k, m = 4, 200, 384, 24
    x = torch.randn((m, k), generator=_generator(70), device="cuda").to(torch.bfloat16)
    packed = _bytes((experts, n, k // 2), seed=71).view(torch.int8)
    scale = _bytes((experts, n, k // 32), seed=72, low=118, high=127).view(torch.float8_e8m0fnu)
    ids = _ids(m, experts, seed=73)
    results = []
    for tile in (_GLUON_TILES[0], _GLUON_TILES[2], _FP8_MMA["swap_fp8"]):
        out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
        implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(x, ids, packed, scale, out, config=tile)
        results.append(out)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
    assert_gemm_close(results[0], ref, _grouped_magnitude(x, ids, packed, scale), k, group_accumulation=2.0**-8)
    assert torch.equal(results[0], results[2]) and torch.equal(results[1], results[2])


# Dense swap_fp8 tiles (the batch-invariant mode's, gemm_tiles.invariant_config): 16 to 64 rows, one and two
# warpgroups, 64 and 128 weight rows, K steps of four and eight groups, split-K and not.
_SWAP_TILES = [
    BlockConfig(32, 64, num_warps=4, num_stages=4, split_grid=True, decoding="swap_fp8"),
    BlockConfig(16, 64, num_warps=4, num_stages=3, split_grid=True, block_k=256, decoding="swap_fp8"),
    BlockConfig(16, 128, num_warps=8, num_stages=3, split_grid=True, decoding="swap_fp8"),
    BlockConfig(64, 64, num_warps=4, num_stages=4, split_grid=False, decoding="swap_fp8"),
    BlockConfig(64, 128, num_warps=4, num_stages=3, split_grid=True, decoding="swap_fp8"),
]


@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm"])
def test_dense_swap_fp8_rows_keep_their_bits_in_every_tile_and_batch(op: str) -> None:
    """A dense swap_fp8 GEMM sums each row in the K chunks of the weight's shape, whatever its tile, split-K or row
    count: every tile gives the same bits for 200 rows, and a row alone or among 7 others the same as in the 200;
    all within the reference's bound with the FP8 MMA's per-group term. N (1,000) is no multiple of any tile."""
    m = 200
    inputs, magnitude, _ = _fp8_mma_case(op, m, exact=False, seed=80 + len(op))
    n = 1000
    x, weight = inputs[0], (inputs[1][:n], inputs[2][: -(-n // 32)] if op == "fp8_block_gemm" else inputs[2][:n])
    magnitude = magnitude[:, :n]
    impl = implementation(op, Backend.NVIDIA)

    def run(rows: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
        out = torch.zeros(rows.shape[0], n, dtype=torch.bfloat16, device="cuda")
        impl(rows, *(w.contiguous() for w in weight), out, config=cfg)
        return out

    batch = run(x, _SWAP_TILES[0])
    ref = _run(op, Backend.REFERENCE, m, n, x, *(w.contiguous() for w in weight))
    assert_gemm_close(batch, ref, magnitude, _K, group_accumulation=2.0**-8)
    for cfg in _SWAP_TILES:
        assert torch.equal(run(x, cfg), batch), cfg
        assert torch.equal(run(x[5:6], cfg)[0], batch[5]), cfg
        assert torch.equal(run(x[100:108], cfg), batch[100:108]), cfg


# The dense FP8 GEMM's Gluon tiles (cuda.fp8_wgmma): 8 to 64 tokens, one and two warpgroups, K steps of four and
# eight groups, rings of two to four slots (the one-row tile of four, gemm_tiles.MEASURED_INVARIANT's too).
_GLUON_FP8_TILES = [
    BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=False, block_k=256, decoding="gluon_fp8"),
    BlockConfig(8, 64, num_warps=4, num_stages=4, split_grid=False, block_k=256, decoding="gluon_fp8"),
    BlockConfig(16, 64, num_warps=4, num_stages=4, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(16, 64, num_warps=4, num_stages=3, split_grid=False, block_k=256, decoding="gluon_fp8"),
    BlockConfig(32, 64, num_warps=4, num_stages=3, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(8, 128, num_warps=8, num_stages=3, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(64, 64, num_warps=4, num_stages=3, split_grid=False, block_k=128, decoding="gluon_fp8"),
    BlockConfig(64, 128, num_warps=8, num_stages=2, split_grid=False, block_k=128, decoding="gluon_fp8"),
    # Split-K (one chunk a program, the tile's last program adds the chunks): the narrow weights' one-row tiles.
    BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=True, block_k=256, decoding="gluon_fp8"),
    BlockConfig(8, 64, num_warps=4, num_stages=4, split_grid=True, block_k=128, decoding="gluon_fp8"),
    BlockConfig(16, 128, num_warps=8, num_stages=3, split_grid=True, block_k=128, decoding="gluon_fp8"),
]


@pytest.mark.parametrize(
    "cfg",
    _GLUON_FP8_TILES,
    ids=lambda c: f"m{c.block_m}-w{c.num_warps}-k{c.block_k}-s{c.num_stages}{'-split' if c.split_grid else ''}",
)
def test_gluon_fp8_gemm_equals_the_split_swap_fp8_tile(cfg: BlockConfig) -> None:
    """The Gluon FP8 GEMM adds the weight shape's K chunks in one program: the bits of the split swap_fp8 tile (the
    batch-invariant mode's) for 200 rows, for a row alone and for 8 rows, within the reference's bound with the FP8
    MMA's per-group term; N (1,000) is no multiple of the tile, K (4,096) 16 chunks."""
    m, n = 200, 1000
    inputs, magnitude, _ = _fp8_mma_case("fp8_block_gemm", m, exact=False, seed=91)
    x, w_q, w_scale = inputs[0], inputs[1][:n].contiguous(), inputs[2][: -(-n // 32)].contiguous()
    impl = implementation("fp8_block_gemm", Backend.NVIDIA)

    def run(rows: torch.Tensor, tile: BlockConfig) -> torch.Tensor:
        out = torch.zeros(rows.shape[0], n, dtype=torch.bfloat16, device="cuda")
        impl(rows, w_q, w_scale, out, config=tile)
        return out

    swap = run(x, _SWAP_TILES[0])
    fast = run(x, cfg)
    ref = _run("fp8_block_gemm", Backend.REFERENCE, m, n, x, w_q, w_scale)
    assert_gemm_close(fast, ref, magnitude[:, :n], _K, group_accumulation=2.0**-8)
    assert torch.equal(fast, swap)
    assert torch.equal(run(x[5:6], cfg)[0], swap[5])
    assert torch.equal(run(x[100:108], cfg), swap[100:108])


def test_gluon_fp8_grouped_gemm_equals_the_swap_fp8_tile() -> None:
    """The attention's wo_a shape (8 groups of [1024, 4096] weight rows, each on its own 4,096 activation columns, FP32
    output) on Gluon tiles: within the FP32 bound and the swap_fp8 tile's bits."""
    for cfg in (_GLUON_FP8_TILES[0], _GLUON_FP8_TILES[4], _GLUON_FP8_TILES[8]):
        _check_grouped_wo_a(300, (11, 12, 13), config=cfg)
    groups, n, m = 8, 8192, 64
    x = torch.randn((m, groups * _K), generator=_generator(14), device="cuda").to(torch.bfloat16)
    w_q = (_bytes((n, _K), seed=15) & 0xF7).view(torch.float8_e4m3fn)
    w_scale = _bytes((n // 32, _K // 32), 16, 118, 127).view(torch.float8_e8m0fnu)
    results = []
    for cfg in (_GLUON_FP8_TILES[1], _SWAP_TILES[0]):
        out = torch.zeros(m, n, dtype=torch.float32, device="cuda")
        implementation("fp8_block_grouped_gemm", Backend.NVIDIA)(x, w_q, w_scale, out, config=cfg)
        results.append(out)
    assert torch.equal(results[0], results[1])
