"""The batch-invariant products (docs/design/numerics.md, "Batch invariance"): the fixed-tile Triton matmul against
the FP64 reference on fresh random inputs, a row's bits independent of the other rows, the aten product ops the
dispatch mode routes to it, and the tile pinning ``batch_invariant_ops`` turns on.

Tolerance of the Triton matmul: FP32 accumulation of exact (BF16/FP16) or FP32-rounded products over K terms, so
``|actual − reference| ≤ K · 2^-23 · Σ|a||b|`` before the output rounding, plus half an ulp of the output dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops, invariant_kernels
from deepinfer_kernels.invariant_products import invariant_matmul, invariant_product
from deepinfer_kernels.testing import random_normal

_HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _triton(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=dtype, device=device)
    implementation("invariant_matmul", Backend.NVIDIA)(a.to(device), b.to(device), out)
    return out.cpu()


@pytest.mark.parametrize(
    ("batches", "m", "n", "k"),
    [(1, 1, 5, 7), (2, 70, 65, 130), (3, 17, 130, 64), (1, 3, 1, 1), (1, 3, 40, 1090), (1, 70, 40, 1090)],
)
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
def test_triton_matmul_matches_the_fp64_reference(
    triton_device: str, batches: int, m: int, n: int, k: int, in_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    a = random_normal((batches, m, k), seed=m * 31 + k, dtype=in_dtype)
    b = random_normal((batches, n, k), seed=n * 17 + k, dtype=in_dtype).transpose(1, 2)  # strided, like w.t()
    expected = torch.empty((batches, m, n), dtype=out_dtype)
    implementation("invariant_matmul", Backend.REFERENCE)(a, b, expected)
    actual = _triton(a, b, out_dtype, triton_device)
    magnitude = torch.bmm(a.double().abs(), b.double().abs())
    bound = k * 2.0**-23 * magnitude + _HALF_ULP[out_dtype] * 2 * expected.double().abs() + 1e-30
    assert ((actual.double() - expected.double()).abs() <= bound).all()


def test_a_tile_of_rows_has_the_same_bits_alone_and_in_any_batch(triton_device: str) -> None:
    """Rows keep their bits whatever the row count. The interpreter's ``tl.dot`` is NumPy's BLAS, which rounds a row
    differently by its position inside the tile and by the tile's width, so here rows keep their in-tile position (a
    slice starting at a tile boundary) and their tile width (up to 16 rows, or more); ``test_gpu_batch_invariant_ops``
    checks every position and row count on the GPU."""
    from deepinfer_kernels.cuda.invariant_matmul import ROW_TILES

    a = random_normal((1, 150, 300), seed=1, dtype=torch.bfloat16)
    b = random_normal((1, 300, 40), seed=2, dtype=torch.bfloat16)
    few = ROW_TILES[0].block_m
    together = {
        "few": _triton(a[:, :few], b, torch.float32, triton_device),
        "many": _triton(a, b, torch.float32, triton_device),
    }
    slices = {"few": ((0, 1), (0, 7)), "many": ((64, 150), (0, 100), (0, few + 1), (128, 150))}
    for tile, bounds in slices.items():
        for start, stop in bounds:
            alone = _triton(a[:, start:stop], b, torch.float32, triton_device)
            assert torch.equal(alone, together[tile][:, start:stop]), (start, stop)


@pytest.mark.parametrize("m", [3, 40])
def test_k_chunks_as_programs_give_the_bits_of_one_program(
    triton_device: str, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-batch product of few columns sums K in chunks (a weight's shape fixes them: K = 1,090 by 40 columns makes
    three chunks of 320 and one of 130), each its own program, the chunk sums added in order by the tile's last
    program (3 rows) or by a second launch (40 rows); two batch entries run one program per tile over the same chunks.
    All give the same bits, twice in a row (the tickets are back to zero), and a product with none to split gives
    zeros."""
    from deepinfer_kernels.cuda import invariant_matmul as module
    from deepinfer_kernels.cuda.gemm_operands import split_counters

    n, k = 40, 1090
    assert module.k_chunk(n, k) == 320
    tickets: list[int] = []
    sum_grids: list[tuple[int, ...]] = []

    def counting(device: torch.device, tiles: int) -> torch.Tensor:
        tickets.append(tiles)
        return split_counters(device, tiles)

    class RecordingLaunches:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            sum_grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(module, "split_counters", counting)
    monkeypatch.setattr(module, "_chunk_sums_kernel", RecordingLaunches(module._chunk_sums_kernel))
    a = random_normal((1, m, k), seed=m, dtype=torch.bfloat16)
    b = random_normal((1, n, k), seed=m + 1, dtype=torch.bfloat16).transpose(1, 2)
    split = [_triton(a, b, torch.float32, triton_device) for _ in range(2)]
    in_tile = m <= module._TILE_FINISH_MAX_ROWS
    assert tickets == ([1, 1] if in_tile else []) and sum_grids == ([] if in_tile else [(2,), (2,)])
    assert not split_counters(torch.device(triton_device), 0).any()
    batched = _triton(a.expand(2, m, k), b.expand(2, k, n), torch.float32, triton_device)
    assert len(tickets) + len(sum_grids) == 2
    assert (
        torch.equal(split[0], split[1]) and torch.equal(split[0][0], batched[0]) and torch.equal(batched[0], batched[1])
    )
    assert torch.equal(_triton(a[..., :0], b[:, :0], torch.float32, triton_device), torch.zeros(1, m, n))


