"""Applying an EPLB placement: moving expert weights between EP ranks and installing the new maps.

It never decides: the new placement comes from `eplb.policy`. For one layer, with the old and new
physical_to_logical maps (identical on every rank):

- A new local slot whose logical expert this rank already holds is filled by a local copy.
- Otherwise the expert is received. For each logical expert, senders are the ranks holding it (their first slot
  with it) and receivers the ranks needing it without holding it; receivers are assigned to senders in contiguous
  blocks of floor(R / S), the remaining R mod S receivers round-robin from the first sender.
- Transfers run as batched point-to-point operations, in `num_p2p_groups` buckets keyed by
  (receiver - sender) mod num_p2p_groups, one bucket after the other.

Weights are rewritten in place (`copy_`), so tensors captured elsewhere (CUDA graphs, kernels) stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer_parallel.expert_parallel import ExpertPlacement
from deepinfer_parallel.groups import RankGroup

__all__ = ["ExpertTransfer", "apply_placement", "plan_transfers", "rearrange_expert_weights"]


@dataclass(frozen=True)
class ExpertTransfer:
    """One expert's weights sent from one EP rank to another.

    Attributes:
        logical_expert: the expert moved.
        src_rank: sending EP rank (index in the EP group).
        src_slot: local slot on the sender that holds the expert.
        dst_rank: receiving EP rank.
    """

    logical_expert: int
    src_rank: int
    src_slot: int
    dst_rank: int


def plan_transfers(
    old_physical_to_logical: Sequence[int], new_physical_to_logical: Sequence[int], num_ranks: int
) -> list[ExpertTransfer]:
    """Cross-rank transfers that turn the old placement of one layer into the new one.

    Args:
        old_physical_to_logical: [num_physical] current logical expert of each slot.
        new_physical_to_logical: [num_physical] wanted logical expert of each slot; every expert it names must be
            held somewhere in the old placement.
        num_ranks: EP ranks; must divide num_physical.

    Returns:
        Transfers ordered by logical expert, then receiver rank.
    """
    num_physical = len(old_physical_to_logical)
    if len(new_physical_to_logical) != num_physical or num_ranks < 1 or num_physical % num_ranks != 0:
        raise ValueError(
            f"placements of {num_physical} and {len(new_physical_to_logical)} slots do not divide evenly over "
            f"num_ranks={num_ranks}"
        )
    per_rank = num_physical // num_ranks
    old_local = [list(old_physical_to_logical[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    new_local = [set(new_physical_to_logical[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    transfers = []
    for expert in sorted(set(new_physical_to_logical)):
        senders = [r for r in range(num_ranks) if expert in old_local[r]]
        receivers = [r for r in range(num_ranks) if expert in new_local[r] and expert not in old_local[r]]
        if not receivers:
            continue
        if not senders:
            raise ValueError(f"logical expert {expert} is wanted by ranks {receivers} but held by no rank")
        block = len(receivers) // len(senders)
        for j, receiver in enumerate(receivers):
            in_blocks = j < block * len(senders)
            sender = senders[j // block] if in_blocks else senders[(j - block * len(senders)) % len(senders)]
            transfers.append(ExpertTransfer(expert, sender, old_local[sender].index(expert), receiver))
    return transfers


def rearrange_expert_weights(
    weights: Sequence[torch.Tensor],
    old_physical_to_logical: Sequence[int],
    new_physical_to_logical: Sequence[int],
    group: RankGroup,
    num_p2p_groups: int = 1,
) -> None:
    """Move one layer's local expert weights to the new placement (collective over the EP group).

    Args:
        weights: this rank's expert tensors of the layer, each [num_local_experts, ...] (e.g. gate/up, down, scales);
            rewritten in place.
        old_physical_to_logical: [num_physical] placement the weights are in now.
        new_physical_to_logical: [num_physical] placement to move to.
        group: the EP group.
        num_p2p_groups: transfer buckets (>= 1).
    """
    if num_p2p_groups < 1:
        raise ValueError(f"num_p2p_groups must be >= 1, got {num_p2p_groups}")
    num_ranks, me = group.size, group.rank
    per_rank = len(old_physical_to_logical) // num_ranks
    for tensor in weights:
        if tensor.shape[0] != per_rank:
            raise ValueError(f"expert weight of shape {tuple(tensor.shape)} must have {per_rank} local experts first")
    transfers = plan_transfers(old_physical_to_logical, new_physical_to_logical, num_ranks)
    old_local = list(old_physical_to_logical[me * per_rank : (me + 1) * per_rank])
    new_local = list(new_physical_to_logical[me * per_rank : (me + 1) * per_rank])
    received: dict[int, list[torch.Tensor]] = {}
    for bucket in range(num_p2p_groups):
        ops = []
        for index, transfer in enumerate(transfers):
            if (transfer.dst_rank - transfer.src_rank) % num_p2p_groups != bucket:
                continue
            for w, tensor in enumerate(weights):
                tag = index * len(weights) + w
                if transfer.src_rank == me:
                    peer = group.ranks[transfer.dst_rank]
                    ops.append(
                        dist.P2POp(dist.isend, tensor[transfer.src_slot].contiguous(), peer, group.process_group, tag)
                    )
                if transfer.dst_rank == me:
                    buffer = torch.empty_like(tensor[0])
                    received.setdefault(transfer.logical_expert, []).append(buffer)
                    ops.append(dist.P2POp(dist.irecv, buffer, group.ranks[transfer.src_rank], group.process_group, tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    for w, tensor in enumerate(weights):
        rows = [tensor[old_local.index(expert)] if expert in old_local else received[expert][w] for expert in new_local]
        # torch.stack copies, so overwriting `tensor` below cannot clobber a row another slot still reads.
        tensor.copy_(torch.stack(rows))


def apply_placement(
    layer_weights: Sequence[Sequence[torch.Tensor]],
    placement: ExpertPlacement,
    new_physical_to_logical: torch.Tensor,
    group: RankGroup,
    num_p2p_groups: int = 1,
) -> None:
    """Move every layer's expert weights to a new placement, then install the new maps in `placement` (in place).

    Collective over the EP group; every EP rank calls it with the same `new_physical_to_logical`.

    Args:
        layer_weights: per MoE layer, this rank's expert tensors (each [num_local_experts, ...]).
        placement: the live maps (shared with the router); updated in place at the end.
        new_physical_to_logical: [num_layers, num_physical] int64 new placement (from `eplb.policy`).
        group: the EP group.
        num_p2p_groups: transfer buckets per layer (>= 1).
    """
    if len(layer_weights) != placement.num_layers:
        raise ValueError(f"got weights for {len(layer_weights)} layers, the placement has {placement.num_layers}")
    new_placement = ExpertPlacement.from_physical_to_logical(new_physical_to_logical.cpu(), placement.layout)
    old = placement.physical_to_logical.cpu().tolist()
    new = new_placement.physical_to_logical.tolist()
    for layer, weights in enumerate(layer_weights):
        rearrange_expert_weights(weights, old[layer], new[layer], group, num_p2p_groups)
    placement.copy_(new_placement)
