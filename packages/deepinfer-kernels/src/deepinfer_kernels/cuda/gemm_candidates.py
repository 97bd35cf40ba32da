"""The tiles ``benchmarks/kernels_gemm.py --tune`` times for the Triton quantized GEMMs: per op and row bucket, the
default tile first, then every other decoding and tile shape (docs/design/kernels.md, "GEMM tiles and split-K"). The
tables the launchers read, and the tile constructors, are in ``cuda.gemm_tiles``."""

from __future__ import annotations

from dataclasses import replace

from deepinfer_kernels.cuda.gemm_tiles import (
    DEQUANT_BF16_TILE,
    SHARED_PER_PROGRAM,
    BlockConfig,
    decodings,
    default_config,
    default_decoding,
    gemv_tile,
    gluon_bf16_tile,
    gluon_fp8_tile,
    gluon_shared_bytes,
    mma_tile,
    swap_bf16_tile,
    swap_on_wgmma,
)

__all__ = ["candidate_configs"]


def _bf16_swap_candidates(tiles: tuple[tuple[int, ...], ...]) -> list[BlockConfig]:
    # BF16 weight-first tiles (block_m, block_n, warps[, tail_m]) on a BF16 copy of the activation, K in the MMA's
    # accumulator (cuda.swap_bf16).
    return [swap_bf16_tile(tile[0], tile[1], tile[2], tail_m=tile[3] if len(tile) > 3 else 0) for tile in tiles]


