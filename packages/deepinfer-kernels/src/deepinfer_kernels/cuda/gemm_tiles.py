"""Tile choice of the Triton quantized GEMMs: K chunks per weight shape, tiles per (row bucket, N, K)
(docs/design/kernels.md, "GEMM tiles and split-K").

The reduction runs in fixed K chunks: each chunk is summed from zero in FP32, then the chunk sums are added in chunk
order. The chunk length depends only on the weight's shape ``(N, K)`` and the K step is the same for every tile, so
the order of every FP32 addition of an output element is the same whatever the row count M, the tile, or whether the
chunks run in separate programs (split-K, the sums added in chunk order by each tile's last program) or one after
another in one program. Results are therefore identical run to run and, for a given MMA instruction, independent of M.
The ``group_fp8`` decoding sums K as one chunk (:func:`chunk_length`).

Few rows (decode) make a GEMM weight-bandwidth bound: the weight stream must be spread over many more programs than
the H200's 132 SMs, which needs split-K because ``N / BLOCK_N`` alone is often small (N = 512 … 5120). Many rows use
large tiles and keep the chunks inside one program (no FP32 partials in memory).

One or two rows per weight (batch-1 decode) use the FMA kernels of ``cuda.gemv``: they read the weight once and never
move it into an MMA operand layout, which made the 1-row GEMMs about 1.7–2.5× faster than split-K MMA tiles on the
H200; each further row costs them a full pass of FMAs, so from 3 rows on the MMA tiles are faster.
The grouped GEMM always uses MMA tiles (its FMA variant was slower at every batch measured).

Tiles per shape come from :data:`MEASURED` (filled from ``benchmarks/kernels_gemm.py --tune`` on the H200), else from
:func:`default_config`. The lookup is pure Python on ints: nothing synchronizes, so launches stay CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_kernels.batch_invariant import invariant_kernels

__all__ = [
    "BLOCK_K",
    "DECODINGS",
    "DEQUANT_BF16_TILE",
    "GLUON_BLOCK_K",
    "GROUPED_SPLIT_MAX_ROWS",
    "MEASURED",
    "SHARED_PER_PROGRAM",
    "BlockConfig",
    "block_config",
    "chunk_length",
    "decodings",
    "default_config",
    "default_decoding",
    "gemv_tile",
    "gluon_bf16_tile",
    "gluon_fp8_tile",
    "gluon_shared_bytes",
    "grouped_tile_rows",
    "invariant_config",
    "k_chunk",
    "mma_tile",
    "row_bucket",
    "swap_bf16_tile",
    "swap_fp8_tile",
    "swap_on_wgmma",
]

BLOCK_K = 128
# Programs a decode GEMM should have at least (about 8 per SM of an H200); sets the chunk count.
_DECODE_PROGRAMS = 1024
_CHUNK_ALIGN = 256
_DECODE_BLOCK_N = 32
_BUCKETS = (2, 16, 32, 64, 256)
# Above this many rows a grouped GEMM's touched experts alone give enough programs: its K chunks stay inside one
# program, which keeps the FP32 partials (C × M × N) out of memory. Either way the sums are the same bits.
GROUPED_SPLIT_MAX_ROWS = 64
# Beyond GROUPED_SPLIT_MAX_ROWS rows a grouped GEMM's tiles are at least this bucket's, however few rows per expert.
_UNSPLIT_MIN_BUCKET = 16
DECODINGS = (
    "scaled_bf16",
    "dot_scaled",
    "group_fp16",
    "group_fp8",
    "swap_fp8",
    "swap_ab",
    "gluon_fp8",
    "dequant_bf16",
    "swap_bf16",
    "gluon_bf16",
)
# K steps of a gluon_fp8 tile: at least four groups, so that a row's scale bytes of a step are one 4-byte cp.async.
GLUON_BLOCK_K = (128, 256, 512)
# Shared memory one program can have on Hopper (227 KiB).
SHARED_PER_PROGRAM = 232448
# Rows of a grouped swap_bf16 GEMM's tail tiles: at least the 16 its wgmma needs, a power of two for Triton.
_TAIL_ROWS = (16, 32, 64)
# Rows of a gluon_fp8 tile's block_n per warp (a warpgroup's 4 warps make the wgmma's 64-row register operand).
_GLUON_ROWS_PER_WARP = 16


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch options of one GEMM launch.

    ``split_grid`` runs each K chunk in its own program; ``gemv`` selects the FMA kernels of ``cuda.gemv`` (then
    ``block_m`` is the most rows a program takes) instead of the MMA kernels of ``cuda.gemm``; ``decoding`` (MMA
    tiles only) is how operands reach the tensor cores, one of :data:`DECODINGS`:

    - ``"scaled_bf16"``: the kernel decodes both operands from their bits and scales them into BF16, one MMA per K
      step;
    - ``"dot_scaled"``: ``tl.dot_scaled`` decodes the stored codes with their scales;
    - ``"group_fp16"``: the kernel decodes unscaled FP16 operands (cheap: no scaling, no FP32 round trip), one MMA
      per 32-column group, and scales each group's FP32 sum by the two power-of-two factors;
    - ``"group_fp8"``: as ``group_fp16`` on the FP8 tensor cores (twice the FP16 MMA rate): the e4m3 codes are the
      operands as stored, e2m1 codes are turned into e4m3 codes (exact); Hopper sums a group's products in a narrower
      accumulator than FP32 (docs/design/numerics.md, "GEMM accumulation");
    - ``"swap_fp8"``: ``group_fp8`` with the tile computed transposed, the weight as the MMA's first operand, so that
      tiles of fewer than 64 rows (decode) still run Hopper's FP8 ``wgmma`` with ``block_n`` as its 64-row side
      (untransposed, Triton runs their FP8 dots as FP16 ``mma.sync`` on converted operands);
    - ``"swap_ab"`` (MXFP4 only): the MMA computes the tile transposed with the weight as its first operand, decoded
      and scaled into BF16 straight into that operand's registers (no shared-memory round trip); ``block_m``
      activation rows are the MMA's narrow side (16 suits few rows per weight; 8-row tiles were slower on the H200);
    - ``"gluon_fp8"`` (grouped MXFP4 only): the ``swap_fp8`` products, sums and factor order in the explicit-layout
      Gluon kernel of ``cuda.grouped_wgmma`` (Hopper only; elsewhere and in the interpreter the ``swap_fp8`` tile runs):
      ``block_n`` is 16 rows per warp, ``block_m`` 8, 16 or 32, ``block_k`` 32 to 512, K in one program;
    - ``"dequant_bf16"`` (FP8 block GEMM only, many rows): both operands dequantized exactly into BF16 copies, then one
      cuBLAS BF16 GEMM with FP32 sums (``cuda.dequantized_gemm``); the tile fields are not used, ``split_grid`` is off;
    - ``"swap_bf16"`` (grouped MXFP4 and FP8 block, many rows per weight): the weight decoded into BF16 in the
      registers of the MMA's first operand against a BF16 copy of the activation's dequantization (in expert order for
      the grouped GEMM), K summed in the MMA's FP32 accumulator (``cuda.swap_bf16``); ``block_n`` a multiple of
      16 × ``num_warps``, no ``split_grid``;
    - ``"gluon_bf16"`` (grouped MXFP4 only, many rows per expert): the ``swap_bf16`` products and sums in the Gluon
      kernel of ``cuda.grouped_bf16_wgmma``, whose ring copies the K steps and whose ``wgmma`` of one step runs while
      the next step's weight is decoded (Hopper only; elsewhere and in the interpreter the ``swap_bf16`` tile of the
      same rows runs): ``block_n`` is 16 rows per warp, ``block_m`` 32 to 128, ``block_k`` 128 to 512, at least three
      slots, K in one program.

    ``tail_m`` (grouped ``swap_bf16`` only; 0: off): an expert whose rows leave at most ``tail_m`` past its last
    whole tile has those rows computed in a second launch of ``tail_m``-row tiles instead of a mostly empty
    ``block_m``-row one (``cuda.grouped_gemm``; docs/design/kernels.md, "Tail tiles").
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_grid: bool
    gemv: bool = False
    block_k: int = BLOCK_K
    decoding: str = "scaled_bf16"
    tail_m: int = 0

    def __post_init__(self) -> None:
        if self.decoding not in DECODINGS:
            raise ValueError(f"BlockConfig.decoding must be one of {DECODINGS}, got {self.decoding!r}")
        if self.decoding == "gluon_fp8" and (
            self.block_n != _GLUON_ROWS_PER_WARP * self.num_warps
            or self.block_m not in (8, 16, 32, 64)
            or self.block_k not in GLUON_BLOCK_K
            or self.num_stages < 2
        ):
            raise ValueError(
                "a gluon_fp8 tile has block_n = 16 × num_warps, block_m in (8, 16, 32, 64), block_k in"
                f" {GLUON_BLOCK_K} and num_stages (its ring's slots) at least 2, got {self}"
            )
        if self.decoding == "gluon_bf16" and (
            self.block_n != _GLUON_ROWS_PER_WARP * self.num_warps
            or self.block_m not in (32, 64, 128)
            or self.block_k not in GLUON_BLOCK_K
            or self.num_stages < 3
            or self.split_grid
        ):
            raise ValueError(
                "a gluon_bf16 tile has block_n = 16 × num_warps, block_m in (32, 64, 128), block_k in"
                f" {GLUON_BLOCK_K}, num_stages (its ring's slots) at least 3 and no split_grid, got {self}"
            )
        if self.decoding in ("gluon_fp8", "gluon_bf16") and gluon_shared_bytes(self) > SHARED_PER_PROGRAM:
            raise ValueError(
                f"a {self.decoding} tile's ring takes {gluon_shared_bytes(self)} bytes of shared memory, more than the"
                f" {SHARED_PER_PROGRAM} a Hopper program can have: fewer slots, rows or K columns, got {self}"
            )
        if self.decoding == "dequant_bf16" and (self.split_grid or self.gemv):
            raise ValueError(f"a dequant_bf16 launch is one cuBLAS GEMM: no split_grid, no gemv, got {self}")
        if self.decoding == "swap_bf16" and not swap_on_wgmma(self.block_m, self.block_n, self.num_warps):
            raise ValueError(
                f"a swap_bf16 tile has block_n a multiple of 16 × num_warps and block_m at least 16, got {self}"
            )
        if self.tail_m and (
            self.decoding != "swap_bf16" or self.tail_m not in _TAIL_ROWS or self.tail_m >= self.block_m
        ):
            raise ValueError(
                f"tail_m (rows of a grouped swap_bf16 GEMM's tail tiles) is 0 or one of {_TAIL_ROWS} below block_m, on"
                f" a swap_bf16 tile, got {self}"
            )
        if self.decoding == "swap_fp8" and not swap_on_wgmma(self.block_m, self.block_n, self.num_warps):
            raise ValueError(
                f"a swap_fp8 tile's block_n is a multiple of 16 × num_warps and its block_m at least 16, got {self}"
            )


def gluon_shared_bytes(cfg: BlockConfig, weight_bits: int = 4) -> int:
    """Shared memory of a ``gluon_fp8`` tile's ring (``cuda.grouped_wgmma`` for MXFP4 weights, ``cuda.fp8_wgmma`` for
    e4m3 ones, ``weight_bits`` 8): per slot the weight bytes, the activation codes and both sides' scale bytes of a K
    step. A ``gluon_bf16`` tile's (``cuda.grouped_bf16_wgmma``): per slot the packed weight, its scale bytes and the
    activation's BF16 values, and two K steps of the decoded BF16 weight."""
    groups = cfg.block_k // 32
    if cfg.decoding == "gluon_bf16":
        slot = cfg.block_n * cfg.block_k // 2 + cfg.block_n * groups + cfg.block_m * cfg.block_k * 2
        return cfg.num_stages * slot + 2 * cfg.block_n * cfg.block_k * 2
    return cfg.num_stages * (
        cfg.block_n * cfg.block_k * weight_bits // 8 + cfg.block_m * cfg.block_k + (cfg.block_n + cfg.block_m) * groups
    )


