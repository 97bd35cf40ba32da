"""Repetition, presence and frequency penalties on logits (before temperature, as in vLLM).

For a penalised row with output counts c (occurrences of each token among the tokens generated so far) and
prompt-or-output mask s (the token appears in the prompt or the output):

    z ← z / r  where s and z > 0;   z ← z · r  where s and z <= 0      (repetition_penalty r; 1 disables)
    z ← z − f · c − p · [c > 0]                                        (frequency f, presence p; 0 disables)

Only the rows listed in `SamplingBatch.penalty_rows` are touched; the work is elementwise on those rows.
"""

from __future__ import annotations

import torch

from deepinfer_sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Applies the batch's penalties to `logits` in place.

    Args:
        logits: float32 [B, vocab_size], modified in place on the penalised rows.
        batch: the step's sampling batch.
    """
    if batch.penalty_rows.numel() == 0:
        return
    rows = logits.index_select(0, batch.penalty_rows)
    counts = batch.output_token_counts
    if batch.prompt_token_mask is not None:
        seen = batch.prompt_token_mask | (counts > 0)
        penalty = batch.repetition_penalties[:, None]
        repeated = torch.where(rows > 0, rows / penalty, rows * penalty)
        rows = torch.where(seen, repeated, rows)
    rows = rows - batch.frequency_penalties[:, None] * counts.to(torch.float32)
    rows = rows - batch.presence_penalties[:, None] * (counts > 0).to(torch.float32)
    logits.index_copy_(0, batch.penalty_rows, rows)
