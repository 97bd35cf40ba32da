"""Token bitmasks: filled on the CPU while the forward runs, applied to logits on the device.

Layout (xgrammar's): an int32 tensor ``[num_rows, ceil(vocab_size / 32)]``; token ``t`` is allowed in a row iff bit
``t % 32`` of word ``t // 32`` is set. ``-1`` (all bits) allows every token of a word::

    word 0: tokens 0..31   (bit 0 = token 0)   word 1: tokens 32..63   ...

Per decode step (docs/design/sampling.md, "Bitmask per step") the engine allocates one pinned host mask for all sampling
rows, calls ``fill_step_bitmask`` (feeds each structured request's newly committed tokens to its matcher, then fills the
rows that score the request's drafts), copies the mask to the device with ``non_blocking=True`` and the sampler calls
``apply_token_bitmask_`` before temperature/top-k/top-p and the rejection test. Rows of unconstrained requests stay
all-allowed. A matcher failure aborts only its request and is returned as a ``StructuredOutputError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer_sampling.structured.compiler import StructuredOutputError
from deepinfer_sampling.structured.matcher import RequestGrammarMatcher

BITS_PER_WORD = 32


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row for ``vocab_size`` logit columns."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_token_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """Allocate an all-allowed host bitmask.

    Args:
        num_rows: sampling rows of the step.
        vocab_size: logit columns.
        pin_memory: page-lock the buffer so the device copy can run asynchronously (needs a CUDA build).

    Returns:
        int32 CPU tensor [num_rows, ceil(vocab_size / 32)] filled with -1.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows={num_rows} must be >= 0")
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand a bitmask to booleans.

    Args:
        bitmask: int32 [num_rows, ceil(vocab_size / 32)], any device.
        vocab_size: logit columns to keep.

    Returns:
        bool [num_rows, vocab_size] on the bitmask's device, True = allowed.
    """
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got dtype={bitmask.dtype} shape={tuple(bitmask.shape)}")
    if bitmask.shape[1] * BITS_PER_WORD < vocab_size:
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words per row, too few for vocab_size={vocab_size} "
            f"(needs {bitmask_width(vocab_size)})"
        )
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf in place, on the logits' device, without a host sync.

    Args:
        logits: float [num_rows, vocab_size].
        bitmask: int32 [num_rows, >= ceil(vocab_size / 32)] on the same device as ``logits``.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be 2-D with the same row count"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits on {logits.device}; copy the bitmask first")
    allowed = unpack_token_bitmask(bitmask, logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class StepMaskRequest:
    """One structured request's part of a step's bitmask.

    Attributes:
        request_id: the request.
        matcher: its matcher.
        first_row: its first sampling row in the step's bitmask.
        committed_token_ids: tokens committed by the previous step (accepted drafts then the sampled token) that the
            matcher has not seen yet; empty on the first constrained step.
        draft_token_ids: the drafts this step verifies (rows ``first_row + 1 ..`` score them).
    """

    request_id: str
    matcher: RequestGrammarMatcher
    first_row: int
    committed_token_ids: Sequence[int]
    draft_token_ids: Sequence[int]


def fill_step_bitmask(bitmask: torch.Tensor, requests: Sequence[StepMaskRequest]) -> dict[str, StructuredOutputError]:
    """Advance each matcher by its committed tokens and fill its rows (docs/design/sampling.md, "Bitmask per step").

    Rows not owned by any request are left as they are (all-allowed when the mask came from
    ``allocate_token_bitmask``). A request whose matcher rejects a committed token or raises is aborted: its rows are
    set to all-allowed and its error returned; the other requests are unaffected.

    Args:
        bitmask: int32 CPU tensor [num_rows, ceil(vocab_size / 32)].
        requests: the structured requests of the step.

    Returns:
        request id → error for every request aborted in this step.
    """
    failures: dict[str, StructuredOutputError] = {}
    for request in requests:
        rows = slice(request.first_row, request.first_row + len(request.draft_token_ids) + 1)
        try:
            for position, token_id in enumerate(request.committed_token_ids):
                if not request.matcher.accept_token(token_id):
                    raise RuntimeError(
                        f"matcher rejected committed token {token_id} (#{position} of "
                        f"{list(request.committed_token_ids)}); emitted tokens must satisfy the grammar"
                    )
            request.matcher.fill_bitmask_with_drafts(bitmask, request.first_row, request.draft_token_ids)
        except Exception as exc:  # any matcher failure ends only this request
            bitmask[rows].fill_(-1)
            failures[request.request_id] = StructuredOutputError("runtime_error", f"{type(exc).__name__}: {exc}")
    return failures
