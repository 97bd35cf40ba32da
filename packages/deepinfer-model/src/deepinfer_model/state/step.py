"""``StepMetadata``: index math shared by every layer of one forward step, derived once from a ``ForwardBatch``.

It answers, for the step's tokens and for positions of their requests, "is this position part of the current chunk
(read it from the freshly computed tensors) or history (read it from the cache)?", and where cache rows live:

    paged row b of request r (c tokens/row, P = block_size / c rows per page):
        flat = block_table[r, b // P] · P + b mod P                     (pool viewed as [num_blocks·P, bytes])
    ring row of position p of request r (ring of S rows per state slot):
        flat = state_slots[r] · S + p mod S                             (pool viewed as [num_slots·S, bytes])

Index tensors that every layer would otherwise recompute identically (ring rows of a ring size, a RoPE table, a
compress ratio's new rows) are built once per step and kept in the metadata's ``StepMemo``
(docs/design/attention.md, "Step-invariant index math").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch

from deepinfer_kernels import paged_rows, position_sources
from deepinfer_model.forward_batch import ForwardBatch

__all__ = ["StepMemo", "StepMetadata"]

_T = TypeVar("_T")


class StepMemo:
    """Values computed once per step and reused by every layer that asks with the same key.

    The owner (a ``StepMetadata``, or a ``StepContext`` for values that also read its cross-layer items) is built
    anew by every forward, inside a captured CUDA graph too, so nothing memoized outlives the step; a memoized tensor
    is created by the first layer that asks and read, never modified, by the others.
    """

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()`` on the first call with ``key``, the same value on later calls.

        ``key`` must name everything ``build`` reads besides the owner's step data (sizes, ratios, layer roles):
        equal keys must mean equal values.
        """
        if key not in self._values:
            self._values[key] = build()
        return cast(_T, self._values[key])

    def clear(self) -> None:
        """Forget every value (the owner's step data changed)."""
        self._values.clear()


