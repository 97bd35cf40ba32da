"""Public cache-row lookups (docs/design/kernels.md, "paged_rows", "window_key_rows", "Position sources"): validation
and allocation, then the resolved backend (one Triton launch each on NVIDIA where PyTorch takes about eight, twenty,
nine and seventeen)."""

from __future__ import annotations

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["paged_rows", "position_sources", "uniform_compressed_rows", "window_key_rows"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_int64(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, (torch.int64,))


def _check_per_request(requests: int, cu_query_lens: torch.Tensor | None = None, **tensors: torch.Tensor) -> None:
    wrong = {name: tuple(t.shape) for name, t in tensors.items() if tuple(t.shape) != (requests,)}
    if cu_query_lens is not None and tuple(cu_query_lens.shape) != (requests + 1,):
        wrong["cu_query_lens"] = tuple(cu_query_lens.shape)
    if wrong:
        raise ValueError(f"per-request tensors must be [R] (cu_query_lens [R + 1]) with R = {requests}, got {wrong}")


def paged_rows(
    block_table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rows_per_block: int
) -> torch.Tensor:
    """Flat pool rows of logical rows: ``block_table[request[i], r // rows_per_block] · rows_per_block +
    r mod rows_per_block`` for each ``r = rows[i, …]``, and −1 where ``r`` is negative or names a block or request
    outside the table.

    Args:
        block_table: [R, B] int32/int64, each request's pages.
        request: [N] int32/int64, the request of each row of ``rows``.
        rows: [N] or [N, K] int32/int64 logical rows (−1 for none).
        rows_per_block: rows per page, at least 1.

    Returns:
        int64 tensor of ``rows``' shape, contiguous.

    Raises:
        TypeError: a tensor is not a tensor or not an integer tensor.
        ValueError: shapes disagree, ``rows_per_block`` is below 1, or devices differ.
    """
    for name, tensor in (("block_table", block_table), ("request", request), ("rows", rows)):
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, _INDEX_DTYPES)
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [R, B], got shape {tuple(block_table.shape)}")
    if rows.dim() not in (1, 2):
        raise ValueError(f"rows must be [N] or [N, K], got shape {tuple(rows.shape)}")
    if tuple(request.shape) != (rows.shape[0],):
        raise ValueError(f"request must have shape ({rows.shape[0]},) to match rows, got {tuple(request.shape)}")
    if not isinstance(rows_per_block, int) or rows_per_block < 1:
        raise ValueError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
    check_same_device(block_table=block_table, request=request, rows=rows)
    out = torch.empty(rows.shape, dtype=torch.int64, device=rows.device)
    if out.numel():
        _registry.resolve("paged_rows", rows.device.type)(
            block_table.contiguous(), request.contiguous(), rows.contiguous(), rows_per_block, out
        )
    return out


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each query's sliding-window keys are read from: a request's ring of past keys, or this step's keys.

    For query ``i`` of request ``r = token_request[i]`` and ``w < window``, key position
    ``p = positions[i] − window + 1 + w`` is not read (−1 in both outputs) where ``p < 0`` or, with a floor,
    ``p < window_floor[r]``; else, computed this step (``p ≥ q_start[r]``), it is step key
    ``own = clamp(cu_query_lens[r] + p − q_start[r], 0, num_key_tokens − 1)``; else ring row
    ``history = state_slots[r] · ring + p mod ring``.

    Args:
        positions: [T] int64 query positions.
        token_request: [T] int64 request of each query.
        q_start: [R] int64 first position each request's keys compute this step.
        cu_query_lens: [R + 1] int64 first step key of each request.
        state_slots: [R] int64 ring slot of each request.
        window_floor: [R] int64 lowest position a query may see, or None for none.
        ring: rows of a request's ring, at least 1.
        window: keys a query sees, at least 1.
        num_key_tokens: the step's key tokens.

    Returns:
        ``(history, own)``: [T, window] int64 each, −1 where not read from there.

    Raises:
        TypeError: a tensor is not a tensor or not int64.
        ValueError: shapes disagree, ``ring`` or ``window`` is below 1, or devices differ.
    """
    named = {
        "positions": positions,
        "token_request": token_request,
        "q_start": q_start,
        "cu_query_lens": cu_query_lens,
        "state_slots": state_slots,
        **({} if window_floor is None else {"window_floor": window_floor}),
    }
    _check_int64(**named)
    if positions.dim() != 1 or tuple(token_request.shape) != tuple(positions.shape):
        raise ValueError(
            f"positions and token_request must both be [T], got {tuple(positions.shape)}, {tuple(token_request.shape)}"
        )
    requests = q_start.shape[0] if q_start.dim() == 1 else -1
    if (
        requests < 0
        or tuple(cu_query_lens.shape) != (requests + 1,)
        or tuple(state_slots.shape) != (requests,)
        or (window_floor is not None and tuple(window_floor.shape) != (requests,))
    ):
        raise ValueError(
            "q_start, state_slots and window_floor must be [R] and cu_query_lens [R + 1], got "
            f"{tuple(q_start.shape)}, {tuple(state_slots.shape)}, "
            f"{None if window_floor is None else tuple(window_floor.shape)}, {tuple(cu_query_lens.shape)}"
        )
    if not isinstance(ring, int) or ring < 1 or not isinstance(window, int) or window < 1:
        raise ValueError(f"ring and window must be ints >= 1, got {ring!r} and {window!r}")
    check_same_device(**named)
    history = torch.empty((positions.shape[0], window), dtype=torch.int64, device=positions.device)
    own = torch.empty_like(history)
    if history.numel():
        _registry.resolve("window_key_rows", positions.device.type)(
            *(t.contiguous() for t in (positions, token_request, q_start, cu_query_lens, state_slots)),
            None if window_floor is None else window_floor.contiguous(),
            ring,
            window,
            num_key_tokens,
            history,
            own,
        )
    return history, own


def uniform_compressed_rows(
    q_start: torch.Tensor, context_lens: torch.Tensor, ratio: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed rows of ratio ``ratio`` a uniform step touches (docs/design/attention.md, "KV compressor"):
    ``count`` rows per request, row ``j`` of request ``r`` being ``min(q_start[r] // ratio + j,
    (context_lens[r] − 1) // ratio)`` (floor divisions; the last row repeated where the step touches fewer).

    Args:
        q_start: [R] int64 first position each request computes this step.
        context_lens: [R] int64 tokens of each request after the step.
        ratio: the compress ratio, at least 1.
        count: rows per request, at least 0.

    Returns:
        ``(request, row)``: [R · count] int64 each, request-major.

    Raises:
        TypeError: a tensor is not a tensor or not int64.
        ValueError: shapes disagree, ``ratio`` or ``count`` is out of range, or devices differ.
    """
    _check_int64(q_start=q_start, context_lens=context_lens)
    if q_start.dim() != 1:
        raise ValueError(f"q_start must be [R], got shape {tuple(q_start.shape)}")
    _check_per_request(q_start.shape[0], context_lens=context_lens)
    if not isinstance(ratio, int) or ratio < 1 or not isinstance(count, int) or count < 0:
        raise ValueError(f"ratio must be an int >= 1 and count an int >= 0, got {ratio!r} and {count!r}")
    check_same_device(q_start=q_start, context_lens=context_lens)
    request = torch.empty(q_start.shape[0] * count, dtype=torch.int64, device=q_start.device)
    row = torch.empty_like(request)
    if row.numel():
        _registry.resolve("uniform_compressed_rows", row.device.type)(
            q_start.contiguous(), context_lens.contiguous(), ratio, count, request, row
        )
    return request, row


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where positions ``row[i] · ratio … row[i] · ratio + ratio − 1`` are read from: this step's tokens or the
    request's ring of ``ring`` rows. With ``ratio = c`` and compressed rows: a row's ``c`` positions (the compressor's
    sources, docs/design/attention.md, "KV compressor"); with ``ratio = 1`` and positions as the rows: single
    positions (where the step's tokens go in a ring).

    Position ``j`` of entry ``i`` (request ``r = request[i]``) is ``p = min(row[i] · ratio + j, context_lens[r] − 1)``
    (a compressed row not complete yet repeats the last computed position). It is computed this step where
    ``p ≥ q_start[r]``, as token ``clamp(cu_query_lens[r] + p − q_start[r], 0, num_tokens − 1)``; the ring holds it
    at row ``state_slots[r] · ring + p mod ring`` (floor remainder).

    Args:
        request, row: [N] int64 entries (compressed rows, e.g. ``uniform_compressed_rows``'s, or positions).
        ratio: positions per entry, at least 1.
        q_start, context_lens, state_slots: [R] int64 per request; cu_query_lens: [R + 1] int64.
        ring: rows of a request's ring, at least 1.
        num_tokens: the step's tokens.

    Returns:
        ``(token, ring_row, in_chunk)``: [N, ratio] int64, int64 and bool.

    Raises:
        TypeError: a tensor is not a tensor or not int64.
        ValueError: shapes disagree, ``ratio`` or ``ring`` is below 1, or devices differ.
    """
    named = {
        "request": request,
        "row": row,
        "q_start": q_start,
        "cu_query_lens": cu_query_lens,
        "context_lens": context_lens,
        "state_slots": state_slots,
    }
    _check_int64(**named)
    if row.dim() != 1 or tuple(request.shape) != tuple(row.shape):
        raise ValueError(f"request and row must both be [N], got {tuple(request.shape)}, {tuple(row.shape)}")
    if q_start.dim() != 1:
        raise ValueError(f"q_start must be [R], got shape {tuple(q_start.shape)}")
    _check_per_request(q_start.shape[0], cu_query_lens, context_lens=context_lens, state_slots=state_slots)
    if not isinstance(ratio, int) or ratio < 1 or not isinstance(ring, int) or ring < 1:
        raise ValueError(f"ratio and ring must be ints >= 1, got {ratio!r} and {ring!r}")
    check_same_device(**named)
    token = torch.empty((row.shape[0], ratio), dtype=torch.int64, device=row.device)
    ring_row = torch.empty_like(token)
    in_chunk = torch.empty(token.shape, dtype=torch.bool, device=row.device)
    if token.numel():
        _registry.resolve("position_sources", row.device.type)(
            *(t.contiguous() for t in (request, row)),
            ratio,
            *(t.contiguous() for t in (q_start, cu_query_lens, context_lens, state_slots)),
            ring,
            num_tokens,
            token,
            ring_row,
            in_chunk,
        )
    return token, ring_row, in_chunk
