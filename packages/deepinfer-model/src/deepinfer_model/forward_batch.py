"""``ForwardBatch``: the per-step tensors the model runner hands the model.

A step computes ``T`` query tokens of ``R`` requests, laid out request-major: request ``r`` owns tokens
``cu_query_lens[r] … cu_query_lens[r+1] − 1``, which are its positions ``context_lens[r] − q_len_r … context_lens[r]
− 1`` (a prompt chunk, one decode token, or a verify batch). There are no separate prefill/decode phases.

Cache addressing (see ``deepinfer_model.cache_spec``):

- PAGED groups (compressed rows, index-K rows) share ``block_table``: row ``b`` of a group with ``c`` raw tokens per
  row lives in page ``block_table[r, b // (block_size / c)]`` at offset ``b mod (block_size / c)``.
- SLIDING_WINDOW and STATE groups (SWA rings, C2 compressor state) live in the request's state slot
  ``state_slots[r]``; position ``p`` uses ring row ``p mod ring_size``.

Rolling back is positional: to drop the last ``k ≤ max_backtracking_tokens`` positions the runner simply feeds
positions from ``context_len − k`` again; later writes overwrite the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ForwardBatch"]


@dataclass(frozen=True)
class ForwardBatch:
    """Per-step model input.

    Attributes:
        input_ids: [T] int64 token ids.
        positions: [T] int64 absolute position of each token.
        cu_query_lens: [R + 1] int32 cumulative query lengths (request start offsets into the token dimension).
        context_lens: [R] int32 tokens of each request after this step (``seqlen_k``).
        block_table: [R, max_blocks] int32 physical page of each logical page, shared by every PAGED group; −1
            entries are unused.
        state_slots: [R] int32 state slot of each request (SLIDING_WINDOW / STATE groups).
        engram_prefix_ids: [R, N_g − 1] int64 token ids at positions ``q_start − N_g + 1 … q_start − 1`` of each
            request (entries for negative positions are ignored), or None when the model has no Engram.
        logits_indices: [N] int64 token indices whose logits are returned, or None for every token.
        max_query_len: host int, the longest query of the step (None: read from the tensors, a device sync). 1
            (every request computes one token) selects the model's static-shape decode paths.
        max_context_len: host int, the longest ``context_lens`` entry or any larger bound (None: read from the
            tensors, a device sync). It sizes the indexer's row dimension, so a fixed bound keeps every shape of a
            decode step fixed (CUDA graphs); at most ``block_table.shape[1] · block_size``.
        known_lens: [R] int32 tokens of each request known when the step was scheduled (its whole prompt, or prompt
            and outputs when recomputed; ``data_len``), which YOCO prefill truncation keeps the tail of
            (docs/design/attention.md, "YOCO prefill truncation"). None when no request of the step computes a
            prefill chunk: nothing is truncated (decode and verify steps, which CUDA graphs may capture).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    engram_prefix_ids: torch.Tensor | None = None
    logits_indices: torch.Tensor | None = None
    max_query_len: int | None = None
    max_context_len: int | None = None
    known_lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        num_requests = self.context_lens.shape[0]
        if self.input_ids.dim() != 1 or self.positions.shape != (num_tokens,):
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length, got {tuple(self.input_ids.shape)} and "
                f"{tuple(self.positions.shape)}"
            )
        if self.cu_query_lens.shape != (num_requests + 1,):
            raise ValueError(
                f"cu_query_lens must have shape ({num_requests + 1},) for {num_requests} requests, got "
                f"{tuple(self.cu_query_lens.shape)}"
            )
        if self.block_table.dim() != 2 or self.block_table.shape[0] != num_requests:
            raise ValueError(f"block_table must be [{num_requests}, max_blocks], got {tuple(self.block_table.shape)}")
        if self.state_slots.shape != (num_requests,):
            raise ValueError(f"state_slots must have shape ({num_requests},), got {tuple(self.state_slots.shape)}")
        if self.known_lens is not None and self.known_lens.shape != (num_requests,):
            raise ValueError(f"known_lens must have shape ({num_requests},), got {tuple(self.known_lens.shape)}")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return int(self.context_lens.shape[0])

    @classmethod
    def for_requests(
        cls,
        token_ids: list[list[int]],
        start_positions: list[int],
        block_table: torch.Tensor,
        state_slots: list[int],
        engram_prefix_ids: torch.Tensor | None = None,
        known_lens: list[int] | None = None,
    ) -> ForwardBatch:
        """Build a batch from per-request query tokens (a convenience for tests and simple runners).

        Args:
            token_ids: query tokens of each request.
            start_positions: position of each request's first query token.
            block_table: [R, max_blocks] int32.
            state_slots: state slot of each request.
            engram_prefix_ids: [R, N_g − 1] int64 or None.
            known_lens: each request's known length (``known_lens``), or None.
        """
        lens = [len(ids) for ids in token_ids]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat(
            [torch.arange(start, start + n, dtype=torch.int64) for start, n in zip(start_positions, lens, strict=True)]
        )
        return cls(
            input_ids=torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64),
            positions=positions,
            cu_query_lens=cu,
            context_lens=torch.tensor([s + n for s, n in zip(start_positions, lens, strict=True)], dtype=torch.int32),
            block_table=block_table,
            state_slots=torch.tensor(state_slots, dtype=torch.int32),
            engram_prefix_ids=engram_prefix_ids,
            max_query_len=max(lens, default=0),
            max_context_len=max((s + n for s, n in zip(start_positions, lens, strict=True)), default=0),
            known_lens=None if known_lens is None else torch.tensor(known_lens, dtype=torch.int32),
        )