def test_the_public_op_checks_its_inputs() -> None:
    a = torch.ones(2, 3)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        invariant_matmul(a, torch.ones(4, 5))
    with pytest.raises(ValueError, match="2-D or both 3-D"):
        invariant_matmul(a, torch.ones(1, 3, 5))
    with pytest.raises(TypeError):
        invariant_matmul(a.long(), torch.ones(3, 5))
    assert invariant_matmul(a, torch.ones(3, 5), torch.bfloat16).dtype == torch.bfloat16


def _inputs() -> dict[str, torch.Tensor]:
    return {
        "a": random_normal((4, 6), seed=3),
        "b": random_normal((6, 5), seed=4),
        "bias": random_normal((5,), seed=5),
        "a3": random_normal((2, 4, 6), seed=6),
        "b3": random_normal((2, 6, 5), seed=7),
        "v": random_normal((6,), seed=8),
    }


def test_every_routed_aten_product_gives_torch_s_result() -> None:
    t = _inputs()
    aten = torch.ops.aten
    cases = [
        (aten.mm.default, (t["a"], t["b"]), {}, t["a"] @ t["b"]),
        (aten.bmm.default, (t["a3"], t["b3"]), {}, t["a3"] @ t["b3"]),
        (
            aten.addmm.default,
            (t["bias"], t["a"], t["b"]),
            {"beta": 2, "alpha": 0.5},
            2 * t["bias"] + 0.5 * t["a"] @ t["b"],
        ),
        (aten.baddbmm.default, (t["b3"][:, :4], t["a3"], t["b3"]), {}, t["b3"][:, :4] + t["a3"] @ t["b3"]),
        (aten.mv.default, (t["a"], t["v"]), {}, t["a"] @ t["v"]),
        (aten.dot.default, (t["v"], t["v"]), {}, t["v"] @ t["v"]),
    ]
    for func, args, kwargs, expected in cases:
        actual = invariant_product(func, args, kwargs, torch.float32)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=str(func))
    nan_bias = torch.full((5,), float("nan"))
    assert (
        not invariant_product(aten.addmm.default, (nan_bias, t["a"], t["b"]), {"beta": 0}, torch.float32).isnan().any()
    )


def test_out_and_in_place_overloads_write_their_tensor() -> None:
    t = _inputs()
    out = torch.empty(4, 5)
    returned = invariant_product(torch.ops.aten.mm.out, (t["a"], t["b"]), {"out": out}, torch.float32)
    assert returned is out
    torch.testing.assert_close(out, t["a"] @ t["b"], rtol=1e-5, atol=1e-5)
    target = t["bias"].expand(4, 5).clone()
    expected = target + t["a"] @ t["b"]
    assert invariant_product(torch.ops.aten.addmm_.default, (target, t["a"], t["b"]), {}, torch.float32) is target
    torch.testing.assert_close(target, expected, rtol=1e-5, atol=1e-5)


