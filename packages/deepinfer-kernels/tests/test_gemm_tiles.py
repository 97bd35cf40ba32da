"""Tile choice of the Triton quantized GEMMs (``cuda.gemm_tiles``): pure Python, no device needed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.cuda.gemm_candidates import candidate_configs
from deepinfer_kernels.cuda.gemm_tiles import (
    DECODINGS,
    MEASURED,
    MEASURED_INVARIANT,
    BlockConfig,
    block_config,
    chunk_length,
    decodings,
    default_config,
    gluon_shared_bytes,
    grouped_tile_rows,
    k_chunk,
)

OPS = ("fp8_block_gemm", "mxfp4_gemm", "mxfp4_grouped_gemm")


def test_unknown_decoding_is_rejected_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="scaled_bf16"):
        BlockConfig(16, 64, num_warps=4, num_stages=4, split_grid=True, decoding="fp4_native")


@pytest.mark.parametrize("rows", [1, 2])
def test_bf16_gemm_candidates_are_gemv_tiles_only(rows: int) -> None:
    """bf16_gemm's kernel is the FMA GEMV (it rejects MMA tiles), so the tuner times GEMV tiles alone."""
    candidates = candidate_configs("bf16_gemm", rows)
    assert candidates[0] == default_config("bf16_gemm", rows)
    assert len(candidates) > 1 and all(c.gemv for c in candidates)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows", [1, 2, 16, 64, 256, 4096])
def test_candidates_start_with_the_default_and_time_every_decoding(op: str, rows: int) -> None:
    """The tuner times the default tile first and, for MMA tiles, the default tile in every decoding: a changed
    default is always measured against the one it replaced."""
    default = default_config(op, rows)
    candidates = candidate_configs(op, rows)
    assert candidates[0] == default
    assert len(set(candidates)) == len(candidates)
    if default.gemv:
        # The FMA tiles, and the dense GEMM's swap_fp8 tiles (the batch-invariant mode's at one row), split
        # swap_bf16 tiles and Gluon tiles.
        assert all(c.gemv or c.decoding in ("swap_fp8", "swap_bf16", "gluon_fp8") for c in candidates)
        assert any(c.decoding == "swap_fp8" for c in candidates)
    else:
        # gluon_fp8's tile is tied to its warps (block_n = 16 × num_warps): it has candidates of its own; so is
        # swap_fp8's (a multiple of it). dequant_bf16 has no tile (one candidate, many rows only).
        same_tile = [
            c
            for c in candidates
            if (c.block_m, c.block_n, c.num_warps) == (default.block_m, default.block_n, default.num_warps)
            and c.decoding not in ("gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16")
        ]
        expected = set(decodings(op)) - {"gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16"}
        if default.block_n % (16 * default.num_warps):
            expected -= {"swap_fp8"}
        assert {c.decoding for c in same_tile} == expected


def test_a_swap_fp8_tile_narrower_than_its_wgmma_is_rejected() -> None:
    with pytest.raises(ValueError, match="swap_fp8"):
        BlockConfig(16, 32, num_warps=4, num_stages=4, split_grid=True, decoding="swap_fp8")
    with pytest.raises(ValueError, match="swap_fp8"):
        BlockConfig(16, 64, num_warps=8, num_stages=4, split_grid=True, decoding="swap_fp8")
    with pytest.raises(ValueError, match="swap_fp8"):
        BlockConfig(8, 64, num_warps=4, num_stages=4, split_grid=True, decoding="swap_fp8")


def test_dense_swap_fp8_splits_k_as_the_weight_shape_says_and_the_grouped_one_does_not() -> None:
    swap = BlockConfig(16, 64, num_warps=4, num_stages=4, split_grid=True, decoding="swap_fp8")
    assert chunk_length(512, 5120, swap) == k_chunk(512, 5120) < 5120
    assert chunk_length(512, 5120, swap, grouped=True) == 5120
    assert chunk_length(512, 5120, replace(swap, decoding="group_fp8")) == 5120


def test_measured_entries_win_over_the_default() -> None:
    for (op, bucket, n, k), cfg in MEASURED.items():
        assert block_config(op, bucket, n, k) == cfg
        assert cfg.decoding in decodings(op)


def test_measured_invariant_entries_stand_in_for_measured_tiles_that_are_not_row_independent() -> None:
    """Each batch-invariant entry replaces a measured tile whose rows do not keep their bits (the FMA GEMV) with one of
    the mode's row-independent decodings, and only inside the mode."""
    assert MEASURED_INVARIANT
    for key, cfg in MEASURED_INVARIANT.items():
        op, bucket, n, k = key
        assert MEASURED[key].decoding not in ("swap_fp8", "gluon_fp8")
        assert cfg.decoding in ("swap_fp8", "gluon_fp8")
        assert block_config(op, bucket, n, k) == MEASURED[key]
        with batch_invariant_ops():
            assert block_config(op, bucket, n, k) == cfg
            assert block_config(op, 1, n, k) == cfg


