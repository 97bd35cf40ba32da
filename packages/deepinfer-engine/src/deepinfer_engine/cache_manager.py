"""Cache accounting per request across every cache group of a `CacheSpec`.

A running request holds two things (docs/design/cache.md, "Cache groups", "Block pool", "State slots"):

- a *block table*: blocks of `block_size` raw tokens, shared by all PAGED groups (block `i` of the table holds the
  rows of positions `i * block_size ... (i + 1) * block_size - 1` in every paged pool);
- one *state slot*: its SLIDING_WINDOW rings and STATE rings in every per-request group.

The manager tracks, per request, how many tokens it may write (`num_tokens`, grown by `allocate`, lowered by
`rollback`) and keeps exactly `ceil(num_tokens / block_size)` blocks:

    num_tokens = 300, block_size = 128
    block table:  [ 17 ][  4 ][  9 ]          3 blocks = ceil(300 / 128)
    positions:     0..127 128..255 256..383   (256..299 used, 300..383 free space in the last block)

Rollback of rejected draft tokens only lowers `num_tokens` (and drops a block that became empty): paged rows and ring
entries are addressed by position, so later writes overwrite them (docs/design/cache.md, "Rollback"). The rings hold
`backtracking_tokens` extra entries, so a rollback may reach at most that far below the highest position ever written
for the request; deeper rollbacks are refused.

Under asynchronous scheduling the next step's tokens are reserved before the rollback of the step in front of it is
known; the device places them right after the kept tokens, so the whole reservation moves down with the rollback
(`rollback(..., num_tokens_in_flight=...)`), and only positions a committed step really wrote count as written.

Memory sizing: `num_blocks_for_budget` spends a byte budget on `num_state_slots` state slots first and the rest on
blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_engine.block_pool import BlockPool
from deepinfer_engine.config import CacheConfig
from deepinfer_model.cache_spec import CacheSpec

__all__ = ["AllocationResult", "CacheManager"]


@dataclass(frozen=True)
class AllocationResult:
    """What an `allocate` call gave a request.

    Attributes:
        state_slot: the request's state slot.
        first_new_block_index: position of `new_block_ids[0]` in the request's block table (= table length before).
        new_block_ids: blocks appended to the table; empty when the table already covered the tokens.
    """

    state_slot: int
    first_new_block_index: int
    new_block_ids: tuple[int, ...]


@dataclass
class _RequestCache:
    state_slot: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    max_num_tokens: int = 0  # highest extent a committed step wrote (updated at rollback): bounds rollback depth


class CacheManager:
    """Hands out blocks and state slots to requests.

    Args:
        spec: the model's cache groups.
        config: block size and number of state slots.
        num_blocks: blocks including the null block 0.
    """

    def __init__(self, spec: CacheSpec, config: CacheConfig, num_blocks: int) -> None:
        for group in spec.paged_groups:
            group.rows_per_block(config.block_size)  # raises when block_size is not a multiple of the ratio
        self.spec = spec
        self.config = config
        self._blocks = BlockPool(num_blocks)
        self._state_slots = BlockPool(config.num_state_slots)
        self._requests: dict[str, _RequestCache] = {}

    @staticmethod
    def num_blocks_for_budget(spec: CacheSpec, config: CacheConfig, budget_bytes: int) -> int:
        """Blocks (null block included) that fit in `budget_bytes` after the state slots.

        Raises:
            ValueError: the spec has no paged group, or the budget does not fit the slots and two blocks.
        """
        bytes_per_block = spec.bytes_per_block(config.block_size)
        if bytes_per_block == 0:
            raise ValueError("the cache spec has no PAGED group, so there is nothing to size blocks for")
        state_bytes = config.num_state_slots * spec.bytes_per_request()
        num_blocks = (budget_bytes - state_bytes) // bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"cache budget of {budget_bytes} bytes is too small: {config.num_state_slots} state slots take "
                f"{state_bytes} bytes and at least 2 blocks of {bytes_per_block} bytes are needed"
            )
        return num_blocks

    @classmethod
    def from_memory_budget(cls, spec: CacheSpec, config: CacheConfig, budget_bytes: int) -> CacheManager:
        """A manager with as many blocks as `budget_bytes` allows (see `num_blocks_for_budget`)."""
        return cls(spec, config, cls.num_blocks_for_budget(spec, config, budget_bytes))

    @property
    def block_size(self) -> int:
        """Raw tokens per block."""
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks including the null block."""
        return self._blocks.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out."""
        return self._blocks.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now."""
        return self._blocks.num_free_blocks

    @property
    def num_free_state_slots(self) -> int:
        """State slots free now."""
        return self._state_slots.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self._blocks.num_used_blocks / self._blocks.num_usable_blocks

    @property
    def max_backtracking_tokens(self) -> int | None:
        """Deepest rollback below the highest reserved position; None when unbounded."""
        return self.spec.max_backtracking_tokens

    @property
    def request_ids(self) -> list[str]:
        """Requests holding cache, in admission order."""
        return list(self._requests)

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks covering `num_tokens` positions."""
        return -(-num_tokens // self.config.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` positions fits in the whole cache when it runs alone."""
        return self.num_blocks_for_tokens(num_tokens) <= self._blocks.num_usable_blocks

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether `allocate(request_id, num_tokens)` would succeed now."""
        cache = self._requests.get(request_id)
        held = len(cache.block_ids) if cache is not None else 0
        if cache is None and self._state_slots.num_free_blocks == 0:
            return False
        return self._blocks.can_allocate(max(0, self.num_blocks_for_tokens(num_tokens) - held))

    def allocate(self, request_id: str, num_tokens: int) -> AllocationResult | None:
        """Let the request write positions `0 .. num_tokens - 1`, adding blocks (and a state slot) as needed.

        Never shrinks: a smaller `num_tokens` than held keeps the current blocks.

        Returns:
            The allocation, or None (with nothing changed) when there are not enough free blocks or no free slot.
        """
        if num_tokens < 1:
            raise ValueError(f"request {request_id!r}: num_tokens must be >= 1, got {num_tokens}")
        if not self.can_allocate(request_id, num_tokens):
            return None
        cache = self._requests.get(request_id)
        if cache is None:
            cache = _RequestCache(state_slot=self._state_slots.allocate(1)[0])
            self._requests[request_id] = cache
        first_new = len(cache.block_ids)
        new_blocks = self._blocks.allocate(max(0, self.num_blocks_for_tokens(num_tokens) - first_new))
        cache.block_ids.extend(new_blocks)
        cache.num_tokens = max(cache.num_tokens, num_tokens)
        return AllocationResult(cache.state_slot, first_new, tuple(new_blocks))

    def rollback(self, request_id: str, num_rejected_tokens: int, num_tokens_in_flight: int = 0) -> tuple[int, ...]:
        """Forget `num_rejected_tokens` rejected draft positions of the request.

        Args:
            request_id: the request.
            num_rejected_tokens: rejected drafts at the end of the step being committed.
            num_tokens_in_flight: tokens reserved after that step by a later step still in flight (asynchronous
                scheduling); the device writes them right after the kept tokens, so they move down too.

        Returns:
            The blocks released because they no longer hold any kept or reserved position.

        Raises:
            ValueError: the rollback would reach deeper than `max_backtracking_tokens` below the highest position
                ever written for the request, or would leave it with no token.
        """
        cache = self._get(request_id)
        if num_rejected_tokens < 0:
            raise ValueError(f"request {request_id!r}: num_rejected_tokens must be >= 0, got {num_rejected_tokens}")
        if not 0 <= num_tokens_in_flight < cache.num_tokens:
            raise ValueError(
                f"request {request_id!r}: num_tokens_in_flight must be in 0 .. {cache.num_tokens - 1}, "
                f"got {num_tokens_in_flight}"
            )
        written = cache.num_tokens - num_tokens_in_flight
        kept = written - num_rejected_tokens
        if kept < 1:
            raise ValueError(f"request {request_id!r}: cannot roll back {num_rejected_tokens} of {written} tokens")
        high_water = max(cache.max_num_tokens, written)
        limit = self.spec.max_backtracking_tokens
        if limit is not None and high_water - kept > limit:
            raise ValueError(
                f"request {request_id!r}: rolling back to {kept} tokens is {high_water - kept} below the "
                f"highest written position {high_water}; the rings allow at most {limit}"
            )
        cache.max_num_tokens = high_water
        cache.num_tokens -= num_rejected_tokens
        num_kept_blocks = self.num_blocks_for_tokens(cache.num_tokens)
        released = cache.block_ids[num_kept_blocks:]
        del cache.block_ids[num_kept_blocks:]
        self._blocks.free(released)
        return tuple(released)

    def free(self, request_id: str) -> None:
        """Release every block and the state slot of the request."""
        cache = self._requests.pop(request_id, None)
        if cache is None:
            raise KeyError(f"request {request_id!r} holds no cache")
        self._blocks.free(cache.block_ids)
        self._state_slots.free([cache.state_slot])

    def has_request(self, request_id: str) -> bool:
        """Whether the request holds cache."""
        return request_id in self._requests

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table."""
        return tuple(self._get(request_id).block_ids)

    def state_slot(self, request_id: str) -> int:
        """The request's state slot."""
        return self._get(request_id).state_slot

    def num_tokens(self, request_id: str) -> int:
        """Positions the request may write now."""
        return self._get(request_id).num_tokens

    def _get(self, request_id: str) -> _RequestCache:
        cache = self._requests.get(request_id)
        if cache is None:
            raise KeyError(f"request {request_id!r} holds no cache")
        return cache
