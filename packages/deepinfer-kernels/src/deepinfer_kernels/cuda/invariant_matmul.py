"""Triton batched matmul with one fixed tile configuration: a row's result does not depend on the row count
(docs/design/numerics.md, "Batch invariance").

cuBLAS picks its kernel (tile shape, split-K, stream-K) by the problem shape, so one row of ``a @ b`` gets different
FP32 summation orders alone and inside a batch. Here one program per (BLOCK_M rows, BLOCK_N columns, batch entry)
sums K from zero in BLOCK_K steps, in order, into one FP32 accumulator, and rounds once to the output dtype; the
columns and the K steps are the same whatever M, N, K and the batch count are. The columns of ``b`` are the dot's
first side (``bᵀ · aᵀ``: on Hopper the wgmma's 128-row M side, which a weight fills) and the rows of ``a`` its
second (:data:`ROW_TILES`: 16 of them up to 16 rows, 64 up to 64, and beyond, on the tensor cores, 128 with 8
warps, against 256 columns of ``b`` for a product of one K chunk), so a one-row product reads the weight once
without computing 63 empty rows and a 256-row one reads the LM head's 1.3 GB in tiles that keep the tensor cores
busy. An output element's arithmetic therefore depends only on its own row of ``a``, its own column of ``b`` and K:
the tensor-core instruction sums the same products into the same accumulator whatever the width of either side (the
GPU tests check a row's bits alone and in batches of 64, 130 and 300), and the FP32 path's FMA dots add the K
products of an element one by one. Rows missing from a partial tile are loaded as zeros and touch no other row.

K is summed in chunks whose length follows from (N, K) alone (:func:`k_chunk`): each chunk from zero in its K steps,
then the chunk sums from zero in chunk order. A weight of few columns (the router's 384) gets chunks of 256 so that
a product of few tiles still has programs enough: while the tiles alone are fewer than the programs the device
wants and the chunk sums fit :data:`_SPLIT_MAX_BYTES`, each chunk is a program of its own and each tile's last
program adds the chunk sums in order (``gemm_operands.finish_tile``; one program streaming the router's 3.9 MB
through 80 dependent K steps made its product latency-bound); otherwise one program adds them in the same order, so
the bits are the same either way. Beyond :data:`_TILE_FINISH_MAX_ROWS` rows a second launch adds the chunk sums
(``_chunk_sums_kernel``, many small programs) instead of each tile's last program: at 256 rows the router's 128-row
tiles each had 1.3 MB of chunk sums to add alone, about 20 µs a call.

BF16×BF16 and FP16×FP16 run on the tensor cores (exact products, FP32 accumulation); every other pair is computed
as an FP32 ``tl.dot`` with ``input_precision="ieee"`` (what PyTorch's FP32 matmul does with TF32 off). Under
``TRITON_INTERPRET=1`` BF16 operands are widened to FP32 first (the interpreter multiplies BF16 bit patterns as
integers); the values, hence the products, are the same.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.gemm_operands import CHUNKS_PER_LOAD, chunk_range, finish_tile, split_counters
from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = ["BLOCK_K", "ROW_TILES", "RowTile", "invariant_matmul", "k_chunk", "row_tile"]


@dataclass(frozen=True)
class RowTile:
    """One program's tile: ``block_m`` rows of ``a`` (the dot's second side), ``block_n`` columns of ``b`` (a weight's
    rows: its first side), and the launch. K steps are :data:`BLOCK_K` in every tile (the chunks are whole steps)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# K columns per step: 64 keeps the FP32 path's register tile small.