def test_invariant_fp8_one_row_tile_is_the_split_gluon_tile() -> None:
    """Inside the batch-invariant mode the FP8 block GEMM at one or two rows takes the split-K Gluon tile (the split
    swap_fp8 tile's sums) wherever the tuned tile is not row-independent: the GEMV-tuned weights and attn.wo_a, which
    MEASURED does not hold; the exception in MEASURED_INVARIANT and the row-independent tuned tiles stay."""
    from deepinfer_kernels.cuda.gemm_tiles import _INVARIANT_ONE_ROW

    assert _INVARIANT_ONE_ROW.decoding == "gluon_fp8" and _INVARIANT_ONE_ROW.split_grid
    gemv_tuned = [key for key, cfg in MEASURED.items() if key[:2] == ("fp8_block_gemm", 2) and cfg.gemv]
    assert len(gemv_tuned) >= 5
    with batch_invariant_ops():
        for _, _, n, k in gemv_tuned:
            expected = MEASURED_INVARIANT.get(("fp8_block_gemm", 2, n, k), _INVARIANT_ONE_ROW)
            assert block_config("fp8_block_gemm", 1, n, k) == expected
            assert block_config("fp8_block_gemm", 2, n, k) == expected
        assert block_config("fp8_block_gemm", 1, 8192, 4096) == _INVARIANT_ONE_ROW  # attn.wo_a, 8 groups
        for key, cfg in MEASURED.items():
            if key[:2] == ("fp8_block_gemm", 2) and cfg.decoding == "gluon_fp8":
                assert block_config(*key) == cfg
        assert block_config("fp8_block_gemm", 3, 8192, 4096).decoding == "swap_fp8"
    assert block_config("fp8_block_gemm", 1, 8192, 4096).gemv


def test_weight_first_tiles_are_mxfp4_candidates_only() -> None:
    """``swap_ab`` is an MXFP4 kernel's decoding, never the FP8 GEMM's; the grouped GEMM tries it at few rows per
    expert (the dense MXFP4 GEMM's 1-2 rows take the FMA kernel)."""
    assert set(DECODINGS) - set(decodings("fp8_block_gemm")) == {"swap_ab", "gluon_bf16"}
    assert set(DECODINGS) - set(decodings("mxfp4_gemm")) == {"gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16"}
    assert set(DECODINGS) - set(decodings("mxfp4_grouped_gemm")) == {"dequant_bf16"}
    for op in OPS:
        has_swap = any(c.decoding == "swap_ab" for c in candidate_configs(op, 1))
        assert has_swap == (op == "mxfp4_grouped_gemm")


@pytest.mark.parametrize(
    ("m", "experts", "rows"),
    [(6, 384, 1), (64, 384, 1), (65, 384, 16), (384, 384, 16), (1536, 384, 16), (49152, 384, 128), (600, 16, 38)],
)
def test_grouped_calls_beyond_the_split_rows_use_at_least_the_16_row_bucket(m: int, experts: int, rows: int) -> None:
    """Up to 64 rows a grouped call's tiles follow its mean rows per expert (the split-K tiles of a single token);
    beyond, at least the 16-row bucket's (the gluon_fp8 tile at 64 tokens), whatever the mean."""
    assert grouped_tile_rows(m, experts) == rows
    if m > 64 and rows <= 16:
        assert block_config("mxfp4_grouped_gemm", rows, 4608, 5120).decoding == "gluon_fp8"


def test_gluon_tiles_are_grouped_and_fp8_candidates_only() -> None:
    """The explicit-layout kernels serve the grouped MXFP4 GEMM at few rows per expert and the FP8 block GEMM at every
    row count (not the dense MXFP4 GEMM); their tiles are checked."""
    assert set(DECODINGS) - set(decodings("mxfp4_gemm")) == {"gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16"}
    for op in OPS:
        for rows in (1, 16, 64, 256):
            gluon = [c for c in candidate_configs(op, rows) if c.decoding == "gluon_fp8"]
            assert bool(gluon) == (op == "fp8_block_gemm" or (op == "mxfp4_grouped_gemm" and rows <= 16)), (op, rows)
            assert all(c.block_n == 16 * c.num_warps for c in gluon)
            # Split-K Gluon tiles: the dense FP8 GEMM's few-row ones only (the grouped kernel sums K in one program).
            split = any(c.split_grid for c in gluon)
            assert split == (op == "fp8_block_gemm" and rows <= 16), (op, rows)
    with pytest.raises(ValueError, match="gluon_fp8 tile has block_n = 16 × num_warps"):
        BlockConfig(16, 128, num_warps=4, num_stages=1, split_grid=False, decoding="gluon_fp8")
    with pytest.raises(ValueError, match="at least 2"):
        BlockConfig(8, 64, num_warps=4, num_stages=1, split_grid=False, block_k=256, decoding="gluon_fp8")
    with pytest.raises(ValueError, match="block_k in"):
        BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=False, block_k=64, decoding="gluon_fp8")