def swap_on_wgmma(block_m: int, block_n: int, num_warps: int) -> bool:
    """Whether Triton 3.6 runs a ``swap_fp8`` tile's dot as Hopper's FP8 ``wgmma``: narrower, it runs an FP16
    ``mma.sync`` (sm_90 SASS: HMMA at 8 rows, QGMMA from 16), whose sums differ."""
    return block_m >= 16 and block_n % (_GLUON_ROWS_PER_WARP * num_warps) == 0


def decodings(op: str) -> tuple[str, ...]:
    """The decodings ``op``'s MMA tiles have: ``"gluon_fp8"`` only for the grouped MXFP4 and the FP8 block GEMM,
    ``"swap_ab"`` only for the MXFP4 GEMMs, ``"dequant_bf16"`` only for the FP8 block GEMM, ``"swap_bf16"`` for the
    grouped MXFP4 and the FP8 block GEMM, ``"gluon_bf16"`` only for the grouped MXFP4 GEMM, every other one for all
    three."""
    only = {
        "gluon_fp8": op in ("mxfp4_grouped_gemm", "fp8_block_gemm"),
        "swap_ab": op.startswith("mxfp4"),
        "dequant_bf16": op == "fp8_block_gemm",
        "swap_bf16": op in ("mxfp4_grouped_gemm", "fp8_block_gemm"),
        "gluon_bf16": op == "mxfp4_grouped_gemm",
    }
    return tuple(d for d in DECODINGS if only.get(d, True))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def k_chunk(n: int, k: int) -> int:
    """K columns per reduction chunk for a weight [N, K]: a multiple of 256 (hence of every K step), chosen so that
    decode tiles of 32 weight rows give about 1024 programs. Depends on ``(N, K)`` only."""
    chunks = max(1, min(k // _CHUNK_ALIGN, _cdiv(_DECODE_PROGRAMS, _cdiv(n, _DECODE_BLOCK_N))))
    return _cdiv(_cdiv(k, chunks), _CHUNK_ALIGN) * _CHUNK_ALIGN


def chunk_length(n: int, k: int, cfg: BlockConfig, grouped: bool = False) -> int:
    """K columns per reduction chunk of a launch with tiles ``cfg``: :func:`k_chunk`, except for ``"group_fp8"`` and
    the grouped GEMM's ``"swap_fp8"`` and ``"gluon_fp8"`` (``grouped``), which sum K as one chunk (no split-K; one FP32
    tile of registers fewer, and the grouped GEMM's touched experts give it programs enough). A dense ``"swap_fp8"``
    launch splits K like the other decodings: its few-row tiles need split-K for programs, and its sums, fixed by the
    weight's shape alone, are then the same bits whatever the rows and tiles (the batch-invariant tiles); the dense
    ``"gluon_fp8"`` kernel adds the same chunks in one program."""
    one_chunk = cfg.decoding == "group_fp8" or (grouped and cfg.decoding in ("swap_fp8", "gluon_fp8"))
    return k if one_chunk else k_chunk(n, k)


def row_bucket(rows: int) -> int:
    """The row bucket tiles are chosen for: the smallest of 2, 16, 32, 64, 256 holding ``rows``, else 4096."""
    return next((b for b in _BUCKETS if rows <= b), 4096)


def grouped_tile_rows(m: int, experts: int) -> int:
    """The rows per expert whose bucket gives the tiles of a grouped GEMM over ``m`` rows and ``experts`` experts: the
    mean (rows per expert are unknown without a sync), but beyond :data:`GROUPED_SPLIT_MAX_ROWS` rows at least the
    16-row bucket. There the K chunks stay in one program, and at about one row per expert (64 tokens of top-6
    routing over 384 experts) the 16-row bucket's swap_fp8 tile beat the split-K tile that a single token's few rows
    want (kernels_gemm-mxfp4-perm-t*.json)."""
    mean_rows = _cdiv(m, experts)
    return mean_rows if m <= GROUPED_SPLIT_MAX_ROWS else max(mean_rows, _UNSPLIT_MIN_BUCKET)


def default_decoding(op: str) -> str:
    """The decoding of ``op``'s default MMA tiles: FP8 through ``tl.dot_scaled``, MXFP4 with the kernel's own scaled
    BF16 decoding, the faster in most shapes of the H200 tuning runs (docs/design/kernels.md, "GEMM tiles and
    split-K")."""
    return "dot_scaled" if op == "fp8_block_gemm" else "scaled_bf16"


def default_config(op: str, rows: int) -> BlockConfig:
    """Tiles for ``op`` on ``rows`` activation rows per weight (per expert for the grouped GEMM) without a measured
    entry: the FMA kernels for up to 2 rows of a dense GEMM; then MMA tiles, split-K up to 64 rows (small M tiles waste
    less of the 16-row MMA minimum), 64×128 tiles without split-K up to 256 rows; beyond, the FP8 block GEMM on
    dequantized BF16 operands through cuBLAS (``dequant_bf16``: 2.0–2.7x the FP8 tensor-core ``group_fp8`` tile on
    every FP8 weight of the scaled preset at 8,192 rows on the H200, kernels_gemm-dequant-*.json) and the MXFP4 GEMMs
    FP8 tensor-core (``group_fp8``) 128×64 tiles. Every choice compiles for sm_90a."""
    if rows <= 2 and op != "mxfp4_grouped_gemm":
        return BlockConfig(block_m=2, block_n=32, num_warps=4, num_stages=3, split_grid=True, gemv=True)
    decoding = default_decoding(op)
    if rows <= 16:
        return BlockConfig(16, 64, num_warps=4, num_stages=4, split_grid=True, decoding=decoding)
    if rows <= 32:
        return BlockConfig(32, 32, num_warps=4, num_stages=4, split_grid=True, decoding=decoding)
    if rows <= 64:
        return BlockConfig(64, 64, num_warps=4, num_stages=4, split_grid=True, decoding=decoding)
    if rows <= 256:
        return BlockConfig(64, 128, num_warps=8, num_stages=3, split_grid=False, decoding=decoding)
    return DEQUANT_BF16_TILE if op == "fp8_block_gemm" else _PREFILL_FP8_TILE


def gluon_fp8_tile(
    block_m: int, num_warps: int, block_k: int, num_stages: int, split_grid: bool = False
) -> BlockConfig:
    """A ``gluon_fp8`` tile: 16 weight rows a warp, K in one program unless ``split_grid``."""
    return mma_tile(
        block_m, 16 * num_warps, num_warps, num_stages, split_grid=split_grid, decoding="gluon_fp8", block_k=block_k
    )


def gluon_bf16_tile(block_m: int, num_warps: int, block_k: int, num_stages: int) -> BlockConfig:
    """A ``gluon_bf16`` tile: 16 weight rows a warp, K in one program."""
    return mma_tile(
        block_m, 16 * num_warps, num_warps, num_stages, split_grid=False, decoding="gluon_bf16", block_k=block_k
    )


def swap_fp8_tile(block_m: int, block_n: int, num_warps: int, num_stages: int, split_grid: bool = True) -> BlockConfig:
    """A ``swap_fp8`` tile (the weight as the FP8 ``wgmma``'s wide side), split-K unless said otherwise."""
    return mma_tile(block_m, block_n, num_warps, num_stages, split_grid=split_grid, decoding="swap_fp8")


def swap_bf16_tile(
    block_m: int, block_n: int, num_warps: int, split_grid: bool = False, tail_m: int = 0, num_stages: int = 3
) -> BlockConfig:
    """A ``swap_bf16`` tile: 64-column K steps, three stages unless said otherwise."""
    return BlockConfig(
        block_m, block_n, num_warps, num_stages, split_grid=split_grid, block_k=64, decoding="swap_bf16", tail_m=tail_m
    )


def gemv_tile(block_n: int, num_warps: int, num_stages: int, split_grid: bool = True) -> BlockConfig:
    """An FMA GEMV tile (``cuda.gemv``) of up to two rows a program, split-K unless said otherwise."""
    return BlockConfig(
        block_m=2, block_n=block_n, num_warps=num_warps, num_stages=num_stages, split_grid=split_grid, gemv=True
    )


def mma_tile(
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    split_grid: bool = True,
    decoding: str = "scaled_bf16",
    block_k: int = BLOCK_K,
) -> BlockConfig:
    """An MMA tile of any decoding (``scaled_bf16`` by default), split-K unless said otherwise."""
    return BlockConfig(
        block_m, block_n, num_warps, num_stages, split_grid=split_grid, decoding=decoding, block_k=block_k
    )


# (op, row bucket, N, K) -> tiles where the fastest candidate on an H200 was not the default (the scaled preset's
# decode shapes; benchmarks/results/kernels_gemm-nvidia-h200*.json, docs/hardware.md "Kernels"). Bucket 2 was tuned
# at 1 row, bucket 16 at 1 row (the grouped GEMM's at 64 tokens: grouped_tile_rows), bucket 64 at 64 rows, the
# grouped GEMM's bucket 256 at 8192 tokens.
# The FP8 entries of buckets 2 and 16 predate tl.dot_scaled (own decoding). The grouped MXFP4 GEMM's bucket 2 held
# both 1 token and 64 tokens (about one row per expert) until grouped_tile_rows moved 64 tokens to bucket 16:
# its 128-column tiles were the fastest scaled_bf16 tiles at
# both, 16–21 % faster than the default (kernels_gemm-mxfp4-swap-t*.json), and faster than swap_ab except on w2 at
# 1 token (50.6 against 54.4 µs); with a 64-column K step (127 registers instead of 167) they were 6–13 % faster
# again (kernels_gemm-mxfp4-wide-t*.json). With group_fp8 (at 16 rows an FP16 mma.sync on e4m3 operands converted by
# Triton, not the FP8 tensor cores: see swap_fp8) the 16×128 tile was 3–5 % faster at 64
# and 256 tokens but 32 % slower at 1 token (kernels_gemm-mxfp4-fp8mma-t*.json). The same tile transposed (swap_fp8,
# FP8 wgmma) was faster again at 256 tokens, 3497 against 3743 µs on w13 and 1778 against 1965 µs on w2, and no
# faster at 1 token (46.2 against 44.8 µs on w2; kernels_gemm-mxfp4-swapfp8.json). With its operand in the
# de-interleaved order (no byte interleave) it took 1981 against 2348 µs (w13) and 1071 against 1305 µs (w2) at 64
# tokens, 3242 against 3881 and 1619 against 1997 µs at 256 tokens, but 89.3 against 73.7 µs (w13) and 42.3 against
# 42.8 µs (w2) at 1 token (kernels_gemm-mxfp4-perm-t*.json); its 8-row tiles were 18–27 % slower than its 16-row
# ones. The explicit-layout Gluon kernel of the same sums (gluon_fp8, cuda.grouped_wgmma) with 8-row tiles and a K step
# of eight groups beat every Triton tile on both shapes: 59.1 against 72.4 µs (w13, the scaled_bf16 tile) and 31.6
# against 43.8 µs (w2) at 1 token, 1505 against 2023 µs (w13, swap_fp8) and 781 against 1020 µs (w2) at 64 tokens
# (kernels_gemm-gluon.json); buckets 2 and 16 take it. Its operands then went through registers (one K step in flight
# a program); they now go by cp.async through a ring of shared-memory slots (three here).
_GROUPED_GLUON_TILE = gluon_fp8_tile(8, 4, 256, 3)
# About 128 rows per expert (an 8K-token prefill): the BF16 tensor cores on a BF16 copy of the activation in expert
# order (swap_bf16, cuda.swap_bf16), 9.5 against 18.6 ms (w13) and 5.0 against 9.4 ms (w2) for the fastest
# group_fp8 tile (kernels_gemm-swapbf16-prefill.json); the group_fp8 tiles had been 2.5x the scaled_bf16 default
# (kernels_gemm-h200-prefill.json). Also the fastest tile at 32 and 64 rows per expert (2K- and 4K-token prefills):
# 3.95 against 7.38 ms and 5.65 against 11.88 ms (w13), 2.16 against 3.97 and 3.08 against 6.17 ms (w2) for the
# fastest FP8 tile (kernels_gemm-swapbf16-t2048-t4096.json).
_GROUPED_PREFILL_TILE = swap_bf16_tile(64, 128, 8)
# At 8,192 tokens once a tile's N blocks ran as consecutive programs (cuda.swap_bf16), the 128-row tile beat it on both
# shapes: 8,043.7 against 8,338.4 µs (w13), 4,067.4 against 4,340.0 µs (w2), in the same run
# (kernels_gemm-gluon-bf16-order-t8192.json; the Gluon BF16 ring tiles, gluon_bf16, took 9,765.8 and 5,380.5 µs).
# With 32-row tail tiles (BlockConfig.tail_m) it is 8.5 % and 10.3 % faster again on an H100, same run: 7,306.1
# against 7,980.3 µs (w13), 3,662.7 against 4,084.1 µs (w2) (kernels_gemm-h100-swapbf16-tails.json; 16-row tails
# 7,383.4 and 3,706.1; the tiles of 256 weight rows took 10,154.9 and 4,737.6 µs in
# kernels_gemm-h100-swapbf16-t2048-8192.json).
_GROUPED_PREFILL_TILE_256 = swap_bf16_tile(128, 128, 8, tail_m=32)
# w2 (K 2,304) at 32 and 64 rows per expert, re-timed on an H100 (kernels_gemm-h100-swapbf16-tails.json): 64 × 64 on 4
# warps, 1,841.2 against 1,895.1 µs for the 64 × 128 tile at 2,048 tokens, and with 16-row tails 2,567.9 against
# 2,692.9 µs at 4,096 (w13 keeps the 64 × 128 tile: 3,433.0 and 4,883.1 µs, its tails slower).
_GROUPED_W2_TILE_32 = swap_bf16_tile(64, 64, 4)
_GROUPED_W2_TILE_64 = swap_bf16_tile(64, 64, 4, tail_m=16)
# The FP8 tensor cores: 2.0–2.2x the dot_scaled 128×128 tiles on every FP8 weight of an 8K-token prefill on the H200
# (kernels_gemm-h200-prefill.json); the default beyond 256 rows. At 256 rows 2.7–4.0x the dot_scaled 64×128 default
# and 1.1–1.3x the fastest swap_fp8 tile on every FP8 weight of the scaled preset (kernels_gemm-fp8-swap.json).
_PREFILL_FP8_TILE = BlockConfig(128, 64, num_warps=4, num_stages=4, split_grid=False, block_k=64, decoding="group_fp8")
# Both operands dequantized into BF16, one cuBLAS GEMM (cuda.dequantized_gemm); the tile fields are unused.
DEQUANT_BF16_TILE = BlockConfig(128, 128, num_warps=8, num_stages=1, split_grid=False, decoding="dequant_bf16")
# The FP8 block GEMM's e4m3 weight decoded into a BF16 wgmma's register operand against x̂ (cuda.swap_bf16).
_SWAP_BF16_64 = swap_bf16_tile(64, 64, 4)
_SWAP_BF16_256 = swap_bf16_tile(256, 128, 8)
# The dense FP8 Gluon kernel's fastest tile at 256 rows on every FP8 weight of the scaled preset.
_INVARIANT_GLUON_FP8 = gluon_fp8_tile(64, 4, 256, 2)
# The FP8 block GEMM at 16 and 64 rows: swap_fp8 tiles, split-K in the weight shape's chunks, had been the fastest on 8
# of 9 shapes at each (kernels_gemm-fp8-swap.json). The split-K swap_bf16 tiles and the Gluon ring kernel then beat
# them on 17 of 18 (kernels_gemm-fp8-tune-16-64-256.json; the swap_fp8 tiles' times from the run before, where this
# run did not time them, ran 3–9 % faster than this one's machine on the shapes both timed): at 16 rows swap_bf16
# 16×64 on five weights (wo_b 25.8 against 33.2 µs, main_proj 43.1 against 52.4, attn.wkv 9.7 against 11.3 in the same
# run), Gluon on four (the indexer's wq_b 7.4 against 11.0 µs in the same run, engram.wkv 72.5 against 86.5); at 64
# rows swap_bf16 on five (main_proj 62.4 against 84.2 µs, engram.wkv 113.5 against 146.6, the shared w2 17.9 against
# 24.5 in the same run), Gluon on three (the indexer's wq_b 10.1 against 17.0 µs and wq_a 20.5 against 25.7, both in
# the same run); attn.wkv at 64 rows keeps its dot_scaled tile (16.3 µs, the fastest again). In the batch-invariant
# mode the swap_bf16 and dot_scaled tiles give way to invariant_config's; the Gluon ones stay (the same bits).
# At 256 rows (kernels_gemm-dequant-t256.json) the cuBLAS path (dequant_bf16) beat the group_fp8 tiles on 7 of 9 FP8
# weights (22 against 66 µs on attn.wkv … 42 against 45 µs on the shared w2) and lost on the two of K = 1280 (124
# against 99 µs on wq_b, 24 against 20 on the indexer's wq_b); wo_a was not timed. With the e4m3 weight decoded in
# the registers of a BF16 wgmma against x̂ (swap_bf16, which reads the weight once as stored) 7 of 9 weights were
# faster again (kernels_gemm-fp8-swapbf16-t256.json, timed beside a checkpoint write): 68.8 against 100.4 µs (wq_b,
# group_fp8) and 268.7 against 395.9 µs (engram.wkv, dequant_bf16) in 256×128 tiles, 1–12 % on the others in 64×64
# tiles; attn.wkv and wq_a keep dequant_bf16 (18.9 against 49.9 µs, 30.4 against 50.9 µs). At 8,192 rows
# dequant_bf16 stayed 1.2–1.7x faster than every swap_bf16 tile (kernels_gemm-fp8-swapbf16-t8192.json).
# At one row the Gluon ring kernel (gluon_fp8, cuda.fp8_wgmma) beat the FMA kernel on the four weights with enough rows
# of N or a short K (kernels_gemm-fp8-gluon.json, one run): 18.0 against 23.4 µs (wq_b), 60.0 against 74.4 µs
# (engram.wkv), 6.1 against 7.0 µs (the indexer's wq_b), 9.7 against 11.3 µs (the shared w2); the FMA kernel kept the
# five others (wkv 7.6 against 16.2 µs: 8 programs of 64 rows; wo_b 24.4 against 25.6; main_proj 40.4 against 42.9).
# A ring of four slots then beat three on engram.wkv (56.6 against 62.1 µs in the same run, 59.8 for the 16-row tile
# it had) and the shared w2 (9.2 against 9.5 µs; kernels_gemm-fp8-t1-pipelined.json). That run's FMA tiles with
# num_stages above 1 ran an experiment, their K steps' loads pipelined by cp.async (tl.range): slower than the same
# tiles without it on every weight (main_proj 41.4 µs at depth 1, 43.4–54.3 deeper), so not kept.
# Bucket 2 re-tuned once the FMA GEMV quantized its own activation (kernels_gemm-fp8-t1-split.json): its 64-column
# 8-warp tiles became 2.1–2.7x slower (wo_b 56.1 against 20.8 µs for 32 columns, 4 warps), the 32-column tiles the
# fastest on six weights (the indexer's wq_b 5.6 against 6.1 for Gluon); split-K Gluon lost to the GEMV on all.
# bf16_gemm at one row (kernels_gemm-h100-s37-bf16-tune.json, an H100; the default 32-column tile beside each): the
# 16-column tile was the fastest or within 0.1 µs of it on the five small weights (the indexer's weights_proj 4.1
# against 4.8 µs, the router gates 7.3 against 7.5 and 5.5 against 6.0), the unsplit 8-column two-warp tile on the
# indexer's wk (3.6 against 4.4; K is one chunk) and the two heads (the LM head 429 against 456 µs, the Markov head
# 27.7 against 32.4), whose 101,000 programs cover the GPU without split-K. At two rows the 64-column tile of a
# 256-column K step, the fastest at one row on the 384-expert gate (7.2 µs), took 13.5 µs: not kept.
_BF16_GEMV_TILE = gemv_tile(16, 4, 3)
_BF16_GEMV_NARROW = gemv_tile(8, 2, 3, split_grid=False)
MEASURED: dict[tuple[str, int, int, int], BlockConfig] = {
    ("bf16_gemm", 2, 32, 5120): _BF16_GEMV_TILE,
    ("bf16_gemm", 2, 128, 512): _BF16_GEMV_NARROW,
    ("bf16_gemm", 2, 128, 5120): _BF16_GEMV_TILE,
    ("bf16_gemm", 2, 384, 5120): _BF16_GEMV_TILE,
    ("bf16_gemm", 2, 512, 5120): _BF16_GEMV_TILE,
    ("bf16_gemm", 2, 129280, 256): _BF16_GEMV_NARROW,
    ("bf16_gemm", 2, 129280, 5120): _BF16_GEMV_NARROW,
    ("fp8_block_gemm", 2, 512, 5120): gemv_tile(32, 4, 2),
    ("fp8_block_gemm", 2, 1280, 5120): gemv_tile(32, 4, 2),
    ("fp8_block_gemm", 2, 4096, 1280): gemv_tile(32, 4, 3),
    ("fp8_block_gemm", 2, 4608, 5120): gemv_tile(32, 4, 3),
    ("fp8_block_gemm", 2, 5120, 2304): gluon_fp8_tile(8, 4, 256, 4),
    ("fp8_block_gemm", 2, 5120, 8192): gemv_tile(32, 4, 3),
    ("fp8_block_gemm", 2, 5120, 15360): gemv_tile(32, 4, 2),
    ("fp8_block_gemm", 2, 25600, 6144): gluon_fp8_tile(8, 4, 256, 4),
    ("fp8_block_gemm", 2, 32768, 1280): gluon_fp8_tile(8, 8, 128, 3),
    ("mxfp4_gemm", 2, 4608, 5120): gemv_tile(16, 4, 3),
    ("mxfp4_gemm", 2, 5120, 2304): gemv_tile(16, 4, 3),
    ("fp8_block_gemm", 16, 512, 5120): swap_bf16_tile(16, 64, 4, split_grid=True),
    ("fp8_block_gemm", 16, 1280, 5120): swap_bf16_tile(16, 64, 4, split_grid=True),
    ("fp8_block_gemm", 16, 4096, 1280): gluon_fp8_tile(8, 4, 256, 3),
    ("fp8_block_gemm", 16, 4608, 5120): swap_bf16_tile(16, 64, 4, split_grid=True),
    ("fp8_block_gemm", 16, 5120, 2304): gluon_fp8_tile(16, 4, 256, 3),
    ("fp8_block_gemm", 16, 5120, 8192): swap_bf16_tile(16, 64, 4, split_grid=True),
    ("fp8_block_gemm", 16, 5120, 15360): swap_bf16_tile(16, 64, 4, split_grid=True),
    ("fp8_block_gemm", 16, 25600, 6144): gluon_fp8_tile(16, 4, 256, 3),
    ("fp8_block_gemm", 16, 32768, 1280): gluon_fp8_tile(16, 4, 256, 3),
    ("fp8_block_gemm", 64, 512, 5120): mma_tile(64, 32, 4, 4, decoding="dot_scaled"),
    ("fp8_block_gemm", 64, 1280, 5120): gluon_fp8_tile(16, 4, 256, 3),
    ("fp8_block_gemm", 64, 4096, 1280): gluon_fp8_tile(32, 4, 128, 3),
    ("fp8_block_gemm", 64, 4608, 5120): swap_bf16_tile(64, 128, 8, split_grid=True),
    ("fp8_block_gemm", 64, 5120, 2304): swap_bf16_tile(64, 64, 4, split_grid=True),
    ("fp8_block_gemm", 64, 5120, 8192): swap_bf16_tile(64, 128, 8, split_grid=True),
    ("fp8_block_gemm", 64, 5120, 15360): swap_bf16_tile(64, 128, 8, split_grid=True),
    ("fp8_block_gemm", 64, 25600, 6144): swap_bf16_tile(64, 128, 8, split_grid=True),
    ("fp8_block_gemm", 64, 32768, 1280): gluon_fp8_tile(64, 4, 128, 3),
    ("fp8_block_gemm", 256, 512, 5120): DEQUANT_BF16_TILE,
    ("fp8_block_gemm", 256, 1280, 5120): DEQUANT_BF16_TILE,
    ("fp8_block_gemm", 256, 4096, 1280): _SWAP_BF16_64,
    ("fp8_block_gemm", 256, 4608, 5120): _SWAP_BF16_64,
    ("fp8_block_gemm", 256, 5120, 2304): _SWAP_BF16_64,
    # attn.wo_a (grouped, 8 groups of 1024 rows): not timed alone; the roofline run at 7f8a547 ran it on this tile.
    ("fp8_block_gemm", 256, 8192, 4096): _PREFILL_FP8_TILE,
    ("fp8_block_gemm", 256, 5120, 8192): _SWAP_BF16_64,
    ("fp8_block_gemm", 256, 5120, 15360): _SWAP_BF16_64,
    ("fp8_block_gemm", 256, 25600, 6144): _SWAP_BF16_256,
    ("fp8_block_gemm", 256, 32768, 1280): _SWAP_BF16_256,
    ("mxfp4_grouped_gemm", 2, 4608, 5120): _GROUPED_GLUON_TILE,
    ("mxfp4_grouped_gemm", 2, 5120, 2304): _GROUPED_GLUON_TILE,
    ("mxfp4_grouped_gemm", 16, 4608, 5120): _GROUPED_GLUON_TILE,
    ("mxfp4_grouped_gemm", 16, 5120, 2304): _GROUPED_GLUON_TILE,
    ("mxfp4_grouped_gemm", 32, 4608, 5120): _GROUPED_PREFILL_TILE,
    ("mxfp4_grouped_gemm", 32, 5120, 2304): _GROUPED_W2_TILE_32,
    ("mxfp4_grouped_gemm", 64, 4608, 5120): _GROUPED_PREFILL_TILE,
    ("mxfp4_grouped_gemm", 64, 5120, 2304): _GROUPED_W2_TILE_64,
    ("mxfp4_grouped_gemm", 256, 4608, 5120): _GROUPED_PREFILL_TILE_256,
    ("mxfp4_grouped_gemm", 256, 5120, 2304): _GROUPED_PREFILL_TILE_256,
}


# The batch-invariant mode's FP8 tile at one or two rows (invariant_config), where MEASURED's is not row-independent
# (the FMA GEMV) or absent (attn.wo_a): the split-K Gluon tile. The unsplit Gluon one-row tile beat the swap_fp8 16×128
# tile on wo_b (25.8 against 29.7 µs), the shared w1 (16.5 against 18.2) and main_proj (42.4 against 46.6;
# kernels_gemm-fp8-t1-pipelined.json), not on wkv and wq_a (16.0 and 16.2 against 9.4 and 11.8 µs: 8 and 20 programs
# of 64 weight rows); the split one took wkv 7.4, wq_a 8.8, wo_b 21.4, the shared w1 14.4, main_proj 34.4 µs
# (kernels_gemm-fp8-t1-split.json, another run). attn.wo_a (grouped, 8 × [1024, 4096]; GPU-tested to the swap_fp8
# bits) has not been timed on it. MEASURED_INVARIANT holds the exception: the indexer's wq_b keeps the unsplit tile
# (6.1 against 7.2 µs split).
_INVARIANT_ONE_ROW = gluon_fp8_tile(8, 4, 256, 3, split_grid=True)
MEASURED_INVARIANT: dict[tuple[str, int, int, int], BlockConfig] = {
    ("fp8_block_gemm", 2, 4096, 1280): gluon_fp8_tile(8, 4, 256, 3),
}


def _row_independent(op: str, cfg: BlockConfig) -> bool:
    """Whether a row's bits under ``cfg`` are those of every tile of the batch-invariant mode: the FP8 ``wgmma``
    decodings with the weight as its 64-row side, whose per-group sums do not depend on the tile's other rows
    (the GPU tests check it bitwise across tiles), in their fixed chunks (:func:`chunk_length`: per weight shape for a
    dense ``swap_fp8`` or ``gluon_fp8`` launch, one for the grouped GEMM's)."""
    return cfg.decoding in ("swap_fp8", "gluon_fp8")


def invariant_config(op: str, rows: int) -> BlockConfig:
    """The tiles of a GEMM in batch-invariant mode (docs/design/numerics.md, "Batch invariance") where the tuned
    tile is not already one of them (:func:`block_config`). The grouped GEMM keeps its measured decode tile, the
    ``gluon_fp8`` one (the fastest at 1, 64 and 256 tokens: kernels_gemm-gluon.json), K in one program. A dense GEMM
    runs ``swap_fp8`` tiles, whose rows keep their bits in any tile (the FP8 block GEMM at one or two rows the split
    Gluon tile of the same sums, ``_INVARIANT_ONE_ROW``): 128 weight rows by 16 activation rows up to 16 rows, else
    by 64, split-K up to 64 rows (without it a prefill's FP32 partials would take chunks × M × N × 4 bytes; the
    chunks are the same). The 16-row tile was the fastest swap_fp8 tile at one row on 8 of the scaled preset's 9 FP8
    weights (1.05–1.41x the FMA kernel's time), the 64-row one at 256 rows on 7 of 9 (kernels_gemm-fp8-swap.json).
    From 17 to 256 rows the FP8 block GEMM runs the Gluon kernel's 64 × 64 tile instead (``gluon_fp8``, the same
    chunks added in one program: the same bits), 1.2–1.8x faster than the fastest swap_fp8 tile on all 9 weights at
    256 rows (kernels_gemm-fp8-gluon.json: engram.wkv 336.8 against 477.2 µs)."""
    if op == "mxfp4_grouped_gemm":
        return _GROUPED_GLUON_TILE
    if op == "fp8_block_gemm" and rows <= 2:
        return _INVARIANT_ONE_ROW
    if op == "fp8_block_gemm" and 16 < rows <= 256:
        return _INVARIANT_GLUON_FP8
    return swap_fp8_tile(16 if rows <= 16 else 64, 128, 4, 3, split_grid=rows <= 64)


def block_config(op: str, rows: int, n: int, k: int) -> BlockConfig:
    """Tiles for ``op`` ("fp8_block_gemm", "mxfp4_gemm", "mxfp4_grouped_gemm" or, up to two rows, "bf16_gemm") on
    ``rows`` rows per weight: the measured or default tile; inside ``batch_invariant_ops`` that tile if its rows keep
    their bits in every tile of the mode, else the measured row-independent one (``MEASURED_INVARIANT``) or
    :func:`invariant_config`'s (``cuda.bf16_gemm`` asks only outside the mode)."""
    key = (op, row_bucket(rows), n, k)
    tuned = MEASURED.get(key) or default_config(op, rows)
    if invariant_kernels() and not _row_independent(op, tuned):
        return MEASURED_INVARIANT.get(key) or invariant_config(op, rows)
    return tuned
