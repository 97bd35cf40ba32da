"""Expert parallelism: where physical experts live, and moving routed tokens to them and back.

Flow of one MoE layer on each EP rank (tokens stay on their attention-DP rank until dispatch):

    hidden [n, H], topk logical ids [n, k], topk weights [n, k]
      │ map_to_physical (pick one replica per chosen logical expert)
      ▼
    topk physical ids [n, k] ──dispatch──► received rows [m, H] + local slot ids [m, k] (-1 = not on this rank)
                                              │ the caller runs its local experts on the received rows
                                              ▼
    combined [n, ...] ◄──combine (sum over ranks)── expert output [m, ...]

A token is sent at most once to each EP rank, whatever how many of its experts live there; combine returns each
received row's result to its source rank and sums the per-rank results of a token. What a row's result is (one
weighted sum per rank, or one output per routing choice) is the caller's choice: the model returns per-choice
outputs to keep the single-process summation order (docs/design/parallelism.md, "Expert parallelism").

`TokenDispatcher` is the seam for the transport: `AllToAllDispatcher` runs on any torch.distributed backend (gloo,
NCCL, HCCL) through all-to-all-v and is what runs here; a DeepEP-based dispatcher implements the same protocol with
the same `DispatchOutput` contract.

Glossary: see `deepinfer_parallel.config` for logical / physical / redundant experts. A "local slot" is a physical
expert index relative to its rank: physical = ep_rank * num_local_experts + local slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_parallel.comm import all_to_all_v, exchange_counts
from deepinfer_parallel.config import ExpertLayoutConfig
from deepinfer_parallel.groups import RankGroup

__all__ = [
    "AllToAllDispatcher",
    "AllToAllHandle",
    "DispatchOutput",
    "ExpertPlacement",
    "TokenDispatcher",
    "initial_physical_to_logical",
    "map_to_physical",
]


def initial_physical_to_logical(layout: ExpertLayoutConfig, num_layers: int) -> torch.Tensor:
    """Start-up placement: physical slot i < E holds logical i; redundant slot E + j holds logical j mod E.

    Returns:
        [num_layers, num_physical_experts] int64 on CPU.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    physical = torch.arange(layout.num_physical_experts, dtype=torch.int64) % layout.num_logical_experts
    return physical.unsqueeze(0).repeat(num_layers, 1)


@dataclass(frozen=True)
class ExpertPlacement:
    """Logical <-> physical expert maps of every MoE layer (the router and EPLB share these tensors).

    The tensors are updated in place by `copy_` when EPLB installs a new placement, so buffers captured by CUDA graphs
    stay valid.

    Attributes:
        layout: expert counts and EP size.
        physical_to_logical: [num_layers, num_physical] int64; logical expert held by each physical slot.
        logical_to_physical: [num_layers, num_logical, max_replicas] int64; physical slots of each logical expert in
            increasing order, padded with -1.
        logical_count: [num_layers, num_logical] int64; replicas of each logical expert (>= 1).
    """

    layout: ExpertLayoutConfig
    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_count: torch.Tensor

    @classmethod
    def from_physical_to_logical(cls, physical_to_logical: torch.Tensor, layout: ExpertLayoutConfig) -> ExpertPlacement:
        """Build all maps from the per-slot logical ids.

        Args:
            physical_to_logical: [num_layers, num_physical] integer tensor; every logical expert must appear at
                least once per layer.
            layout: expert counts the map must match.
        """
        num_logical, num_physical = layout.num_logical_experts, layout.num_physical_experts
        if physical_to_logical.dim() != 2 or physical_to_logical.shape[1] != num_physical:
            raise ValueError(
                f"physical_to_logical must be [num_layers, {num_physical}], got {tuple(physical_to_logical.shape)}"
            )
        p2l = physical_to_logical.to(torch.int64)
        if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_logical):
            raise ValueError(f"physical_to_logical values must be in [0, {num_logical}), got {p2l.tolist()}")
        num_layers = p2l.shape[0]
        device = p2l.device
        counts = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=device)
        counts.scatter_add_(1, p2l, torch.ones_like(p2l))
        missing = (counts == 0).nonzero()
        if missing.numel():
            raise ValueError(f"logical experts without a physical slot (layer, expert): {missing.tolist()}")
        # Stable sort by logical id keeps each expert's replicas in increasing physical order.
        order = torch.sort(p2l, dim=1, stable=True).indices
        sorted_logical = torch.gather(p2l, 1, order)
        starts = torch.cumsum(counts, dim=1) - counts
        replica_index = torch.arange(num_physical, device=device).unsqueeze(0) - torch.gather(starts, 1, sorted_logical)
        l2p = torch.full((num_layers, num_logical, layout.max_replicas), -1, dtype=torch.int64, device=device)
        layer_index = torch.arange(num_layers, device=device).unsqueeze(1).expand_as(order)
        l2p[layer_index, sorted_logical, replica_index] = order
        return cls(layout, p2l.clone(), l2p, counts)

    @classmethod
    def initial(
        cls, layout: ExpertLayoutConfig, num_layers: int, device: torch.device | None = None
    ) -> ExpertPlacement:
        """The start-up placement (see `initial_physical_to_logical`) on `device`."""
        p2l = initial_physical_to_logical(layout, num_layers)
        return cls.from_physical_to_logical(p2l if device is None else p2l.to(device), layout)

    @property
    def num_layers(self) -> int:
        """MoE layers covered."""
        return int(self.physical_to_logical.shape[0])

    def local_logical_experts(self, layer: int, ep_rank: int) -> torch.Tensor:
        """Logical ids held by `ep_rank`'s local slots: [num_local] int64."""
        num_local = self.layout.num_local_experts
        return self.physical_to_logical[layer, ep_rank * num_local : (ep_rank + 1) * num_local]

    def copy_(self, other: ExpertPlacement) -> None:
        """Install `other`'s maps into this placement's tensors, in place."""
        if other.layout != self.layout or other.num_layers != self.num_layers:
            raise ValueError(
                f"placement mismatch: {other.layout}, {other.num_layers} layers vs {self.layout}, "
                f"{self.num_layers} layers"
            )
        self.physical_to_logical.copy_(other.physical_to_logical)
        self.logical_to_physical.copy_(other.logical_to_physical)
        self.logical_count.copy_(other.logical_count)


