"""Cache groups: how the model declares the per-request attention state the engine must store.

The model builds one `CacheSpec` from its config; the engine sizes and hands out cache memory from it and never looks
at layer kinds itself. A *cache group* is a set of layers whose cache entries ("rows") have the same size, dtype and
addressing, so they can share one allocation scheme. There are three kinds:

- `CacheGroupKind.PAGED` — rows appended as the request grows, one row per `tokens_per_row` raw tokens, stored in
  pages addressed through the request's block table. A block covers `block_size` raw tokens in EVERY paged group, so
  one block table serves all paged groups (docs/design/cache.md, "Paged blocks"); a page of group `g` holds
  `block_size // g.tokens_per_row` rows.
- `CacheGroupKind.SLIDING_WINDOW` — a per-request ring of `window + backtracking_tokens` raw-token rows, addressed by
  position modulo the ring size (docs/design/cache.md, "Rings"). The extra `backtracking_tokens` rows let up to that
  many speculative positions be rolled back without destroying entries inside the window of the committed prefix.
- `CacheGroupKind.STATE` — fixed per-request state: the C2 compressor's partial-block ring of
  `tokens_per_row + max(0, backtracking_tokens - 1)` raw-token rows, addressed by position modulo its size
  (docs/design/attention.md, "Compressor state"; docs/design/cache.md, "Rollback").

SLIDING_WINDOW and STATE groups are both fixed-size per request, so the engine stores them in one *state slot* per
running request; PAGED groups grow through the shared block table.

How each layer kind maps onto groups (docs/design/cache.md, "Cache groups"). `BT` = max backtracking tokens, `W` =
sliding window, `D` = head_dim; byte sizes (docs/design/numerics.md, "KV storage formats") for D = 512,
index_head_dim = 128:

| layer kind                           | groups it appears in (row bytes)                                        |
|--------------------------------------|-------------------------------------------------------------------------|
| every main layer (ratio 0, 1, 2)     | SLIDING_WINDOW "swa": `W + BT` rows of SWA KV (FP8 + scales, 528 B)     |
| C2 kv source                         | PAGED "compressed_c2", tokens_per_row 2: main row (FP4 288 / FP8 528 B) |
|                                      | STATE "compressor_c2", tokens_per_row 2: `2 + BT - 1` rows of FP32      |
|                                      | (score, latent), `2 * D * 4` = 4096 B                                   |
| C2 index-K source (kv source or not) | PAGED "index_k_c2", tokens_per_row 2: index-K row (FP4 + scales, 68 B)  |
| C1 kv source                         | PAGED "compressed_c1", tokens_per_row 1: main row per token; no state   |
| C1 index-K source                    | PAGED "index_k_c1", tokens_per_row 1: index-K row (68 B)                |
| kv consumer / index-K consumer       | nothing beyond "swa": it aliases its source's rows                      |
| drafter (DSpark) layer               | its own SLIDING_WINDOW group, sized like "swa"                          |

A layer id may therefore appear in several groups (a C2 source is in "swa", "compressed_c2", "index_k_c2" and
"compressor_c2"), but at most once per group. Groups whose layers differ in row size must be split (e.g. FP4 and FP8
main rows never share a group).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["CacheGroupKind", "CacheGroupSpec", "CacheSpec"]


class CacheGroupKind(enum.Enum):
    """Addressing scheme of a cache group (see the module docstring)."""

    PAGED = "paged"
    SLIDING_WINDOW = "sliding_window"
    STATE = "state"


@dataclass(frozen=True)
class CacheGroupSpec:
    """One cache group: layers whose rows share size, dtype and addressing.

    Build it with `paged`, `sliding_window` or `state` rather than the constructor; they set exactly the fields that
    the kind uses and leave the others at 0.

    Attributes:
        name: unique name within the `CacheSpec` (e.g. "swa", "compressed_c2").
        kind: addressing scheme.
        layer_ids: layers that own a cache of this group (aliasing consumer layers are not listed).
        bytes_per_row: bytes of one row of ONE layer, including quantization scales.
        dtype: element type the runner allocates the rows with; `bytes_per_row` is a multiple of its size.
        tokens_per_row: PAGED: raw tokens per row (the compress ratio). STATE: raw tokens per compressed block.
        window: SLIDING_WINDOW only: tokens a query attends to (`sliding_window`).
        backtracking_tokens: SLIDING_WINDOW and STATE: speculative positions that can be rolled back.
    """

    name: str
    kind: CacheGroupKind
    layer_ids: tuple[int, ...]
    bytes_per_row: int
    dtype: torch.dtype
    tokens_per_row: int = 0
    window: int = 0
    backtracking_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("cache group name must be non-empty")
        if not isinstance(self.kind, CacheGroupKind):
            raise TypeError(f"cache group {self.name!r}: kind must be a CacheGroupKind, got {self.kind!r}")
        if not self.layer_ids:
            raise ValueError(f"cache group {self.name!r}: layer_ids must be non-empty")
        if any(layer < 0 for layer in self.layer_ids):
            raise ValueError(f"cache group {self.name!r}: layer ids must be >= 0, got {self.layer_ids}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"cache group {self.name!r}: duplicate layer ids in {self.layer_ids}")
        if self.bytes_per_row <= 0:
            raise ValueError(f"cache group {self.name!r}: bytes_per_row must be > 0, got {self.bytes_per_row}")
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if self.bytes_per_row % itemsize != 0:
            raise ValueError(
                f"cache group {self.name!r}: bytes_per_row {self.bytes_per_row} is not a multiple of the "
                f"{self.dtype} element size {itemsize}"
            )
        uses_ratio = self.kind in (CacheGroupKind.PAGED, CacheGroupKind.STATE)
        if uses_ratio and self.tokens_per_row < 1:
            raise ValueError(f"cache group {self.name!r}: tokens_per_row must be >= 1, got {self.tokens_per_row}")
        if not uses_ratio and self.tokens_per_row != 0:
            raise ValueError(f"cache group {self.name!r}: tokens_per_row is only used by PAGED and STATE groups")
        if self.kind is CacheGroupKind.SLIDING_WINDOW:
            if self.window < 1:
                raise ValueError(f"cache group {self.name!r}: window must be >= 1, got {self.window}")
        elif self.window != 0:
            raise ValueError(f"cache group {self.name!r}: window is only used by SLIDING_WINDOW groups")
        if self.kind is CacheGroupKind.PAGED:
            if self.backtracking_tokens != 0:
                raise ValueError(f"cache group {self.name!r}: PAGED groups need no backtracking_tokens")
        elif self.backtracking_tokens < 0:
            raise ValueError(
                f"cache group {self.name!r}: backtracking_tokens must be >= 0, got {self.backtracking_tokens}"
            )

    @classmethod
    def paged(
        cls, name: str, layer_ids: tuple[int, ...], bytes_per_row: int, tokens_per_row: int, dtype: torch.dtype
    ) -> CacheGroupSpec:
        """A paged group: one row per `tokens_per_row` raw tokens, addressed through the block table."""
        return cls(name, CacheGroupKind.PAGED, tuple(layer_ids), bytes_per_row, dtype, tokens_per_row=tokens_per_row)

    @classmethod
    def sliding_window(
        cls,
        name: str,
        layer_ids: tuple[int, ...],
        bytes_per_row: int,
        window: int,
        backtracking_tokens: int,
        dtype: torch.dtype,
    ) -> CacheGroupSpec:
        """A per-request ring of `window + backtracking_tokens` raw-token rows."""
        return cls(
            name,
            CacheGroupKind.SLIDING_WINDOW,
            tuple(layer_ids),
            bytes_per_row,
            dtype,
            window=window,
            backtracking_tokens=backtracking_tokens,
        )

    @classmethod
    def state(
        cls,
        name: str,
        layer_ids: tuple[int, ...],
        bytes_per_row: int,
        tokens_per_row: int,
        backtracking_tokens: int,
        dtype: torch.dtype,
    ) -> CacheGroupSpec:
        """A per-request partial-block ring of `tokens_per_row + max(0, backtracking_tokens - 1)` raw-token rows."""
        return cls(
            name,
            CacheGroupKind.STATE,
            tuple(layer_ids),
            bytes_per_row,
            dtype,
            tokens_per_row=tokens_per_row,
            backtracking_tokens=backtracking_tokens,
        )

    @property
    def num_layers(self) -> int:
        """Number of layers that own a cache of this group."""
        return len(self.layer_ids)

    def rows_per_block(self, block_size: int) -> int:
        """Rows one page of this group holds for one layer; 0 for per-request groups.

        Raises:
            ValueError: `block_size` is not a positive multiple of `tokens_per_row`.
        """
        if self.kind is not CacheGroupKind.PAGED:
            return 0
        if block_size < 1 or block_size % self.tokens_per_row != 0:
            raise ValueError(
                f"cache group {self.name!r}: block_size {block_size} must be a positive multiple of "
                f"tokens_per_row {self.tokens_per_row}"
            )
        return block_size // self.tokens_per_row

    def rows_per_request(self) -> int:
        """Rows of the per-request ring for one layer; 0 for PAGED groups."""
        if self.kind is CacheGroupKind.SLIDING_WINDOW:
            return self.window + self.backtracking_tokens
        if self.kind is CacheGroupKind.STATE:
            return self.tokens_per_row + max(0, self.backtracking_tokens - 1)
        return 0

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one block of `block_size` raw tokens takes in this group, summed over its layers."""
        return self.rows_per_block(block_size) * self.bytes_per_row * self.num_layers

    def bytes_per_request(self) -> int:
        """Bytes one request's fixed state takes in this group, summed over its layers."""
        return self.rows_per_request() * self.bytes_per_row * self.num_layers


