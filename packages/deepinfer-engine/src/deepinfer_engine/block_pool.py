"""A pool of fixed-size cache entries with reference counts.

The cache manager keeps one `BlockPool` per allocation unit: one for the blocks of the shared block table (every paged
cache group) and one for the per-request state slots (every sliding-window and state group). Entry 0 is the *null
entry*: it is never handed out, so padded rows of a batch can point at it (docs/design/cache.md, "Block pool").

Free entries sit in a FIFO: allocation takes from the head and freeing appends to the tail, so a just-freed entry is
reused as late as possible. An entry is free exactly when its reference count is 0; `share` adds a reference (for
requests that read the same entry), and `free` drops one, returning the entry to the free list at 0. Freeing an
entry that is not in use raises, so accounting errors surface where they happen instead of as a leak.

    entry ids:     0      1   2   3   4   5   6   7
    ref counts:   [-]    [1] [0] [2] [0] [1] [0] [0]
    free list:    head -> 2 -> 4 -> 6 -> 7 <- tail      (0 is never listed)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["NULL_BLOCK_ID", "BlockPool"]

NULL_BLOCK_ID = 0


class BlockPool:
    """Fixed set of entries `1 .. num_blocks - 1` with reference counts.

    Args:
        num_blocks: entries including the null entry 0; must be >= 2.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (entry 0 is reserved), got {num_blocks}")
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_blocks(self) -> int:
        """Entries including the null entry."""
        return self._num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Entries that can ever be handed out (all but the null entry)."""
        return self._num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Entries currently free."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Entries currently referenced at least once."""
        return self.num_usable_blocks - len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether `num_blocks` entries are free now."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free entries, each with reference count 1.

        Raises:
            ValueError: `num_blocks` is negative or more than are free (check `can_allocate` first).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each of `block_ids`, all of which must be in use."""
        ids = list(block_ids)
        for block_id in ids:
            self._check_in_use(block_id)
        for block_id in ids:
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each of `block_ids`; entries reaching 0 go to the tail of the free list.

        Raises:
            ValueError: an id is out of range, the null entry, or not in use (a double free). Nothing is freed then.
        """
        ids = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in ids:
            self._check_in_use(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self._ref_counts[block_id]:
                raise ValueError(f"block {block_id} freed more times than it is referenced")
        for block_id in ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        """References held on `block_id` (0 when free)."""
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is out of range 1 .. {self._num_blocks - 1}")

    def _check_in_use(self, block_id: int) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not in use")