def map_to_physical(
    topk_logical_ids: torch.Tensor, placement: ExpertPlacement, layer: int, token_offset: int = 0
) -> torch.Tensor:
    """Pick a physical replica for each chosen logical expert.

    Token t's slot j uses replica (t + token_offset + j) mod logical_count of its expert, spreading consecutive
    tokens over replicas without any host synchronisation. Different DP ranks pass different offsets (e.g. their
    rank) so that their first tokens do not all pick replica 0.

    Args:
        topk_logical_ids: [n, k] int64 logical expert ids.
        placement: current maps.
        layer: MoE layer index into the placement.
        token_offset: added to the token index before taking the modulus.

    Returns:
        [n, k] int64 physical expert ids.
    """
    if topk_logical_ids.dim() != 2:
        raise ValueError(f"topk_logical_ids must be [n, k], got {tuple(topk_logical_ids.shape)}")
    ids = topk_logical_ids.to(torch.int64)
    n, k = ids.shape
    counts = placement.logical_count[layer][ids]
    rotation = torch.arange(n, device=ids.device).unsqueeze(1) + torch.arange(k, device=ids.device) + token_offset
    replica = rotation % counts
    return placement.logical_to_physical[layer][ids, replica]


@dataclass(frozen=True)
class DispatchOutput:
    """What an EP rank receives from dispatch, and what combine needs to send results back.

    Attributes:
        hidden_states: [m, H] received token rows (one per (source token, this rank) pair).
        topk_local_ids: [m, k] int64 local slot of each routing choice, -1 where the expert lives elsewhere.
        topk_weights: [m, k] routing weights, 0 where the expert lives elsewhere.
        num_tokens_per_local_expert: [num_local] int64 routing choices received per local slot (load statistics).
        handle: transport-specific state for combine.
    """

    hidden_states: torch.Tensor
    topk_local_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens_per_local_expert: torch.Tensor
    handle: object