@dataclass(frozen=True)
class StepMetadata:
    """Per-step indices (all int64 on the batch's device).

    Attributes:
        token_request: [T] request index of each token.
        positions: [T] absolute positions.
        q_start: [R] position of each request's first query token.
        q_len: [R] query tokens per request.
        cu_query_lens: [R + 1] token offsets.
        context_lens: [R] tokens per request after the step.
        block_table: [R, max_blocks] pages of the PAGED groups.
        state_slots: [R] state slot of each request.
        max_query_len: host int, longest query of the step.
        max_context_len: host int, longest context after the step (a step may pass any larger bound: it only bounds
            the indexer's streamed row loop, which a CUDA graph needs fixed; no tensor is sized by it).
        window_floor: [R] ``rect_lo`` of YOCO prefill truncation, the lowest position a consumer layer's window may
            read (docs/design/attention.md, "YOCO prefill truncation"); None when the step is not truncated.
        floor_stores: ring stores skip positions below ``window_floor`` (the consumer half under ``compact``).
        memo: index tensors derived from these fields alone, built once per step (``StepMemo``; a metadata made by
            ``dataclasses.replace`` starts with an empty one).
    """

    token_request: torch.Tensor
    positions: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    cu_query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    state_slots: torch.Tensor
    max_query_len: int
    max_context_len: int
    window_floor: torch.Tensor | None = None
    floor_stores: bool = False
    memo: StepMemo = field(default_factory=StepMemo, init=False, repr=False, compare=False)

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> StepMetadata:
        cu = batch.cu_query_lens.long()
        q_len = cu[1:] - cu[:-1]
        context = batch.context_lens.long()
        max_query = batch.max_query_len
        if max_query is None:
            max_query = int(q_len.max().item()) if batch.num_requests else 0
        if batch.num_tokens == batch.num_requests * max_query:  # uniform: a static shape, no device sync
            token_request = torch.arange(batch.num_requests, device=cu.device).repeat_interleave(max_query)
        else:
            token_request = torch.repeat_interleave(
                torch.arange(batch.num_requests, device=cu.device), q_len, output_size=batch.num_tokens
            )
        max_context = batch.max_context_len
        if max_context is None:
            max_context = int(context.max().item()) if batch.num_requests else 0
        return cls(
            token_request=token_request,
            positions=batch.positions.long(),
            q_start=context - q_len,
            q_len=q_len,
            cu_query_lens=cu,
            context_lens=context,
            block_table=batch.block_table.long(),
            state_slots=batch.state_slots.long(),
            max_query_len=max_query,
            max_context_len=max_context,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_uniform(self) -> bool:
        """Every request computes the same number of tokens, ``max_query_len`` (known on the host): decode steps
        (one token each), verify steps with equal draft counts, DSpark draft blocks, one-request prefill chunks.

        Uniform steps take static-shape code paths (no boolean-mask indexing, no data-dependent row counts), so the
        same forward can be captured in a CUDA graph (docs/design/scheduler.md, "CUDA graphs").
        """
        return self.num_tokens == int(self.q_len.shape[0]) * self.max_query_len

    def ring_rows(self, request: torch.Tensor, position: torch.Tensor, ring_size: int) -> torch.Tensor:
        """Flat ring row of ``position`` of ``request`` (positions must be ≥ 0 where used)."""
        return self.state_slots[request] * ring_size + torch.remainder(position, ring_size)

    def paged_rows(self, request: torch.Tensor, row: torch.Tensor, rows_per_block: int) -> torch.Tensor:
        """Flat paged rows of logical rows ``row`` ([N] or [N, K]) of ``request`` [N], −1 where a row is negative
        (``deepinfer_kernels.paged_rows``: one launch on NVIDIA)."""
        return paged_rows(self.block_table, request, row, rows_per_block)

    def ring_tail(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Flat ring rows the step stores (docs/design/cache.md, "Rings") and which tokens they hold.

        Returns:
            ``(rows [N] int64, keep)``: ``keep`` is the [N] int64 index of the ``ring_write_tokens`` (then the rows
            belong to ``tokens[keep]``; ``ring_write_indices``), or None when no query is longer than the ring, so
            every token is its request's ring tail and ``rows`` has one entry per token (no data-dependent shape).
            Built once per ring size (``memo``): the window rings of every layer and the DSpark rings store the same
            rows.
        """
        return self.memo.get(("ring_tail", ring_size), lambda: self._ring_tail(ring_size))

    def _ring_tail(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.max_query_len <= ring_size:
            return self._token_ring_rows(self.token_request, self.positions, ring_size), None
        keep = self.ring_write_indices(ring_size)
        return self._token_ring_rows(self.token_request[keep], self.positions[keep], ring_size), keep

    def ring_write_indices(self, ring_size: int) -> torch.Tensor:
        """[N] int64, ascending: the tokens of ``ring_write_tokens``.

        A uniform step with no floor keeps the last ``min(max_query_len, ring_size)`` tokens of every request, a
        count the host knows, so the indices are built with no device sync (a long prompt's chunk: the host would
        otherwise wait for the device once per layer that stores a ring). Otherwise they come from the mask, one
        sync.
        """
        if self.is_uniform and not (self.floor_stores and self.window_floor is not None):
            per_request, kept = self.max_query_len, min(self.max_query_len, ring_size)
            device = self.positions.device
            first = torch.arange(int(self.q_len.shape[0]), device=device) * per_request + (per_request - kept)
            return (first[:, None] + torch.arange(kept, device=device)).flatten()
        return torch.nonzero(self.ring_write_tokens(ring_size)).squeeze(1)

    def _token_ring_rows(self, request: torch.Tensor, position: torch.Tensor, ring_size: int) -> torch.Tensor:
        # ring_rows of positions the step computes (each below its request's context), in one launch on NVIDIA.
        sources = position_sources(
            request, position, 1, self.q_start, self.cu_query_lens, self.context_lens, self.state_slots, ring_size,
            self.num_tokens,
        )  # fmt: skip
        return sources[1][:, 0]

    def ring_write_tokens(self, ring_size: int) -> torch.Tensor:
        """[T] bool: the token is among the last ``min(q_len, ring_size)`` tokens of its request (older chunk tokens
        would be overwritten within the same write; docs/design/cache.md, "Rings"), and not below ``window_floor``
        when ``floor_stores``."""
        end = self.q_start[self.token_request] + self.q_len[self.token_request]
        keep = self.positions >= end - ring_size
        if self.floor_stores and self.window_floor is not None:
            keep &= self.positions >= self.window_floor[self.token_request]
        return keep
