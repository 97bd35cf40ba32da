"""Triton lightning-indexer scoring with a streaming top-k merge (docs/design/kernels.md, "indexer_select").

For a chunk of queries and a chunk of rows, one kernel gathers the index-K rows through the block table, decodes them
in registers, computes ``Σ_h w · relu(q · k)`` with a tensor-core dot, and writes one int64 sort key per (query, row):
the order-preserving integer of the logit in the high 32 bits and ``2^32 − 1 − row`` in the low 32 bits, so that a
larger key is a larger logit and, among equal logits, the lower row; invalid rows get the smallest int64. With
candidate blocks requested the kernel also writes one key per (query, block) from the block maxima. ``torch.topk`` of
``[running top | chunk]`` then merges chunk after chunk: exact tie semantics, shapes fixed by host ints (CUDA graphs),
memory O(query chunk × (topk + row chunk)). With BF16-rounded logits and every id below 2^16 the keys are int32
instead (the order-preserving int16 of the BF16 logit, then ``2^16 − 1 − id``): the same order, and half the radix
passes in the ``torch.topk`` merges.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import RowFormat
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.cuda.row_formats import FORMAT_CODES, decode_groups, round_bf16
from deepinfer_kernels.platform import triton_interpreter_enabled
from deepinfer_kernels.reference import indexer as reference

__all__ = ["indexer_select"]

_WORKSPACE_BYTES = 256 << 20
_MAX_ROW_CHUNK = 32768
# 32-bit sort keys hold ids (rows, candidate blocks) below this (their low 16 bits).
_KEY32_MAX_IDS = 1 << 16
_BF16_MAX: tl.constexpr = tl.constexpr(float(torch.finfo(torch.bfloat16).max))
# Rows per program (H200 sweep in docs/design/kernels.md, "What ran on the H200").
CONFIG = {"block_r": 64, "num_warps": 4}
# Queries of one request per program (BLOCK_Q; 4 × 32 heads fill a 128-row MMA), from this many tokens on.
SHARED_QUERIES = 4
SHARED_MIN_TOKENS = 64
# Row tiles per program (ROW_TILES, a power of two up to MAX_ROW_TILES) from SHARED_MIN_TOKENS tokens on: as many as
# leave at least ROW_TILE_PROGRAMS programs. A program loads its queries once for all its tiles; decode steps keep one
# tile a program (their few queries need the programs of every tile to fill the GPU).
MAX_ROW_TILES = 16
ROW_TILE_PROGRAMS = 4096


@triton.jit
def _sort_key(score, ident, valid, KEY32: tl.constexpr):  # type: ignore[no-untyped-def]
    # Order-preserving integer of the score (negative values have their magnitude bits flipped), then the id's
    # complement: a larger key is a larger score and, among equal scores, the lower id; the key type's minimum where
    # not valid. −inf and NaN scores (maximum drops a NaN) rank as one value below every finite score, as in the
    # reference: −FLT_MAX in the int64 key. KEY32: the score is BF16-exact (its FP32 bits are its BF16 bits, then 16
    # zeros) and the id below 2^16, so int16s of both are exact and order as the int64 key does; the floor is −inf
    # itself there, −FLT_MAX being no BF16 value (its high 16 bits would tie it with −BF16_MAX).
    if KEY32:
        bits = tl.maximum(score, float("-inf")).to(tl.int32, bitcast=True) >> 16
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFF)
        key = (ordered << 16) | (0xFFFF - ident.to(tl.int32))
        none = -2147483647 - 1
    else:
        bits = tl.maximum(score, -3.4028234663852886e38).to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        key = (ordered << 32) | (0xFFFFFFFF - ident.to(tl.int64))
        none = -9223372036854775807 - 1
    return tl.where(valid, key, none)


@triton.jit
def _no_keys(ROWS: tl.constexpr, COLS: tl.constexpr, KEY32: tl.constexpr):  # type: ignore[no-untyped-def]
    # [ROWS, COLS] keys of no entry: the minimum of the key type (_sort_key's invalid key).
    if KEY32:
        none = tl.full((ROWS, COLS), -2147483647 - 1, tl.int32)
    else:
        none = tl.full((ROWS, COLS), -9223372036854775807 - 1, tl.int64)
    return none


@triton.jit
def _invalid_keys(  # type: ignore[no-untyped-def]
    keys_ptr, stride_keys, block_keys_ptr, stride_block_keys, locals_, q_in, tile,
    BLOCK_R: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, KEY32: tl.constexpr,
):  # fmt: skip
    # The keys (and block keys) of a row tile past the queries' visible rows: every one the key type's minimum.
    chunk_slot = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = locals_.to(tl.int64)[:, None]
    none = _no_keys(locals_.shape[0], BLOCK_R, KEY32)
    tl.store(keys_ptr + rows * stride_keys + chunk_slot[None, :], none, mask=q_in[:, None])
    if BLOCKS:
        local_block = tile * (BLOCK_R // BS) + tl.arange(0, BLOCK_R // BS)
        none_blocks = _no_keys(locals_.shape[0], BLOCK_R // BS, KEY32)
        tl.store(block_keys_ptr + rows * stride_block_keys + local_block[None, :], none_blocks, mask=q_in[:, None])


@triton.jit
def _store_keys(  # type: ignore[no-untyped-def]
    logits, rows, valid, klens, locals_, q_in, tile, slot_start, keys_ptr, stride_keys, block_keys_ptr,
    stride_block_keys, BLOCK_R: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, ROUND: tl.constexpr,
    KEY32: tl.constexpr,
):  # fmt: skip
    # The sort keys of a tile's [queries, BLOCK_R] logits, and with BLOCKS one key per (query, candidate block) from
    # the block maxima (the query's newest block always kept). KEY32 only with ROUND (BF16-exact logits).
    if ROUND:
        logits = round_bf16(logits).to(tl.float32)
    chunk_slot = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    key = _sort_key(logits, rows, valid, KEY32)
    tl.store(keys_ptr + locals_.to(tl.int64)[:, None] * stride_keys + chunk_slot[None, :], key, mask=q_in[:, None])
    if BLOCKS:
        capped = tl.where(valid, tl.minimum(logits, _BF16_MAX), float("-inf"))
        best = tl.max(tl.reshape(capped, (locals_.shape[0], BLOCK_R // BS, BS)), axis=2)
        block_id = (slot_start + tile * BLOCK_R) // BS + tl.arange(0, BLOCK_R // BS)
        newest = (klens - 1) // BS
        best = tl.where((block_id[None, :] == newest[:, None]) & (klens[:, None] > 0), float("inf"), best)
        # A valid best is a BF16 value with ROUND (KEY32) or +inf: exact in the int32 keys.
        block_key = _sort_key(best, block_id[None, :], best > float("-inf"), KEY32)
        local_block = tile * (BLOCK_R // BS) + tl.arange(0, BLOCK_R // BS)
        block_ptrs = block_keys_ptr + locals_.to(tl.int64)[:, None] * stride_block_keys + local_block[None, :]
        tl.store(block_ptrs, block_key, mask=q_in[:, None])


@triton.jit
def _index_scores_kernel(  # type: ignore[no-untyped-def]
    q_ptr, w_ptr, pool_ptr, block_table_ptr, stride_table, request_ptr, num_rows_ptr, cand_ptr, stride_cand, num_cand,
    keys_ptr, stride_keys, block_keys_ptr, stride_block_keys, query_start, count, slot_start, span, num_tiles,
    num_heads, row_bytes, rows_per_block,
    DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, FMT: tl.constexpr,
    RESTRICTED: tl.constexpr, BS: tl.constexpr, BLOCKS: tl.constexpr, ROUND: tl.constexpr, BF16_DOT: tl.constexpr,
    BLOCK_Q: tl.constexpr, ROW_TILES: tl.constexpr, ROW_ALIGN: tl.constexpr, KEY32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # A program scores BLOCK_Q consecutive queries (BLOCK_Q > 1: all of one request, which the host knows from a
    # one-row block table; they share each gathered, decoded key tile and one [BLOCK_R, DIM] × [DIM, BLOCK_Q·heads]
    # dot) against ROW_TILES consecutive tiles of BLOCK_R rows. The queries and weights are loaded once; the tiles
    # with a row some query sees are scored in a loop, the rest (about half the tiles of a causal prefill) only get
    # invalid keys. A query's logits, validity and keys are those of the one-query, one-tile program, up to the FP32
    # order of the head sum when BLOCK_Q > 1.
    await_inputs(PDL)
    locals_ = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_in = locals_ < count
    tokens = (query_start + locals_).to(tl.int64)
    klens = tl.load(num_rows_ptr + tokens, mask=q_in, other=0).to(tl.int64)
    max_klen = tl.max(klens, axis=0)
    request = tl.load(request_ptr + tokens, mask=q_in, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_DIM)
    h = tl.arange(0, BLOCK_H)
    heads = (h < num_heads)[None, :]
    q_rows = tokens[:, None] * num_heads + h[None, :]
    q_mask = (q_in[:, None] & heads)[:, :, None] & (d < DIM)[None, None, :]
    # The queries are the dot's second operand, [DIM, BLOCK_Q·BLOCK_H]: each key row's accumulator row holds all its
    # (query, head) scores, so the head sum stays within that row's threads (as the first operand the heads spanned
    # warps and the sum went through shared memory), and the decoded keys feed the MMA from registers.
    q = tl.trans(
        tl.reshape(
            tl.load(q_ptr + q_rows[:, :, None] * DIM + d[None, None, :], mask=q_mask, other=0.0),
            (BLOCK_Q * BLOCK_H, BLOCK_DIM),
        )
    )
    if BF16_DOT:
        q = q.to(tl.bfloat16)
    weights = tl.load(w_ptr + q_rows, mask=q_in[:, None] & heads, other=0.0)
    table_row = block_table_ptr + tl.max(request, axis=0) * stride_table
    first_tile = tl.program_id(1) * ROW_TILES
    end_tile = tl.minimum(first_tile + ROW_TILES, num_tiles)
    if RESTRICTED:
        # BLOCK_Q == 1. The candidate entries of the program's tiles that hold one of the query's visible blocks are
        # a prefix of them (the list is ascending and −1 padded at the end): a tile is scored when its first is.
        entry = (slot_start + first_tile * BLOCK_R) // BS + tl.arange(0, ROW_TILES * BLOCK_R // BS)
        listed = tl.load(cand_ptr + tokens * stride_cand + entry, mask=entry * BS < span, other=-1).to(tl.int64)
        held = tl.sum(((listed >= 0) & (listed * BS < max_klen)).to(tl.int32), axis=0)
        visible_end = tl.minimum(first_tile + tl.cdiv(held * BS, BLOCK_R), end_tile)
    else:
        limit = tl.minimum(max_klen, span)
        visible_end = tl.minimum(tl.maximum(tl.cdiv(limit - slot_start, BLOCK_R), first_tile), end_tile)
    for tile in tl.range(first_tile, visible_end):
        slot = slot_start + tile * BLOCK_R + tl.arange(0, BLOCK_R)
        in_span = slot < span
        if RESTRICTED:
            block = tl.load(cand_ptr + tokens * stride_cand + slot // BS, mask=in_span, other=-1).to(tl.int64)
            rows = block * BS + slot % BS
            visible = in_span & (block >= 0) & (rows < max_klen)
        else:
            rows = slot.to(tl.int64)
            visible = in_span & (rows < max_klen)
        valid = visible[None, :] & (rows[None, :] < klens[:, None])
        # Row numbers are below 2^31 (a request's rows): the page split in int32 is inline code, where int64 division
        # by the runtime rows_per_block was a call per row.
        safe = tl.where(visible, rows, 0).to(tl.int32)
        page = tl.load(table_row + safe // rows_per_block, mask=visible, other=0).to(tl.int64)
        # Triton's alignment analysis can credit a sum of a contiguous range (slot % BS, safe % rows_per_block) with
        # its first element's divisibility, and so vectorize the row loads past their real alignment (a misaligned
        # address on the GPU): the hint sets it to what a row start truly has, row_bytes' largest power-of-two factor.
        base = tl.multiple_of((page * rows_per_block + (safe % rows_per_block)) * row_bytes, ROW_ALIGN)
        keys = decode_groups(pool_ptr, base, visible, 0, BLOCK_DIM, DIM, FMT)
        scores = tl.dot(keys.to(tl.bfloat16), q) if BF16_DOT else tl.dot(keys, q, input_precision="ieee")
        scores = tl.reshape(scores, (BLOCK_R, BLOCK_Q, BLOCK_H))
        logits = tl.trans(tl.sum(tl.maximum(scores, 0.0) * weights[None, :, :], axis=2))
        _store_keys(
            logits, rows[None, :], valid, klens, locals_, q_in, tile, slot_start, keys_ptr, stride_keys,
            block_keys_ptr, stride_block_keys, BLOCK_R, BS, BLOCKS, ROUND, KEY32,
        )  # fmt: skip
    for tile in tl.range(visible_end, end_tile):
        _invalid_keys(
            keys_ptr, stride_keys, block_keys_ptr, stride_block_keys, locals_, q_in, tile, BLOCK_R, BS, BLOCKS, KEY32
        )


@triton.jit
def _selection_kernel(  # type: ignore[no-untyped-def]
    keys_ptr, stride_keys, out_ptr, stride_out, COLS, OUT_COLS, WIDTH: tl.constexpr, KEY32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Row program: the ids of a row's COLS merged sort keys (_sort_key: the id's complement in the low 32 bits, or
    # the low 16 of an int32 key; the key type's minimum for no entry) in ascending order, then −1 for every missing
    # entry, into OUT_COLS columns.
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, WIDTH)
    none = -2147483647 - 1 if KEY32 else -9223372036854775807 - 1
    keys = tl.load(keys_ptr + row * stride_keys + cols, mask=cols < COLS, other=none)
    # The ids are int32 where _sort_key packs them, so they sort as int32: 3,216 instead of 5,040 instructions for
    # 2,048 keys at 8 warps (offline sm_90), half the shuffles and selects of an int64 sort.
    last = 2147483647  # missing entries sort last
    ids = 0xFFFF - (keys & 0xFFFF) if KEY32 else (0xFFFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32)
    ordered = tl.sort(tl.where(keys == none, last, ids))
    ids_out = tl.where(ordered == last, -1, ordered).to(tl.int64)
    tl.store(out_ptr + row * stride_out + cols, ids_out, mask=cols < OUT_COLS)


def _write_ids(out: torch.Tensor, merged: torch.Tensor, selected: int, chunk_is_selection: bool) -> None:
    # out [t, selected] gets the ids of the selection in ascending order, −1 at the end: from the merged top
    # (columns < selected), or from the chunk's keys (columns ≥ selected, at most ``selected`` of them). One launch
    # (reference.indexer.sorted_selection's order).
    keys = merged[:, selected:] if chunk_is_selection else merged[:, :selected]
    if out.shape[0] == 0:
        return
    width = triton.next_power_of_2(max(keys.shape[1], out.shape[1], 1))
    # Eight warps for the 2,048 candidate blocks: 60 registers and half the straight-line sort code of four (sm_90).
    _selection_kernel[(out.shape[0],)](
        keys, keys.stride(0), out, out.stride(0), keys.shape[1], out.shape[1], WIDTH=width,
        KEY32=keys.dtype == torch.int32, num_warps=8 if width > 512 else 4,
        **dependent_launch(keys.device),
    )  # fmt: skip


def indexer_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_format: RowFormat,
    block_table: torch.Tensor,
    rows_per_block: int,
    token_request: torch.Tensor,
    num_rows: torch.Tensor,
    max_rows: int,
    topk: int,
    round_logits_bf16: bool,
    candidates: torch.Tensor | None,
    candidate_block_size: int,
    num_candidate_blocks: int,
    out_rows: torch.Tensor,
    out_blocks: torch.Tensor | None,
) -> None:
    """See ``reference.indexer.indexer_select``. Candidate blocks whose size is not a power of two at most the row
    tile take the reference."""
    block_r = CONFIG["block_r"]
    bs = max(candidate_block_size, 1)
    if (candidates is not None or num_candidate_blocks) and (bs & (bs - 1) or bs > block_r):
        reference.indexer_select(
            q, weights, key_pool, key_format, block_table, rows_per_block, token_request, num_rows, max_rows, topk,
            round_logits_bf16, candidates, candidate_block_size, num_candidate_blocks, out_rows, out_blocks,
        )  # fmt: skip
        return
    check_launchable(q=q, weights=weights, key_pool=key_pool, block_table=block_table, num_rows=num_rows)
    num_tokens, num_heads, dim = q.shape
    if num_tokens == 0:
        return
    row_bytes = key_pool.shape[1]
    # Candidate lists are ascending and distinct, so entry j holds a block ≥ j: entries past the blocks that
    # max_rows can reach are invisible rows, and the scan stops there (the lists are as wide as the most blocks
    # any layer keeps, far more than a short context has).
    span = max_rows if candidates is None else min(candidates.shape[1], triton.cdiv(max_rows, bs)) * bs
    row_chunk = min(triton.cdiv(max(span, 1), block_r) * block_r, _MAX_ROW_CHUNK)
    blocks_per_chunk = row_chunk // bs if num_candidate_blocks else 0
    width = topk + row_chunk + num_candidate_blocks + blocks_per_chunk
    # int32 sort keys where they are exact: BF16 logits (16 bits) and ids of 16 bits. A valid row is below num_rows ≤
    # max_rows (restricted layers too, whose rows are not their slots), a block below ⌈max_rows / bs⌉. The
    # torch.topk merges (a radix select, one pass per digit) then take half the passes.
    key32 = round_logits_bf16 and max_rows <= _KEY32_MAX_IDS
    key_dtype = torch.int32 if key32 else torch.int64
    no_key = torch.iinfo(key_dtype).min
    query_chunk = max(1, min(num_tokens, _WORKSPACE_BYTES // (key_dtype.itemsize * width)))
    device = q.device
    merged = torch.empty((query_chunk, topk + row_chunk), dtype=key_dtype, device=device)
    # At least one column: Triton needs a real pointer even where the kernel writes no block keys.
    merged_blocks = torch.empty(
        (query_chunk, max(num_candidate_blocks + blocks_per_chunk, 1)), dtype=key_dtype, device=device
    )
    cand = candidates if candidates is not None else num_rows
    # Queries of one request (one block-table row: a prompt's prefill) share their key tiles: a program scores
    # SHARED_QUERIES of them. Not with candidate lists (each query's own rows), not in batch-invariant mode (a query's
    # head sum would depend on whether its request ran alone), not for a few tokens (decode).
    shared = (
        candidates is None and block_table.shape[0] == 1 and num_tokens >= SHARED_MIN_TOKENS and not invariant_kernels()
    )
    block_q = SHARED_QUERIES if shared else 1
    num_tiles = row_chunk // block_r
    row_tiles = 1
    if num_tokens >= SHARED_MIN_TOKENS:
        programs = triton.cdiv(min(num_tokens, query_chunk), block_q) * num_tiles
        while row_tiles < MAX_ROW_TILES and programs // (2 * row_tiles) >= ROW_TILE_PROGRAMS:
            row_tiles *= 2
    statics = {
        "DIM": dim,
        "BLOCK_DIM": max(triton.next_power_of_2(dim), 16),
        "BLOCK_H": max(triton.next_power_of_2(num_heads), 16),
        "BLOCK_R": block_r,
        "FMT": FORMAT_CODES[key_format],
        "RESTRICTED": candidates is not None,
        "BS": bs,
        "BLOCKS": num_candidate_blocks > 0,
        "ROUND": round_logits_bf16,
        # FP4 queries and keys are BF16-exact, so BF16 products are exact (Triton's interpreter computes BF16 dots
        # wrongly; there they run as FP32 dots).
        "BF16_DOT": key_format is not RowFormat.RAW_FP32 and not triton_interpreter_enabled(),
        "num_warps": CONFIG["num_warps"],
        "BLOCK_Q": block_q,
        "ROW_TILES": row_tiles,
        "ROW_ALIGN": min(row_bytes & -row_bytes, 16),
        "KEY32": key32,
    }
    # One chunk holding no more rows (blocks) than are selected: every valid one is selected, so the chunk's keys
    # are the selection and no top-k runs (short contexts; shapes are still host ints).
    rows_all = span <= row_chunk and row_chunk <= topk
    blocks_all = span <= row_chunk and blocks_per_chunk <= num_candidate_blocks
    for q_start in range(0, num_tokens, query_chunk):
        count = min(query_chunk, num_tokens - q_start)
        # The merged tops start empty, unless the chunk is the selection: then _write_ids reads the chunk's own keys
        # and no top is merged or read (two fill launches fewer per call at short contexts, a decode step's).
        if not rows_all:
            merged[:count, :topk] = no_key
        if not blocks_all:
            merged_blocks[:count, :num_candidate_blocks] = no_key
        for slot_start in range(0, span, row_chunk):
            _index_scores_kernel[(triton.cdiv(count, block_q), triton.cdiv(num_tiles, row_tiles))](
                q, weights, key_pool, block_table, block_table.stride(0), token_request, num_rows,
                cand, cand.stride(0), cand.shape[-1] if candidates is not None else 0,
                merged[:, topk:], merged.stride(0), merged_blocks[:, num_candidate_blocks:], merged_blocks.stride(0),
                q_start, count, slot_start, span, num_tiles, num_heads, row_bytes, rows_per_block,
                **statics,
                **dependent_launch(q.device),
            )  # fmt: skip
            if topk and not rows_all:
                merged[:count, :topk] = torch.topk(merged[:count], topk, dim=1, sorted=False).values
            if num_candidate_blocks and not blocks_all:
                top = torch.topk(merged_blocks[:count], num_candidate_blocks, dim=1, sorted=False).values
                merged_blocks[:count, :num_candidate_blocks] = top
        _write_ids(out_rows[q_start : q_start + count], merged[:count], topk, rows_all)
        if out_blocks is not None:
            _write_ids(out_blocks[q_start : q_start + count], merged_blocks[:count], num_candidate_blocks, blocks_all)