def test_gluon_rings_fit_a_programs_shared_memory() -> None:
    """A ring slot holds a K step of weight bytes, codes and scale bytes (the 8 × 64 tile with a 256-column step: 8,192
    + 2,048 + 512 + 64 bytes); every candidate ring fits Hopper's 227 KiB a program, a larger one is refused."""
    tile = BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=False, block_k=256, decoding="gluon_fp8")
    assert gluon_shared_bytes(tile) == 3 * (8192 + 2048 + 512 + 64)
    for rows in (2, 16):
        for cfg in candidate_configs("mxfp4_grouped_gemm", rows):
            if cfg.decoding == "gluon_fp8":
                assert gluon_shared_bytes(cfg) <= 227 * 1024, cfg
    for rows in (1, 16, 64, 256):
        for cfg in candidate_configs("fp8_block_gemm", rows):
            if cfg.decoding == "gluon_fp8":
                assert gluon_shared_bytes(cfg, weight_bits=8) <= 227 * 1024, cfg
    with pytest.raises(ValueError, match="shared memory"):
        BlockConfig(32, 128, num_warps=8, num_stages=5, split_grid=False, block_k=512, decoding="gluon_fp8")


def test_gluon_bf16_tiles_are_grouped_prefill_candidates_that_fit() -> None:
    """The BF16 ring kernel (cuda.grouped_bf16_wgmma) is a candidate of the grouped GEMM beyond 64 rows per expert
    only, with 16 weight rows a warp and K in one program; its shared memory (the 128 × 128 tile with four slots:
    8,192 + 512 + 32,768 bytes a slot, two decoded K steps of 32,768) fits a Hopper program, a larger one is refused,
    as is a tile the kernel does not have."""
    for op in OPS:
        for rows in (1, 16, 64, 65, 256, 8192):
            found = [c for c in candidate_configs(op, rows) if c.decoding == "gluon_bf16"]
            assert bool(found) == (op == "mxfp4_grouped_gemm" and rows > 64), (op, rows)
            for cfg in found:
                assert cfg.block_n == 16 * cfg.num_warps and not cfg.split_grid
                assert gluon_shared_bytes(cfg) <= 227 * 1024, cfg
    tile = BlockConfig(128, 128, num_warps=8, num_stages=4, split_grid=False, block_k=128, decoding="gluon_bf16")
    assert gluon_shared_bytes(tile) == 4 * (8192 + 512 + 32768) + 2 * 32768
    with pytest.raises(ValueError, match="shared memory"):
        BlockConfig(128, 128, num_warps=8, num_stages=5, split_grid=False, block_k=128, decoding="gluon_bf16")
    with pytest.raises(ValueError, match="at least 3"):
        BlockConfig(64, 128, num_warps=8, num_stages=2, split_grid=False, block_k=128, decoding="gluon_bf16")
    with pytest.raises(ValueError, match="block_m in"):
        BlockConfig(16, 128, num_warps=8, num_stages=3, split_grid=False, block_k=128, decoding="gluon_bf16")


def test_dequantized_bf16_is_an_fp8_candidate_for_many_rows_only() -> None:
    """The cuBLAS path dequantizes the weight on every call (5 bytes an element read or written instead of 1), which
    only many rows repay: it is a candidate of the FP8 block GEMM beyond 64 rows, of no other op, never split."""
    for op in OPS:
        for rows in (1, 16, 64, 256, 8192):
            found = [c for c in candidate_configs(op, rows) if c.decoding == "dequant_bf16"]
            assert len(found) == (op == "fp8_block_gemm" and rows > 64)
    assert block_config("fp8_block_gemm", 8192, 5120, 8192).decoding == "dequant_bf16"
    assert block_config("mxfp4_grouped_gemm", 8192, 4608, 5120).decoding == "group_fp8"
    with pytest.raises(ValueError, match="dequant_bf16"):
        BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=True, decoding="dequant_bf16")


def test_bf16_swap_tiles_are_candidates_of_many_rows() -> None:
    """``swap_bf16`` (a BF16 copy of the activation, in expert order for the grouped GEMM) is a grouped candidate
    beyond 16 rows per expert, never split, and an FP8 one at every row count, split-K up to 64 rows; never the dense
    MXFP4 GEMM's. Its weight rows are the wgmma's 64-row side."""
    for op in OPS:
        for rows in (1, 16, 17, 64, 65, 256, 8192):
            found = [c for c in candidate_configs(op, rows) if c.decoding == "swap_bf16"]
            expected = op == "fp8_block_gemm" or (op == "mxfp4_grouped_gemm" and rows >= 17)
            assert bool(found) == expected
            assert all(c.block_n % (16 * c.num_warps) == 0 for c in found)
            if op == "fp8_block_gemm":
                assert any(c.split_grid for c in found) == (rows <= 64)
            else:
                assert not any(c.split_grid for c in found)
    with pytest.raises(ValueError, match="swap_bf16"):
        BlockConfig(64, 64, num_warps=8, num_stages=3, split_grid=False, decoding="swap_bf16")