BLOCK_K = 64
# A product of M rows takes the first tile with block_m ≥ M, else the last; FP32 pairs (FMA dots, whose register
# tile grows with both sides) stop at the 64-row tile. 64-row tiles take a decode batch of up to 64 rows in one pass
# over the weight; the 128-row tiles are for more rows: 256 columns of b for a product of one chunk (the LM head at 256
# rows: 640 against 709 µs for 128 columns, kernels_invariant-h200-54d09d7.json), 128 for a chunked one, whose two FP32
# tiles (acc and total) take 128 registers a thread at 8 warps (at 256 columns they spill: 2-3x the time).
ROW_TILES = (RowTile(16, 128, 4, 3), RowTile(64, 128, 4, 3), RowTile(128, 128, 8, 3))
_WIDE_TILE = RowTile(128, 256, 8, 3)
_FMA_ROW_TILES = ROW_TILES[:2]
# Columns of b per tile in the chunk rule (k_chunk): fixed, so the chunks do not follow the tile a product runs on.
_CHUNK_RULE_COLUMNS = 128
_MAX_GRID_Z = 65535
# Programs a product should have (about two per SM of an H200), which sets the chunks of a weight of few columns, and
# the shortest chunk (four K steps).
_TARGET_PROGRAMS = 264
_MIN_CHUNK = 256
# The chunk sums of a split product (chunks × M × N FP32): a decode step's router at 256 rows takes 7.9 MB; a prefill's
# would take hundreds, and its row tiles give programs enough anyway.
_SPLIT_MAX_BYTES = 32 << 20
# Rows up to which a split tile's last program adds its chunk sums (a decode GEMV's are a few KB); beyond, a launch of
# _SUM_BLOCK-element programs does.
_TILE_FINISH_MAX_ROWS = 16
_SUM_BLOCK = 1024
_TENSOR_CORE_PAIRS = {(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)}


