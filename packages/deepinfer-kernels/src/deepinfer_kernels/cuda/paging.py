"""Triton cache-row lookups (docs/design/kernels.md, "paged_rows", "window_key_rows").

- paged_rows: one launch for the division, the table gather, the product, the remainder and the −1 of missing rows,
  which PyTorch runs as about eight kernels.
- window_key_rows: one launch for a step's sliding-window key rows (the positions, the floor, the chunk test, the ring
  rows and the step rows), about twenty kernels in PyTorch.
- uniform_compressed_rows, position_sources: one launch each for a decode step's new compressed rows and for where
  positions are read from (the rows' positions, a ring's new rows), about nine and seventeen kernels in PyTorch.

Division and remainder follow torch's floor rounding where an operand may be negative (a padded request's context of
0): Triton's ``//`` and ``%`` truncate toward zero.
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch

__all__ = ["paged_rows", "position_sources", "uniform_compressed_rows", "window_key_rows"]

_BLOCK = 1024


@triton.jit
def _floor_div(a, b):  # type: ignore[no-untyped-def]
    # b > 0: a // b rounded toward −inf, as torch.div(..., rounding_mode="floor").
    q = a // b
    return tl.where((a % b != 0) & (a < 0), q - 1, q)


@triton.jit
def _floor_mod(a, b):  # type: ignore[no-untyped-def]
    # b > 0: the remainder in [0, b), as torch.remainder.
    r = a % b
    return tl.where(r < 0, r + b, r)


@triton.jit
def _paged_rows_kernel(  # type: ignore[no-untyped-def]
    table_ptr, request_ptr, rows_ptr, out_ptr, total, per_request, table_rows, table_cols, rows_per_block,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    row = tl.load(rows_ptr + i, mask=live, other=-1).to(tl.int64)
    request = tl.load(request_ptr + i // per_request, mask=live, other=-1).to(tl.int64)
    page_index = tl.maximum(row, 0) // rows_per_block
    valid = (row >= 0) & (page_index < table_cols) & (request >= 0) & (request < table_rows)
    page = tl.load(table_ptr + request * table_cols + page_index, mask=live & valid, other=0).to(tl.int64)
    tl.store(out_ptr + i, tl.where(valid, page * rows_per_block + row % rows_per_block, -1), mask=live)


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rows_per_block: int, out: torch.Tensor
) -> None:
    """Triton ``deepinfer_kernels.paged_rows`` (contiguous tensors, shapes there)."""
    check_launchable(block_table=block_table, request=request, rows=rows, out=out)
    total = rows.numel()
    per_request = total // max(rows.shape[0], 1)
    _paged_rows_kernel[(triton.cdiv(total, _BLOCK),)](
        block_table, request, rows, out, total, per_request, block_table.shape[0], block_table.shape[1],
        rows_per_block, BLOCK=_BLOCK,
        **dependent_launch(block_table.device),
    )  # fmt: skip


@triton.jit
def _window_key_rows_kernel(  # type: ignore[no-untyped-def]
    positions_ptr, request_ptr, q_start_ptr, cu_ptr, slots_ptr, floor_ptr, history_ptr, own_ptr, total, ring,
    last_key, WINDOW: tl.constexpr, FLOORED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    query = i // WINDOW
    request = tl.load(request_ptr + query, mask=live, other=0)
    position = tl.load(positions_ptr + query, mask=live, other=0) - (WINDOW - 1) + i % WINDOW
    seen = position >= 0
    if FLOORED:
        seen = seen & (position >= tl.load(floor_ptr + request, mask=live, other=0))
    start = tl.load(q_start_ptr + request, mask=live, other=0)
    in_chunk = position >= start
    # Read only where position ≥ 0, so C's remainder equals the floor one there.
    ring_row = tl.load(slots_ptr + request, mask=live, other=0) * ring + position % ring
    step_row = tl.load(cu_ptr + request, mask=live, other=0) + position - start
    step_row = tl.minimum(tl.maximum(step_row, 0), last_key)
    tl.store(history_ptr + i, tl.where(seen & (~in_chunk), ring_row, -1), mask=live)
    tl.store(own_ptr + i, tl.where(seen & in_chunk, step_row, -1), mask=live)


def window_key_rows(
    positions: torch.Tensor,
    token_request: torch.Tensor,
    q_start: torch.Tensor,
    cu_query_lens: torch.Tensor,
    state_slots: torch.Tensor,
    window_floor: torch.Tensor | None,
    ring: int,
    window: int,
    num_key_tokens: int,
    history: torch.Tensor,
    own: torch.Tensor,
) -> None:
    """Triton ``deepinfer_kernels.window_key_rows`` (contiguous tensors, shapes there)."""
    check_launchable(
        positions=positions, token_request=token_request, q_start=q_start, cu_query_lens=cu_query_lens,
        state_slots=state_slots, history=history, own=own,
    )  # fmt: skip
    total = history.numel()
    _window_key_rows_kernel[(triton.cdiv(total, _BLOCK),)](
        positions, token_request, q_start, cu_query_lens, state_slots,
        positions if window_floor is None else window_floor, history, own, total, ring, max(num_key_tokens - 1, 0),
        WINDOW=window, FLOORED=window_floor is not None, BLOCK=_BLOCK,
        **dependent_launch(positions.device),
    )  # fmt: skip


@triton.jit
def _uniform_rows_kernel(  # type: ignore[no-untyped-def]
    q_start_ptr, context_ptr, request_ptr, row_ptr, total, ratio, count, BLOCK: tl.constexpr, PDL: tl.constexpr
):  # fmt: skip
    await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    request = i // count
    first = _floor_div(tl.load(q_start_ptr + request, mask=live, other=0), ratio)
    last = _floor_div(tl.load(context_ptr + request, mask=live, other=0) - 1, ratio)
    tl.store(request_ptr + i, request, mask=live)
    tl.store(row_ptr + i, tl.minimum(first + i % count, last), mask=live)


def uniform_compressed_rows(
    q_start: torch.Tensor, context_lens: torch.Tensor, ratio: int, count: int, request: torch.Tensor, row: torch.Tensor
) -> None:
    """Triton ``deepinfer_kernels.uniform_compressed_rows`` (contiguous tensors, shapes there)."""
    check_launchable(q_start=q_start, context_lens=context_lens, request=request, row=row)
    total = row.numel()
    _uniform_rows_kernel[(triton.cdiv(total, _BLOCK),)](
        q_start, context_lens, request, row, total, ratio, count, BLOCK=_BLOCK, **dependent_launch(row.device)
    )


@triton.jit
def _position_sources_kernel(  # type: ignore[no-untyped-def]
    request_ptr, row_ptr, q_start_ptr, cu_ptr, context_ptr, slots_ptr, token_ptr, ring_row_ptr, in_chunk_ptr,
    total, ring, last_token, RATIO: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    entry = i // RATIO
    request = tl.load(request_ptr + entry, mask=live, other=0)
    position = tl.load(row_ptr + entry, mask=live, other=0) * RATIO + i % RATIO
    position = tl.minimum(position, tl.load(context_ptr + request, mask=live, other=0) - 1)
    start = tl.load(q_start_ptr + request, mask=live, other=0)
    token = tl.load(cu_ptr + request, mask=live, other=0) + position - start
    ring_row = tl.load(slots_ptr + request, mask=live, other=0) * ring + _floor_mod(position, ring)
    tl.store(in_chunk_ptr + i, (position >= start).to(tl.int8), mask=live)
    tl.store(token_ptr + i, tl.minimum(tl.maximum(token, 0), last_token), mask=live)
    tl.store(ring_row_ptr + i, ring_row, mask=live)


def position_sources(
    request: torch.Tensor,
    row: torch.Tensor,
    ratio: int,
    q_start: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    state_slots: torch.Tensor,
    ring: int,
    num_tokens: int,
    token: torch.Tensor,
    ring_row: torch.Tensor,
    in_chunk: torch.Tensor,
) -> None:
    """Triton ``deepinfer_kernels.position_sources`` (contiguous tensors, shapes there)."""
    check_launchable(
        request=request, row=row, q_start=q_start, cu_query_lens=cu_query_lens, context_lens=context_lens,
        state_slots=state_slots, token=token, ring_row=ring_row, in_chunk=in_chunk,
    )  # fmt: skip
    total = token.numel()
    _position_sources_kernel[(triton.cdiv(total, _BLOCK),)](
        request, row, q_start, cu_query_lens, context_lens, state_slots, token, ring_row, in_chunk.view(torch.int8),
        total, ring, max(num_tokens - 1, 0), RATIO=ratio, BLOCK=_BLOCK,
        **dependent_launch(row.device),
    )  # fmt: skip