def test_the_mode_pins_the_kernel_choices(triton_device: str) -> None:
    from deepinfer_kernels.cuda import attention, gemm_tiles

    assert not invariant_kernels()
    default_small, default_large = (
        gemm_tiles.block_config("mxfp4_gemm", 1, 4608, 5120),
        gemm_tiles.block_config("mxfp4_gemm", 512, 4608, 5120),
    )
    assert default_small.gemv and default_small.block_m != default_large.block_m
    default_chunk, default_splits = attention._split_plan(1, [4096], 16, torch.device(triton_device))
    assert sum(default_splits) > 1 and default_chunk != attention.INVARIANT_CHUNK_KEYS
    with batch_invariant_ops():
        assert invariant_kernels()
        # Dense GEMMs: swap_fp8 tiles, or for the FP8 GEMM the Gluon tiles that add the same chunks in one program,
        # whose rows keep their bits in any of them (the GPU tests check it), in the K chunks of the weight's shape;
        # the grouped GEMM: its one gluon_fp8 tile.
        rows_seen = (1, 2, 16, 64, 65, 256, 4096)
        for op in ("fp8_block_gemm", "mxfp4_gemm"):
            for n, k in ((4608, 5120), (512, 5120), (5120, 2304), (25600, 6144)):
                configs = {gemm_tiles.block_config(op, rows, n, k) for rows in rows_seen}
                assert {c.decoding for c in configs} <= (
                    {"swap_fp8", "gluon_fp8"} if op == "fp8_block_gemm" else {"swap_fp8"}
                )
                assert len({gemm_tiles.chunk_length(n, k, c) for c in configs}) == 1
            if op == "fp8_block_gemm":
                assert gemm_tiles.block_config(op, 256, 4608, 5120).decoding == "gluon_fp8"
                assert gemm_tiles.block_config(op, 1, 25600, 6144).decoding == "gluon_fp8"
                # Split-K (the same bits) only up to 64 rows: a prefill's FP32 partials would take C × M × N × 4 bytes.
                assert not any(gemm_tiles.block_config(op, rows, n, k).split_grid for rows in (65, 256, 4096))
        grouped = {gemm_tiles.block_config("mxfp4_grouped_gemm", rows, 4608, 5120) for rows in rows_seen}
        assert grouped == {gemm_tiles.invariant_config("mxfp4_grouped_gemm", 1)}
        assert next(iter(grouped)).decoding == "gluon_fp8"
        # Chunks of fixed keys from each source's start whatever the queries: split over programs, or (queries that
        # fill the device) added in one program.
        assert attention._split_plan(1, [4096], 16, torch.device(triton_device)) == (128, [32])
        assert attention._split_plan(1, [128, 3, 300], 16, torch.device(triton_device)) == (128, [1, 1, 3])
        assert attention._split_plan(10_000, [4096], 16, torch.device(triton_device)) == (128, [])
    assert not invariant_kernels()
    _registry.reset()


def test_batches_past_the_grid_limit_run_in_several_launches(
    triton_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deepinfer_kernels.cuda import invariant_matmul as kernel

    a = random_normal((5, 3, 20), seed=9, dtype=torch.bfloat16)
    b = random_normal((5, 20, 7), seed=10, dtype=torch.bfloat16)
    whole = _triton(a, b, torch.float32, triton_device)
    monkeypatch.setattr(kernel, "_MAX_GRID_Z", 2)
    assert torch.equal(_triton(a, b, torch.float32, triton_device), whole)


def _bytes(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("op", ["fp8_block_gemm", "mxfp4_gemm"])
def test_pinned_quantized_gemm_rows_keep_their_bits_across_split_k(triton_device: str, op: str) -> None:
    """Inside the mode 64 rows run split-K and 65 rows do not (two K chunks here); tile-aligned rows agree bitwise
    with each other and with a 1-row call."""
    n, k = 64, 512
    if op == "fp8_block_gemm":
        weight = ((_bytes((n, k), 11) & 0xF7).view(torch.float8_e4m3fn), _bytes((n // 32, k // 32), 12, 118, 127))
    else:
        weight = (_bytes((n, k // 2), 13).view(torch.int8), _bytes((n, k // 32), 14, 118, 127))
    w, scale = weight[0].to(triton_device), weight[1].view(torch.float8_e8m0fnu).to(triton_device)
    x = random_normal((65, k), seed=15, dtype=torch.bfloat16).to(triton_device)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.shape[0], n, dtype=torch.bfloat16, device=triton_device)
        implementation(op, Backend.NVIDIA)(rows, w, scale, out)
        return out

    with batch_invariant_ops():
        unsplit, split, alone = run(x), run(x[:64]), run(x[:1])
    assert torch.equal(unsplit[:64], split)
    assert torch.equal(alone[0], split[0])
