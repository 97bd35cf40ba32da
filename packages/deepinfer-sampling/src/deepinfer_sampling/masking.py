"""Logit pre-processing shared by every sampler backend: masks, penalties, forced top-K and the validity check.

Steps, in order (docs/design/sampling.md, "Logit pipeline"; penalties come after the masks, before forced top-K):

1. cast to a float32 copy (the caller's logits are never modified);
2. token blacklist → -inf;
3. EOS → -inf on rows within their first `first_n_token_no_eos` generated tokens;
4. grammar bitmask → -inf on disallowed columns (int32 words, 32 tokens each, bit set = allowed; xgrammar layout);
5. repetition / presence / frequency penalties (`penalties.py`);
6. forced top-K: keep the K largest logits of each row (ties → lowest ids), -inf elsewhere;
7. rows left with no finite logit, or holding NaN or +inf, are marked invalid and replaced by zeros so later
   arithmetic stays finite; the sampler reports them through `SamplerOutput.status`.
"""

from __future__ import annotations

import torch

from deepinfer_sampling._devices import same_device
from deepinfer_sampling.batch import SamplingBatch
from deepinfer_sampling.penalties import apply_penalties

BITS_PER_MASK_WORD = 32


def ordered_keys(values: torch.Tensor) -> torch.Tensor:
    """Maps float32 values to int32 keys with the same order (-0.0 and +0.0 share a key; NaN is not ordered).

    Args:
        values: float32, any shape.

    Returns:
        int32, same shape.
    """
    bits = (values + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, ties broken by lowest index, in descending order.

    Args:
        values: float32 [B, V] (no NaN).
        k: 1 … V.

    Returns:
        int64 [B, k].
    """
    num_cols = values.shape[-1]
    column = torch.arange(num_cols, dtype=torch.int64, device=values.device)
    # One int64 key per element makes the order total, so torch.topk's tie handling cannot matter.
    keys = (ordered_keys(values).to(torch.int64) << 32) + (0xFFFFFFFF - column)
    return torch.topk(keys, k, dim=-1, sorted=True).indices


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpacks a grammar bitmask.

    Args:
        bitmask: int32 [B, ceil(vocab_size / 32)]; bit j of word w allows token 32·w + j.
        vocab_size: number of columns.

    Returns:
        bool [B, vocab_size], True where allowed.
    """
    shifts = torch.arange(BITS_PER_MASK_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def check_bitmask(bitmask: torch.Tensor, num_rows: int, vocab_size: int, device: torch.device) -> None:
    """Raises if `bitmask` is not int32 [num_rows, ceil(vocab_size / 32)] on `device`."""
    words = -(-vocab_size // BITS_PER_MASK_WORD)
    shape_ok = tuple(bitmask.shape) == (num_rows, words)
    if bitmask.dtype != torch.int32 or not shape_ok or not same_device(bitmask.device, device):
        raise ValueError(
            f"bitmask must be int32 [{num_rows}, {words}] on {device}, "
            f"got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
        )


def preprocess_logits(
    logits: torch.Tensor,
    batch: SamplingBatch,
    banned: torch.Tensor | None,
    bitmask: torch.Tensor | None,
    force_top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs steps 1–7 of the module docstring.

    Args:
        logits: [B, V] float32, bfloat16 or float16.
        batch: the step's sampling batch (B rows, V = batch.vocab_size).
        banned: bool [V] blacklist mask, or None.
        bitmask: int32 [B, ceil(V / 32)] grammar bitmask, or None.
        force_top_k: K > 0 keeps the K largest logits per row; 0 disables.

    Returns:
        (masked logits float32 [B, V] with invalid rows zeroed, invalid bool [B]).
    """
    z = logits.to(torch.float32, copy=True)
    if banned is not None:
        z.masked_fill_(banned, float("-inf"))
    if batch.has_eos_suppression:
        eos = batch.suppressed_eos_ids
        column = eos.clamp(min=0)[:, None]
        kept = z.gather(1, column)
        z.scatter_(1, column, torch.where(eos[:, None] >= 0, float("-inf"), kept))
    if bitmask is not None:
        z.masked_fill_(~allowed_from_bitmask(bitmask, batch.vocab_size), float("-inf"))
    apply_penalties(z, batch)
    invalid = (~(z < float("inf"))).any(dim=-1) | (z.amax(dim=-1) == float("-inf"))
    z.masked_fill_(invalid[:, None], 0.0)
    if 0 < force_top_k < batch.vocab_size:
        keep = torch.zeros_like(z, dtype=torch.bool)
        keep.scatter_(1, top_indices(z, force_top_k), True)
        z.masked_fill_(~keep, float("-inf"))
    return z, invalid