class TokenDispatcher(Protocol):
    """Moves routed tokens to the ranks holding their experts and sums the results back."""

    @property
    def num_local_experts(self) -> int:
        """Physical expert slots on this rank."""
        ...

    def dispatch(
        self, hidden_states: torch.Tensor, topk_physical_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        """Send each token to every rank holding one of its experts.

        Args:
            hidden_states: [n, H] this rank's tokens.
            topk_physical_ids: [n, k] int64 physical expert ids.
            topk_weights: [n, k] routing weights.
        """
        ...

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """Return every received row's result to its source rank and sum per token.

        Args:
            expert_output: [m, ...] the result of every received row.
            dispatched: the matching dispatch result.

        Returns:
            [n, ...] in hidden_states' dtype.
        """
        ...


@dataclass(frozen=True)
class AllToAllHandle:
    """State the all-to-all dispatcher keeps between dispatch and combine.

    Attributes:
        source_token_index: [num_sent] int64 source token of each sent row; rows are grouped by destination rank.
        send_counts: rows sent to each EP rank.
        recv_counts: rows received from each EP rank.
        num_tokens: n, the tokens this rank dispatched.
    """

    source_token_index: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int


class AllToAllDispatcher:
    """`TokenDispatcher` over torch.distributed all-to-all-v on the EP group (gloo, NCCL or HCCL).

    Each dispatch exchanges the per-rank row counts on the host first (one device synchronisation), then moves rows,
    local slot ids and weights with three all-to-all-v calls. Every EP rank must call dispatch and combine the same
    number of times, also with zero tokens.
    """

    def __init__(self, group: RankGroup, num_local_experts: int) -> None:
        """Create a dispatcher for one EP group.

        Args:
            group: the EP group.
            num_local_experts: physical expert slots per rank (>= 1).
        """
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
        self.group = group
        self._num_local_experts = num_local_experts

    @property
    def num_local_experts(self) -> int:
        """Physical expert slots on this rank."""
        return self._num_local_experts

    def dispatch(
        self, hidden_states: torch.Tensor, topk_physical_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchOutput:
        """See `TokenDispatcher.dispatch`."""
        n, k = _check_routing(hidden_states, topk_physical_ids, topk_weights)
        ep, num_local = self.group.size, self._num_local_experts
        ids = topk_physical_ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= ep * num_local):
            raise ValueError(f"topk_physical_ids must be in [0, {ep * num_local}), got {ids.tolist()}")
        device = hidden_states.device
        dest_rank = ids // num_local  # [n, k]
        hit = torch.zeros(n, ep, dtype=torch.bool, device=device)
        hit.scatter_(1, dest_rank, True)
        # nonzero on [ep, n] lists (rank, token) pairs grouped by destination rank, tokens ascending.
        pairs = hit.t().nonzero()
        row_rank, row_token = pairs[:, 0], pairs[:, 1]
        send_counts_tensor = hit.sum(dim=0, dtype=torch.int64)
        on_rank = dest_rank[row_token] == row_rank.unsqueeze(1)  # [num_sent, k]
        send_local_ids = torch.where(on_rank, ids[row_token] - row_rank.unsqueeze(1) * num_local, -1)
        send_weights = torch.where(on_rank, topk_weights[row_token], 0).to(topk_weights.dtype)
        send_hidden = hidden_states[row_token]

        recv_counts = exchange_counts(send_counts_tensor, self.group)
        send_counts: list[int] = send_counts_tensor.tolist()
        num_recv = sum(recv_counts)
        recv_hidden = hidden_states.new_empty((num_recv, *hidden_states.shape[1:]))
        recv_local_ids = torch.empty(num_recv, k, dtype=torch.int64, device=device)
        recv_weights = topk_weights.new_empty((num_recv, k))
        all_to_all_v(recv_hidden, send_hidden, recv_counts, send_counts, self.group)
        all_to_all_v(recv_local_ids, send_local_ids.contiguous(), recv_counts, send_counts, self.group)
        all_to_all_v(recv_weights, send_weights.contiguous(), recv_counts, send_counts, self.group)

        valid = recv_local_ids >= 0
        per_expert = torch.bincount(recv_local_ids[valid], minlength=num_local)
        handle = AllToAllHandle(row_token, send_counts, recv_counts, n)
        return DispatchOutput(recv_hidden, recv_local_ids, recv_weights, per_expert, handle)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """See `TokenDispatcher.combine`."""
        handle = dispatched.handle
        if not isinstance(handle, AllToAllHandle):
            raise TypeError(
                f"combine needs a DispatchOutput from AllToAllDispatcher, got handle {type(handle).__name__}"
            )
        if expert_output.shape[0] != sum(handle.recv_counts):
            raise ValueError(
                f"expert_output has {expert_output.shape[0]} rows, dispatch received {sum(handle.recv_counts)}"
            )
        returned = expert_output.new_empty((sum(handle.send_counts), *expert_output.shape[1:]))
        all_to_all_v(returned, expert_output.contiguous(), handle.send_counts, handle.recv_counts, self.group)
        # Sum the per-rank partial results in fp32 so the result does not depend on the order ranks answered in.
        combined = torch.zeros(
            (handle.num_tokens, *expert_output.shape[1:]), dtype=torch.float32, device=expert_output.device
        )
        combined.index_add_(0, handle.source_token_index, returned.float())
        return combined.to(dispatched.hidden_states.dtype)


def _check_routing(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple[int, int]:
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [n, H], got {tuple(hidden_states.shape)}")
    n = hidden_states.shape[0]
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n:
        raise ValueError(f"topk ids must be [n={n}, k], got {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} differs from topk ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk ids must be an integer tensor, got {topk_ids.dtype}")
    return n, int(topk_ids.shape[1])
