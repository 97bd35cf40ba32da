"""Frozen configuration of the scheduler and the cache manager.

`SchedulerConfig` bounds what one step may schedule; `CacheConfig` fixes the cache geometry the cache manager hands
out (the number of blocks itself is derived from a memory budget by `CacheManager.from_memory_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheConfig", "SchedulerConfig"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_seqs: most requests holding cache at once (running, including partially prefilled ones).
        max_num_batched_tokens: most tokens computed in one step, summed over requests (the token budget).
        max_model_len: most positions a request may compute; a request finishes with "length" once its total
            length exceeds it (runtime §6.8), and a longer prompt is rejected.
        max_num_draft_tokens: most draft tokens verified per request per step (nextn; 0 disables speculation).
        stop_preempted_requests: True finishes a preempted request with "insufficient_system_resource";
            False (the `LLM` default) recomputes it later.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    max_num_draft_tokens: int = 0
    stop_preempted_requests: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_draft_tokens < 0:
            raise ValueError(f"max_num_draft_tokens must be >= 0, got {self.max_num_draft_tokens}")
        # Every running request must be able to take a full decode step (runtime §1.4).
        min_budget = self.max_num_seqs * (1 + self.max_num_draft_tokens)
        if self.max_num_batched_tokens < min_budget:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs * (1 + max_num_draft_tokens) = {min_budget}, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Cache geometry.

    Attributes:
        block_size: raw tokens per block of the shared block table (128 for DeepSeek-V4.1-Flash).
        num_state_slots: per-request state slots, including the never-used slot 0 (runtime §6.7:
            `int(max_num_seqs * DEEPINFER_NUM_STATE_SLOTS_RATIO) + 1`).
    """

    block_size: int = 128
    num_state_slots: int = 2

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_state_slots < 2:
            raise ValueError(f"num_state_slots must be >= 2 (slot 0 is reserved), got {self.num_state_slots}")
