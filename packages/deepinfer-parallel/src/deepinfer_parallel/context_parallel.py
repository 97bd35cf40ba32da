"""Balanced ("mirror") context parallelism for prefill: splitting tokens over CP ranks and merging results.

Each request's prefill chunk of L tokens is cut into 2 * cp blocks of ceil(L / (2 * cp)) tokens (the last blocks
padded); CP rank r takes blocks r and 2 * cp - 1 - r. Under causal attention block b costs ~b, so pairing an early
block with its mirror gives every rank the same work:

    L = 10, cp = 2, block = ceil(10 / 4) = 3          blocks:  0: t0-t2  1: t3-t5  2: t6-t8  3: t9 + 2 pad
    rank 0 <- blocks 0, 3 = t0 t1 t2 t9 pad pad
    rank 1 <- blocks 1, 2 = t3 t4 t5 t6 t7 t8

For a batch, every request is split this way and each rank's pieces are concatenated in request order, so all
ranks hold the same number of local rows (padding included) and can all-gather with fixed-size buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_parallel.comm import all_gather_into
from deepinfer_parallel.groups import RankGroup

__all__ = [
    "ContextParallelSplit",
    "all_gather_to_token_order",
    "balanced_block_size",
    "balanced_split",
    "gather_local_tokens",
    "restore_token_order",
]


def balanced_block_size(num_tokens: int, cp_size: int) -> int:
    """Tokens per block when `num_tokens` are cut into 2 * cp_size blocks: ceil(num_tokens / (2 * cp_size))."""
    if num_tokens < 0 or cp_size < 1:
        raise ValueError(f"need num_tokens >= 0 and cp_size >= 1, got num_tokens={num_tokens}, cp_size={cp_size}")
    return -(-num_tokens // (2 * cp_size))


@dataclass(frozen=True)
class ContextParallelSplit:
    """Which original token each CP rank's local row holds.

    Attributes:
        cp_size: CP ranks.
        num_tokens: tokens of the packed batch (sum of request lengths).
        token_index: [cp_size, num_local_tokens] int64 index into the packed batch; 0 on padding rows.
        valid: [cp_size, num_local_tokens] bool; False on padding rows.
        positions: [cp_size, num_local_tokens] int64 position within the request; -1 on padding rows.
        request_index: [cp_size, num_local_tokens] int64 request of each row; -1 on padding rows.
    """

    cp_size: int
    num_tokens: int
    token_index: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    request_index: torch.Tensor

    @property
    def num_local_tokens(self) -> int:
        """Rows per CP rank, padding included."""
        return int(self.token_index.shape[1])


def balanced_split(seq_lens: Sequence[int], cp_size: int) -> ContextParallelSplit:
    """Split a packed prefill batch over CP ranks (see the module docstring).

    Args:
        seq_lens: tokens of each request in this step, in packing order (each >= 0).
        cp_size: CP ranks (>= 1).

    Returns:
        The split, as CPU tensors.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if any(length < 0 for length in seq_lens):
        raise ValueError(f"seq_lens must be >= 0, got {list(seq_lens)}")
    num_blocks = 2 * cp_size
    starts = [0]
    for length in seq_lens:
        starts.append(starts[-1] + length)
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(cp_size)]
    for request, length in enumerate(seq_lens):
        block = balanced_block_size(length, cp_size)
        offsets = torch.arange(block, dtype=torch.int64)
        for rank in range(cp_size):
            for block_id in (rank, num_blocks - 1 - rank):
                position = block_id * block + offsets
                per_rank[rank].append(torch.stack([position, torch.full_like(position, request)]))
    pieces = [torch.cat(p, dim=1) if p else torch.empty(2, 0, dtype=torch.int64) for p in per_rank]
    stacked = torch.stack(pieces)  # [cp, 2, num_local]: (position in request, request) per row
    row_position, row_request = stacked[:, 0], stacked[:, 1]
    lengths = torch.tensor(list(seq_lens), dtype=torch.int64)
    valid = row_position < lengths[row_request]
    token_start = torch.tensor(starts[:-1], dtype=torch.int64)
    return ContextParallelSplit(
        cp_size=cp_size,
        num_tokens=starts[-1],
        token_index=torch.where(valid, token_start[row_request] + row_position, 0),
        valid=valid,
        positions=torch.where(valid, row_position, -1),
        request_index=torch.where(valid, row_request, -1),
    )


def gather_local_tokens(x: torch.Tensor, split: ContextParallelSplit, cp_rank: int) -> torch.Tensor:
    """Rows of the packed batch that `cp_rank` processes, padding rows zeroed.

    Args:
        x: [num_tokens, ...] packed batch tensor (hidden states, positions, ...).
        split: from `balanced_split`.
        cp_rank: this rank's index in the CP group.

    Returns:
        [num_local_tokens, ...] with x's dtype and device.
    """
    if x.shape[0] != split.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows, the split covers {split.num_tokens} tokens")
    if not 0 <= cp_rank < split.cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, {split.cp_size})")
    index = split.token_index[cp_rank].to(x.device)
    valid = split.valid[cp_rank].to(x.device)
    rows = x[index] if x.shape[0] else x.new_zeros((index.shape[0], *x.shape[1:]))
    mask = valid.reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=x.dtype, device=x.device))


def restore_token_order(gathered: torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
    """Put every rank's local rows back into packed-batch order, dropping padding.

    Args:
        gathered: [cp_size * num_local_tokens, ...] rank 0's rows first (as all-gather produces them).
        split: from `balanced_split`.

    Returns:
        [num_tokens, ...] with gathered's dtype and device.
    """
    expected = split.cp_size * split.num_local_tokens
    if gathered.shape[0] != expected:
        raise ValueError(f"gathered has {gathered.shape[0]} rows, expected cp_size * num_local_tokens = {expected}")
    valid = split.valid.reshape(-1).to(gathered.device)
    index = split.token_index.reshape(-1).to(gathered.device)[valid]
    out = gathered.new_empty((split.num_tokens, *gathered.shape[1:]))
    out[index] = gathered[valid]
    return out


def all_gather_to_token_order(
    local: torch.Tensor, split: ContextParallelSplit, group: RankGroup, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """All-gather every CP rank's local rows and return them in packed-batch order (e.g. K/V or outputs).

    Args:
        local: [num_local_tokens, ...] this rank's rows.
        split: from `balanced_split`.
        group: the CP group (size must equal split.cp_size).
        buffer: optional preallocated [cp_size * num_local_tokens, ...] gather buffer.

    Returns:
        [num_tokens, ...].
    """
    if group.size != split.cp_size:
        raise ValueError(f"CP group of size {group.size} does not match a split over {split.cp_size} ranks")
    if buffer is None:
        buffer = local.new_empty((group.size * local.shape[0], *local.shape[1:]))
    all_gather_into(buffer, local.contiguous(), group)
    return restore_token_order(buffer, split)
