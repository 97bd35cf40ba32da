"""Balanced context parallelism (CP) of prefill steps (docs/design/parallelism.md, "Context parallelism").

Every rank of a CP group runs the same step (same batch, same cache layout, its own copy of the full cache). In a
step that splits (``splits_step``: some request has at least ``2·cp`` query tokens), each such request's chunk is
cut into ``2·cp`` blocks and CP rank ``r`` computes blocks ``r`` and ``2·cp − 1 − r``
(``deepinfer_parallel.balanced_split``); shorter chunks (decode tokens of the same step) go whole to the least
loaded rank (``context_parallel_split``). Padding rows repeat token 0 and are dropped again. Everything per token —
embedding, Engram, hyper-connections, q projections, attention of the query, output projections, MoE — runs on the
rank's local rows only.

Attention needs the keys of every chunk token. Each layer all-gathers its attention input (the ``attn_norm``
output, and the YOCO shared hidden where a consumer layer owns a compressor) into original token order, so every
rank forms the SWA KV, compressed rows and index keys of *all* chunk tokens and writes the *full* cache state —
decode steps (and steps that do not split) then run the ordinary path on the same batch on every rank. Since every
rank holds all keys, a local query attends over its complete key set in one softmax; no partial results need a
log-sum-exp merge. DSpark target features and the final hidden are gathered to token order too, so the drafter's
context keys are written for every token and every rank returns the same logits rows.

This module is the ``TokenSplit`` strategy of such a step (``ContextParallelStep``); the model's one forward runs it
through ``StepContext``. The index math uses two views of the step: the *full* ``StepMetadata`` (``key_meta``: cache
writes, chunk-relative addressing) and a *local* one (``meta``) whose per-token arrays (``positions``,
``token_request``) hold only the rank's rows while the per-request arrays are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from deepinfer_model.deepseek_v41.context import WHOLE_STEP, TokenSplit
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.state import StepMetadata
from deepinfer_parallel.comm import all_gather_into
from deepinfer_parallel.context_parallel import ContextParallelSplit, balanced_split
from deepinfer_parallel.groups import RankGroup

__all__ = ["ContextParallelStep", "context_parallel_split", "splits_step", "token_split"]


def splits_step(batch: ForwardBatch, cp_size: int) -> bool:
    """Whether a step is split over a CP group of ``cp_size`` ranks: ``cp_size > 1`` and some request computes at
    least ``2·cp_size`` tokens (a prefill chunk). Decode and short verify steps run whole on every rank."""
    if cp_size == 1:
        return False
    longest = batch.max_query_len
    if longest is None:
        cu = batch.cu_query_lens.long()
        longest = int((cu[1:] - cu[:-1]).max().item()) if batch.num_requests else 0
    return longest >= 2 * cp_size


def context_parallel_split(seq_lens: Sequence[int], cp_size: int) -> ContextParallelSplit:
    """The split of a step's tokens over the CP ranks.

    Chunks of at least ``2·cp_size`` tokens are split in mirrored block pairs (``balanced_split``); a shorter chunk
    (a decode token, a short verify batch, a prompt tail) goes whole to the rank holding the fewest rows so far (ties:
    the lowest rank) instead of being padded to ``2·cp_size`` rows. Every rank is then padded to the same row count
    (padding rows: token 0, invalid), as the fixed-size all-gather needs.

    Args:
        seq_lens: query tokens of each request of the step, in packing order.
        cp_size: CP ranks (>= 1).

    Returns:
        The split, as CPU tensors.
    """
    threshold = 2 * cp_size
    starts = [0]
    for length in seq_lens:
        starts.append(starts[-1] + length)
    # Short chunks count as empty here, so the mirrored split's own packed indices are off; keep only its
    # (request, position) pairs and index with the real request starts.
    mirrored = balanced_split([n if n >= threshold else 0 for n in seq_lens], cp_size)
    rows: list[list[tuple[int, int, int]]] = []  # per rank: (packed index, position in request, request)
    for rank in range(cp_size):
        keep = mirrored.valid[rank]
        pairs = zip(mirrored.request_index[rank][keep].tolist(), mirrored.positions[rank][keep].tolist(), strict=True)
        rows.append([(starts[request] + position, position, request) for request, position in pairs])
    for request, length in enumerate(seq_lens):
        if 0 < length < threshold:
            target = min(range(cp_size), key=lambda rank: len(rows[rank]))
            rows[target].extend((starts[request] + offset, offset, request) for offset in range(length))
    width = max(len(r) for r in rows)
    padded = [r + [(0, -1, -1)] * (width - len(r)) for r in rows]
    table = torch.tensor(padded, dtype=torch.int64).reshape(cp_size, width, 3)
    return ContextParallelSplit(
        cp_size=cp_size,
        num_tokens=starts[-1],
        token_index=table[..., 0],
        valid=table[..., 2] >= 0,
        positions=table[..., 1],
        request_index=table[..., 2],
    )


class ContextParallelStep(TokenSplit):
    """The ``TokenSplit`` of one CP rank in a split step (see the module docstring).

    Args:
        group: the CP group.
        split: which packed-batch token each rank's local row holds.
        device: the step's device.
    """

    def __init__(self, group: RankGroup, split: ContextParallelSplit, device: torch.device) -> None:
        self.group = group
        self.split = split
        # [T_local] packed-batch index of each local row (0 on padding rows).
        self.local_index = split.token_index[group.rank].to(device)
        # [T] row of each packed-batch token in the all-gathered buffer (rank 0's rows first).
        valid = split.valid.reshape(-1)
        order = torch.empty(split.num_tokens, dtype=torch.int64)
        order[split.token_index.reshape(-1)[valid]] = torch.arange(valid.numel())[valid]
        self.token_order = order.to(device)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.local_index]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """All-gather every rank's local rows into packed-batch order (collective).

        One index with the step's precomputed order (no boolean mask, so no device-to-host sync per layer).
        """
        buffer = local.new_empty((self.group.size * local.shape[0], *local.shape[1:]))
        all_gather_into(buffer, local.contiguous(), self.group)
        return buffer[self.token_order]

    def query_meta(self, meta: StepMetadata) -> StepMetadata:
        return dataclasses.replace(
            meta, token_request=self.local(meta.token_request), positions=self.local(meta.positions)
        )


def token_split(batch: ForwardBatch, meta: StepMetadata, group: RankGroup | None) -> TokenSplit:
    """How a step's tokens are shared out over the CP ``group``: a ``ContextParallelStep`` when the step splits
    (``splits_step``), else the whole step on every rank (``group`` None: no context parallelism)."""
    if group is None or not splits_step(batch, group.size):
        return WHOLE_STEP
    return ContextParallelStep(group, context_parallel_split(meta.q_len.tolist(), group.size), meta.positions.device)