@triton.jit
def _k_step(a_base, b_base, acc, k, rows, cols, M, N, K, stride_ak, stride_bk, NATIVE_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    # acc + the K step of columns k (a chunk is a whole number of K steps: only K itself ends one early).
    a_t = tl.load(a_base + k[:, None] * stride_ak, mask=(k[:, None] < K) & (rows[None, :] < M), other=0.0)
    b_t = tl.load(b_base + k[None, :] * stride_bk, mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
    if NATIVE_DOT:
        return tl.dot(b_t, a_t, acc)
    else:
        return tl.dot(b_t.to(tl.float32), a_t.to(tl.float32), acc, input_precision="ieee")


# M is not specialized (Triton would compile M == 1 apart): one binary serves every row count.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    b_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_CHUNK,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_ob,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    CHUNKED: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    FINISH_IN_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    # SPLIT_GRID (one batch entry, unit column stride out): grid axis 2 is the K chunk; else the batch entry, and the
    # program sums every chunk in order. FINISH_IN_TILE: a split tile's last program adds the chunk sums into out,
    # else _chunk_sums_kernel does.
    await_inputs(PDL)
    batch = 0 if SPLIT_GRID else tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + batch * stride_ab + rows[None, :] * stride_am
    b_base = b_ptr + batch * stride_bb + cols[:, None] * stride_bn
    # total[c, r] = Σ_k b[k, c] · a[r, k]: the transposed tile. One chunk (CHUNKED false) sums straight into it: a
    # second FP32 tile of registers would cost the 64-row tile an SM's third program (197 against 151 registers).
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if CHUNKED:
        first, last = chunk_range(K, K_CHUNK, SPLIT_GRID)
        for chunk in range(first, last):
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            k_end = tl.minimum(chunk * K_CHUNK + K_CHUNK, K)
            for k0 in range(chunk * K_CHUNK, k_end, BLOCK_K):
                acc = _k_step(a_base, b_base, acc, k0 + ks, rows, cols, M, N, K, stride_ak, stride_bk, NATIVE_DOT)
            total += acc
    else:
        for k0 in range(0, K, BLOCK_K):
            total = _k_step(a_base, b_base, total, k0 + ks, rows, cols, M, N, K, stride_ak, stride_bk, NATIVE_DOT)
    if SPLIT_GRID and FINISH_IN_TILE:
        row_mask = rows < M
        finish_tile(out_ptr, partial_ptr, counter_ptr, tl.trans(total), rows, row_mask, cols, M, N, stride_om, True)
    elif SPLIT_GRID:
        chunk_sum = partial_ptr + tl.program_id(2).to(tl.int64) * M * N + rows[None, :] * N + cols[:, None]
        tl.store(chunk_sum, total, mask=(cols[:, None] < N) & (rows[None, :] < M))
    else:
        out = out_ptr + batch * stride_ob + rows[None, :] * stride_om + cols[:, None] * stride_on
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=(cols[:, None] < N) & (rows[None, :] < M))


@triton.jit
def _chunk_sums_kernel(partial_ptr, out_ptr, M, N, chunks, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    # out[r, c] = the chunk sums partial[:, r, c] added from zero in chunk order: finish_tile's additions, its loads
    # CHUNKS_PER_LOAD at a time too (those past the last chunk give +0.0, which changes no bit of the sum).
    await_inputs(PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    end = chunks * M * N  # the offsets of real chunks lie below it
    for first in range(0, chunks, CHUNKS_PER_LOAD):
        for j in tl.static_range(CHUNKS_PER_LOAD):
            at = (first + j) * M * N + offsets
            total += tl.load(partial_ptr + at, mask=mask & (at < end), other=0.0)
    out = out_ptr + (offsets // N) * stride_om + offsets % N
    tl.store(out, to_output_dtype(total, out_ptr), mask=mask)


def k_chunk(n: int, k: int) -> int:
    """K columns per chunk of a product with N columns: a whole number of K steps, at least :data:`_MIN_CHUNK`, as
    many chunks as :data:`_TARGET_PROGRAMS` column tiles would want (one chunk when the columns give programs
    enough). Depends on ``(n, k)`` only."""
    tiles = triton.cdiv(n, _CHUNK_RULE_COLUMNS)
    chunks = max(1, min(k // _MIN_CHUNK, triton.cdiv(_TARGET_PROGRAMS, tiles)))
    return max(1, triton.cdiv(triton.cdiv(k, chunks), BLOCK_K)) * BLOCK_K


def row_tile(m: int, tensor_cores: bool, chunked: bool) -> RowTile:
    """The tile of an M-row product (:data:`ROW_TILES`; beyond 64 rows on the tensor cores, 256 columns of ``b`` for
    a product of one K chunk)."""
    tiles = ROW_TILES if tensor_cores else _FMA_ROW_TILES
    if tensor_cores and not chunked and m > tiles[-2].block_m:
        return _WIDE_TILE
    return next((tile for tile in tiles if m <= tile.block_m), tiles[-1])


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tile: RowTile | None = None) -> None:
    """``out[i] = a[i] @ b[i]`` with FP32 accumulation in a K order fixed by (N, K), rounded once (contract of
    ``reference.matmul.invariant_matmul``).

    Args:
        a: [B, M, K] bf16/fp16/fp32, any strides.
        b: [B, K, N] bf16/fp16/fp32, any strides.
        out: [B, M, N] bf16/fp16/fp32; written.
        tile: the program tile (default :func:`row_tile`); any tile gives the same bits (benchmarks time others).
    """
    check_launchable(a=a, b=b, out=out)
    batches, m, k = a.shape
    n = b.shape[2]
    if not out.numel():
        return
    native = (a.dtype, b.dtype) in _TENSOR_CORE_PAIRS and not triton_interpreter_enabled()
    chunk = k_chunk(n, k)
    chunks = triton.cdiv(k, chunk)
    tile = tile or row_tile(m, native, chunks > 1)
    row_tiles, col_tiles = triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n)
    tiles = {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": BLOCK_K,
        "NATIVE_DOT": native,
        "CHUNKED": chunks > 1,
    }
    launch = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    split = (
        batches == 1
        and chunks > 1
        and row_tiles * col_tiles < _TARGET_PROGRAMS
        and chunks * m * n * 4 <= _SPLIT_MAX_BYTES
        and out.stride(2) == 1
    )
    if split:
        partial = torch.empty((chunks, m, n), dtype=torch.float32, device=out.device)
        in_tile = m <= _TILE_FINISH_MAX_ROWS
        counters = split_counters(out.device, row_tiles * col_tiles) if in_tile else partial
        _matmul_kernel[(row_tiles, col_tiles, chunks)](
            a, b, out, partial, counters, m, n, k, chunk, *a.stride(), *b.stride(), *out.stride(),
            SPLIT_GRID=True, FINISH_IN_TILE=in_tile, **tiles, **launch,
            **dependent_launch(out.device),
        )  # fmt: skip
        if not in_tile:
            _chunk_sums_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](
                partial, out, m, n, chunks, out.stride(1), BLOCK=_SUM_BLOCK, num_warps=4, **dependent_launch(out.device)
            )
        return
    # CUDA grids allow 65535 programs along the batch axis; more batch entries run in several launches.
    for start in range(0, batches, _MAX_GRID_Z):
        stop = min(start + _MAX_GRID_Z, batches)
        _matmul_kernel[(row_tiles, col_tiles, stop - start)](
            a[start:stop], b[start:stop], out[start:stop], out, out, m, n, k, chunk,
            *a.stride(), *b.stride(), *out.stride(), SPLIT_GRID=False, FINISH_IN_TILE=False, **tiles, **launch,
            **dependent_launch(out.device),
        )  # fmt: skip