def candidate_configs(op: str, rows: int) -> list[BlockConfig]:
    """The tiles ``benchmarks/kernels_gemm.py --tune`` times for a row bucket: the default first, then its tiles
    with every other decoding, then other tile shapes with every decoding (MMA tiles), so a default that changes
    is always timed against the one before it."""
    default = default_config(op, rows)
    # The Gluon kernels' and swap_bf16's tiles are tied to their warps and dequant_bf16 has no tile: they are added
    # below.
    own_tiles = ("gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16")
    others = () if default.gemv else tuple(d for d in decodings(op) if d not in (default.decoding, *own_tiles))
    kinds = (default.decoding, *others)
    out = [
        replace(default, decoding=decoding)
        for decoding in kinds
        if decoding != "swap_fp8" or swap_on_wgmma(default.block_m, default.block_n, default.num_warps)
    ]
    if rows > 64:
        # FP8 tensor-core tiles (group_fp8) without spills on sm_90 (Triton's register counts, 242–254 per thread).
        fp8_tiles = (
            (128, 128, 8, 3, 64),
            (128, 128, 8, 4, 32),
            (128, 64, 4, 4, 64),
            (64, 256, 8, 3, 64),
            (64, 128, 4, 4, 64),
        )
        more = [
            mma_tile(block_m, block_n, num_warps, num_stages, split_grid=False, decoding="group_fp8", block_k=block_k)
            for block_m, block_n, num_warps, num_stages, block_k in fp8_tiles
        ]
        if rows > 256:  # the default before group_fp8
            more.append(mma_tile(128, 128, 8, 3, split_grid=False, decoding=default_decoding(op)))
        if op != "mxfp4_grouped_gemm":
            more += _swap_candidates(rows)
        if op == "fp8_block_gemm":
            more += _gluon_fp8_candidates(rows)
            more.append(DEQUANT_BF16_TILE)
            # The FP8 weight decoded in registers against x̂: 90–251 registers, no spills (sm_90 cubin, num_stages 1).
            more += _bf16_swap_candidates(((64, 128, 8), (128, 128, 8), (256, 128, 8), (64, 64, 4), (128, 64, 4)))
        if op == "mxfp4_grouped_gemm":
            more += _bf16_swap_candidates(((64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 64, 4)))
            # An expert's last few rows in tail tiles (gemm_tiles.BlockConfig.tail_m): at 128 rows an expert about
            # half the experts of random routing have 1–32 rows past a whole tile, which took a 128-row tile each.
            more += _bf16_swap_candidates(((128, 128, 8, 16), (128, 128, 8, 32), (64, 128, 8, 16)))
            # Deeper cp.async pipelines: long-scoreboard waits were 2.0 cycles an issued instruction at three stages
            # (docs/design/kernels.md, "Tail tiles"); four and five stages keep 125 registers (two programs a
            # multiprocessor) with 78 and 99 KB of shared memory (offline sm_90; not yet timed).
            more += [swap_bf16_tile(128, 128, 8, tail_m=32, num_stages=stages) for stages in (4, 5)]
            # The same sums in the Gluon ring kernel (cuda.grouped_bf16_wgmma): 64 or 128 rows, one or two
            # warpgroups, 128-column K steps (at most 231,424 bytes of shared memory, no spills: 170 registers for
            # 128 × 128 with four slots, offline sm_90).
            more += [
                gluon_bf16_tile(block_m, num_warps, 128, num_stages)
                for block_m, num_warps, num_stages in ((128, 8, 4), (128, 8, 3), (64, 8, 4), (128, 4, 4), (64, 4, 4))
            ]
        return out + [cfg for cfg in more if cfg not in out]
    if op == "mxfp4_grouped_gemm" and rows > 16:
        out += _bf16_swap_candidates(((32, 128, 8), (64, 128, 8), (32, 64, 4), (64, 64, 4)))
        out += _bf16_swap_candidates(((32, 128, 8, 16), (64, 128, 8, 16), (64, 64, 4, 16)))
    if op == "fp8_block_gemm":
        # The FP8 weight decoded in registers against x̂, split-K in the weight shape's chunks (few rows give few
        # programs otherwise).
        block_m = 16 if rows <= 16 else 64
        out += [swap_bf16_tile(block_m, block_n, warps, split_grid=True) for block_n, warps in ((64, 4), (128, 8))]
        out += _gluon_fp8_candidates(rows)
    shapes: tuple[tuple[int, int, int], ...]
    if default.gemv:
        shapes = ((32, 4, 2), (32, 4, 4), (64, 4, 3), (64, 8, 3), (16, 4, 3))
    else:
        shapes = ((32, 4, 4), (32, 4, 6), (64, 8, 4), (128, 4, 4))
    for block_n, num_warps, num_stages in shapes:
        for decoding in kinds:
            if decoding == "swap_fp8" and not swap_on_wgmma(default.block_m, block_n, num_warps):
                continue
            cfg = BlockConfig(
                default.block_m, block_n, num_warps, num_stages, split_grid=True, gemv=default.gemv, decoding=decoding
            )
            if cfg not in out:
                out.append(cfg)
    if default.gemv and op != "mxfp4_grouped_gemm":
        # Narrow FMA tiles with every K chunk in one program: enough programs without split-K on wide weights, and no
        # partial sums in memory (the same bits either way). Wide ones: a thread's activation work serves more weight
        # rows, 4.2 and 4.6 SASS instructions a weight element against 6.2 for 32 × 128 at one quantizing row
        # (offline sm_90, kernels_sass-sm90-gemv-tiles.json; fewer programs, not yet timed).
        out += [gemv_tile(block_n, num_warps, 3, split_grid=False) for block_n, num_warps in ((8, 2), (16, 4))]
        out += [gemv_tile(128, 4, 3), replace(gemv_tile(64, 4, 3), block_k=256)]
    if op == "mxfp4_grouped_gemm" and rows <= 16:
        # 128- and 256-column tiles (the fastest at 1, 64 and 256 tokens on the grouped GEMM), weight-first, with a
        # 64-column K step (fewer registers per thread: 127 against 206 for the scaled 16×128 tile, sm_90 cubin) or on
        # the FP8 tensor cores.
        wide = [
            mma_tile(16, 128, 4, 4, block_k=64),
            mma_tile(16, 128, 4, 4, decoding="swap_ab", block_k=64),
            mma_tile(16, 128, 4, 3, decoding="swap_ab"),
            mma_tile(16, 128, 8, 3, decoding="swap_ab"),
            mma_tile(16, 256, 8, 3, decoding="swap_ab"),
            # FP8 tensor cores (K as one chunk, so no split-K): 128 and 140 registers against 158 (sm_90 cubin).
            mma_tile(16, 128, 4, 4, split_grid=False, decoding="group_fp8", block_k=64),
            mma_tile(16, 256, 8, 4, split_grid=False, decoding="group_fp8", block_k=64),
            # The same transposed: FP8 wgmma instead of FP16 mma.sync, 4.5 instead of 7.1 SASS instructions per weight
            # element in the K loop of the 16 × 128 tile (offline sm_90 compile, kernels_sass-sm90.json).
            mma_tile(16, 128, 4, 4, split_grid=False, decoding="swap_fp8", block_k=64),
            mma_tile(16, 256, 8, 4, split_grid=False, decoding="swap_fp8", block_k=64),
            # The swap_fp8 sums in explicit layouts (cuda.grouped_wgmma): one or two warpgroups, 8 or 16 rows, K steps
            # of four to sixteen groups, rings of two to four slots.
            *(
                gluon_fp8_tile(m, warps, block_k, stages)
                for m, warps, block_k, stages in (
                    (8, 4, 256, 2),
                    (8, 4, 256, 3),
                    (8, 4, 256, 4),
                    (8, 4, 128, 3),
                    (8, 4, 128, 4),
                    (16, 4, 128, 3),
                    (8, 8, 128, 3),
                    (16, 8, 128, 2),
                    (8, 4, 512, 2),
                    (8, 8, 256, 2),
                    (16, 4, 256, 2),
                )
            ),
        ]
        out += [cfg for cfg in wide if cfg not in out]
    if op not in ("mxfp4_grouped_gemm", "bf16_gemm"):  # bf16_gemm runs GEMV tiles only
        out += [cfg for cfg in _swap_candidates(rows) if cfg not in out]
    if op == "mxfp4_grouped_gemm" and rows <= 2:
        # The FMA kernel, not a default for the grouped GEMM, stays a candidate at about one row per expert.
        out += [
            gemv_tile(block_n, num_warps, num_stages) for block_n, num_warps, num_stages in ((32, 4, 3), (64, 4, 3))
        ]
    return out


