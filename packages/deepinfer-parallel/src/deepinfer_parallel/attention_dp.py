"""Attention data parallelism: each DP rank runs attention on its own batch; tokens meet only around the MoE.

Every DP rank owns its scheduler, KV cache and batch, so ranks hold different, possibly zero, numbers of tokens.
Two ways tokens reach the routed experts and come back:

- Dispatch/combine (`deepinfer_parallel.expert_parallel`): each rank sends its tokens straight to the EP ranks that
  hold their experts. No extra movement is needed here.
- Gather/reduce-scatter (this module): the EP group first gathers everyone's tokens (`gather_tokens`), each rank
  applies its local experts to all of them, and `reduce_scatter_tokens` sums the partial results and hands every
  rank back its own rows. Cheaper than all-to-all for tiny decode batches, and the path for layers that need the
  whole group's tokens.

    rank 0: a a a        gather_tokens        all ranks: a a a b c c     reduce_scatter_tokens     rank 0: a' a' a'
    rank 1: b        ───────────────────►     (each adds its experts)   ─────────────────────►     rank 1: b'
    rank 2: c c                                                                                    rank 2: c' c'

Token counts differ per rank, so exchanges pad every rank's rows to the group maximum (fixed-size collectives);
`exchange_token_layout` moves the counts once per step. `max_over_ranks` is the DP vote (e.g. "any rank still has
unfinished requests", the common step type) that keeps ranks stepping together; idle ranks still take part with
zero tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_parallel.comm import all_gather_counts, all_gather_into, all_reduce_, reduce_scatter_into
from deepinfer_parallel.groups import RankGroup

__all__ = [
    "DataParallelTokenLayout",
    "exchange_token_layout",
    "gather_tokens",
    "max_over_ranks",
    "reduce_scatter_tokens",
    "scatter_tokens",
]


@dataclass(frozen=True)
class DataParallelTokenLayout:
    """How many tokens every rank of a group holds this step, in group order.

    Attributes:
        num_tokens_per_rank: tokens of each rank (>= 0).
        rank: this process's index in the group.
    """

    num_tokens_per_rank: tuple[int, ...]
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < len(self.num_tokens_per_rank):
            raise ValueError(f"rank={self.rank} outside a group of {len(self.num_tokens_per_rank)} ranks")
        if any(n < 0 for n in self.num_tokens_per_rank):
            raise ValueError(f"token counts must be >= 0, got {self.num_tokens_per_rank}")

    @property
    def cu_num_tokens(self) -> tuple[int, ...]:
        """Cumulative offsets, [group size + 1], starting at 0."""
        offsets = [0]
        for n in self.num_tokens_per_rank:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)

    @property
    def num_tokens(self) -> int:
        """Tokens over the whole group."""
        return sum(self.num_tokens_per_rank)

    @property
    def max_num_tokens(self) -> int:
        """Rows every rank is padded to in the fixed-size collectives."""
        return max(self.num_tokens_per_rank)

    @property
    def local_slice(self) -> slice:
        """This rank's rows within the gathered tokens."""
        cu = self.cu_num_tokens
        return slice(cu[self.rank], cu[self.rank + 1])


def exchange_token_layout(num_local_tokens: int, group: RankGroup, device: torch.device) -> DataParallelTokenLayout:
    """Learn every rank's token count (collective over `group`; synchronises the host).

    Args:
        num_local_tokens: this rank's tokens this step (>= 0).
        group: the group tokens move within (the EP group for MoE).
        device: device of the count exchange (CPU for gloo, the rank's GPU for NCCL).
    """
    counts = all_gather_counts(num_local_tokens, group, device)
    return DataParallelTokenLayout(tuple(counts), group.rank)


def _padded_rows(layout: DataParallelTokenLayout, device: torch.device) -> torch.Tensor:
    """[num_tokens] int64: row of each gathered token in the [group size * max_num_tokens] padded layout."""
    pad = layout.max_num_tokens
    rows = [torch.arange(n, device=device) + r * pad for r, n in enumerate(layout.num_tokens_per_rank)]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=device)


def gather_tokens(local: torch.Tensor, layout: DataParallelTokenLayout, group: RankGroup) -> torch.Tensor:
    """Concatenate every rank's tokens in group order (collective over `group`).

    Args:
        local: [layout.num_tokens_per_rank[rank], ...] this rank's rows.
        layout: from `exchange_token_layout`.
        group: the group of the layout.

    Returns:
        [layout.num_tokens, ...]; rows layout.local_slice are `local`.
    """
    _check_layout(layout, group, local.shape[0], layout.num_tokens_per_rank[layout.rank], "local")
    pad = layout.max_num_tokens
    padded = local.new_zeros((pad, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = local.new_empty((group.size * pad, *local.shape[1:]))
    all_gather_into(gathered, padded, group)
    return gathered[_padded_rows(layout, local.device)]


def reduce_scatter_tokens(partial: torch.Tensor, layout: DataParallelTokenLayout, group: RankGroup) -> torch.Tensor:
    """Sum every rank's partial result for all tokens and return this rank's rows (collective over `group`).

    Args:
        partial: [layout.num_tokens, ...] this rank's contribution for every gathered token.
        layout: from `exchange_token_layout`.
        group: the group of the layout.

    Returns:
        [layout.num_tokens_per_rank[rank], ...] sum over ranks of partial[layout.local_slice], in partial's dtype.
    """
    _check_layout(layout, group, partial.shape[0], layout.num_tokens, "partial")
    pad = layout.max_num_tokens
    padded = partial.new_zeros((group.size * pad, *partial.shape[1:]))
    padded[_padded_rows(layout, partial.device)] = partial
    mine = partial.new_empty((pad, *partial.shape[1:]))
    reduce_scatter_into(mine, padded, group)
    return mine[: layout.num_tokens_per_rank[layout.rank]]


def scatter_tokens(full: torch.Tensor, layout: DataParallelTokenLayout) -> torch.Tensor:
    """This rank's rows of a result every rank computed in full (no communication).

    Args:
        full: [layout.num_tokens, ...].

    Returns:
        [layout.num_tokens_per_rank[rank], ...] view of `full`.
    """
    if full.shape[0] != layout.num_tokens:
        raise ValueError(f"full has {full.shape[0]} rows, the layout has {layout.num_tokens} tokens")
    return full[layout.local_slice]


def max_over_ranks(value: int, group: RankGroup) -> int:
    """The largest `value` over the group: the DP vote (collective).

    Args:
        value: this rank's vote (e.g. 1 if it has unfinished requests).
        group: a gloo group, e.g. `ParallelGroups.data_parallel_cpu`; the vote travels as a CPU tensor so it never
            touches the device.

    Returns:
        The maximum over the group's ranks.
    """
    tensor = torch.tensor([value], dtype=torch.int64)
    return int(all_reduce_(tensor, group, "max").item())


def _check_layout(layout: DataParallelTokenLayout, group: RankGroup, rows: int, expected: int, what: str) -> None:
    if len(layout.num_tokens_per_rank) != group.size or layout.rank != group.rank:
        raise ValueError(
            f"layout for {len(layout.num_tokens_per_rank)} ranks (rank {layout.rank}) does not match the group of "
            f"{group.size} ranks (rank {group.rank})"
        )
    if rows != expected:
        raise ValueError(f"{what} has {rows} rows, the layout expects {expected}")