@dataclass(frozen=True)
class CacheSpec:
    """All cache groups of a model.

    Attributes:
        groups: the groups; names are unique.
    """

    groups: tuple[CacheGroupSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a CacheSpec needs at least one cache group")
        names = [group.name for group in self.groups]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"cache group names must be unique, duplicated: {duplicates}")

    def group(self, name: str) -> CacheGroupSpec:
        """The group called `name`."""
        for group in self.groups:
            if group.name == name:
                return group
        raise KeyError(f"no cache group named {name!r}; groups are {[g.name for g in self.groups]}")

    @property
    def paged_groups(self) -> tuple[CacheGroupSpec, ...]:
        """Groups addressed through the shared block table."""
        return tuple(g for g in self.groups if g.kind is CacheGroupKind.PAGED)

    @property
    def per_request_groups(self) -> tuple[CacheGroupSpec, ...]:
        """Groups stored in the per-request state slot (SLIDING_WINDOW and STATE)."""
        return tuple(g for g in self.groups if g.kind is not CacheGroupKind.PAGED)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block (`block_size` raw tokens) across every paged group and layer."""
        return sum(group.bytes_per_block(block_size) for group in self.paged_groups)

    def bytes_per_request(self) -> int:
        """Bytes of one request's state slot across every per-request group and layer."""
        return sum(group.bytes_per_request() for group in self.per_request_groups)

    @property
    def max_backtracking_tokens(self) -> int | None:
        """Most speculative positions that can be rolled back without losing state; None when no group limits it.

        Paged rows are addressed by position and simply overwritten, so only the per-request rings bound rollback.
        """
        limits = [group.backtracking_tokens for group in self.per_request_groups]
        return min(limits) if limits else None