def _swap_candidates(rows: int) -> list[BlockConfig]:
    """``swap_fp8`` tiles of a dense GEMM for a row bucket: the FP8 ``wgmma`` with 64 or 128 weight rows as its wide
    side and the bucket's rows (16 to 64) as its narrow one, split-K up to 64 rows. With a chunk sum, a group sum and
    a group product in registers, tiles stay at most 64 rows wide."""
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    shapes = ((64, 4, 4, 128), (64, 4, 3, 256), (128, 4, 3, 128), (128, 8, 3, 128))
    return [
        mma_tile(block_m, n, warps, stages, split_grid=rows <= 64, decoding="swap_fp8", block_k=block_k)
        for n, warps, stages, block_k in shapes
    ]


def _gluon_fp8_candidates(rows: int) -> list[BlockConfig]:
    """The dense FP8 GEMM's Gluon tiles (``cuda.fp8_wgmma``, no split-K) for a row bucket: 64 or 128 weight rows by 8
    to 64 tokens, K steps of four or eight groups, rings of two to four slots that fit a program's shared memory."""
    shapes: tuple[tuple[int, int, int, int], ...]
    split: tuple[tuple[int, int, int, int], ...] = ()
    if rows <= 16:
        shapes = ((8, 4, 256, 3), (8, 4, 128, 4), (16, 4, 256, 3), (8, 8, 128, 3), (8, 4, 256, 4))
        # Split-K, one chunk a program: the narrow weights' tiles (N / 64 of them) get programs for every SM.
        split = ((8, 4, 256, 3), (8, 4, 128, 4), (8, 4, 256, 4))
    elif rows <= 64:
        shapes = ((32, 4, 128, 3), (64, 4, 128, 3), (16, 4, 256, 3))
    else:
        shapes = ((64, 4, 128, 3), (64, 8, 128, 2), (64, 4, 256, 2))
    tiles = [gluon_fp8_tile(*shape) for shape in shapes] + [gluon_fp8_tile(*shape, split_grid=True) for shape in split]
    return [cfg for cfg in tiles if gluon_shared_bytes(cfg, weight_bits=8) <= SHARED_PER_PROGRAM]
