"""`SamplerConfig`: the frozen, engine-wide sampler settings, and the token-blacklist text format.

The engine fills this from its own config (DEEPINFER_BATCH_INVARIANT, DEEPINFER_SAMPLER_FORCE_TOPK,
DEEPINFER_DECODE_TOKEN_BLACKLIST, DEEPINFER_COMPUTE_SUM_SMALLER_PROBS); this package never reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

SamplerBackend = Literal["auto", "reference", "triton"]
SAMPLER_BACKENDS: tuple[str, ...] = get_args(SamplerBackend)


def parse_token_blacklist(text: str) -> tuple[int, ...]:
    """Parses the blacklist format "a..b,c,d..e" (closed ranges, strictly increasing segments) into token ids.

    Args:
        text: comma-separated ints or closed ranges `a..b`; empty or blank means no blacklist.

    Returns:
        The listed token ids, ascending.
    """
    ids: list[int] = []
    if not text.strip():
        return ()
    for segment in text.split(","):
        parts = segment.strip().split("..")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"token blacklist segment {segment!r} is not an int or a range 'a..b' (text {text!r})")
        low, high = int(parts[0]), int(parts[-1])
        if high < low or (ids and low <= ids[-1]):
            raise ValueError(f"token blacklist segments must be strictly increasing; {segment!r} in {text!r} is not")
        ids.extend(range(low, high + 1))
    return tuple(ids)


@dataclass(frozen=True)
class SamplerConfig:
    """Engine-wide sampler settings.

    Attributes:
        backend: "reference" (plain PyTorch, any device), "triton" (fused kernels; CUDA, or CPU under
            TRITON_INTERPRET=1) or "auto" (triton for CUDA logits when `deepinfer_kernels.platform` reports NVIDIA, else
            reference; resolved once when the `Sampler` is built).
        batch_invariant: a row's outputs are bit-identical whatever the batch size and row position. The fused
            path always is (one program per row, fixed traversal); the reference path then sums probability mass in
            64-bit fixed point (exact, order-free) instead of torch's float reductions.
        banned_token_ids: columns set to -inf on every row (the token blacklist), each in [0, vocab_size).
        force_top_k: K > 0 keeps only the K largest logits of every row before temperature; 0 disables.
        compute_sum_smaller_probs: also report, per row, the processed probability mass of tokens ranked at or below
            the emitted one.
    """

    backend: SamplerBackend = "auto"
    batch_invariant: bool = False
    banned_token_ids: tuple[int, ...] = ()
    force_top_k: int = 0
    compute_sum_smaller_probs: bool = False

    def __post_init__(self) -> None:
        if self.backend not in SAMPLER_BACKENDS:
            raise ValueError(f"backend must be one of {SAMPLER_BACKENDS}, got {self.backend!r}")
        if isinstance(self.force_top_k, bool) or not isinstance(self.force_top_k, int) or self.force_top_k < 0:
            raise ValueError(f"force_top_k must be an int >= 0 (0 disables), got {self.force_top_k!r}")
        banned = tuple(self.banned_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in banned):
            raise ValueError(f"banned_token_ids must be ints >= 0, got {banned!r}")
        object.__setattr__(self, "banned_token_ids", banned)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError if a banned id does not fit a vocabulary of `vocab_size` columns."""
        bad = [t for t in self.banned_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"banned_token_ids must be < vocab_size={vocab_size}, got {bad[:8]}")
