"""EPLB placement policy: from per-logical-expert load to the logical expert held by every physical slot.

Pure math on CPU tensors; it never communicates and never touches weights. For each MoE layer, from windowed logical
loads t[s][e] (tokens routed to logical expert e in step s, summed over EP ranks):

1. Replication. Start with one replica per logical expert. For each redundant slot i in order, for every candidate
   expert e compute sum_s max_e'(per-replica load in step s if e had one more replica), plus 1e-4 * e so that scores
   stay distinct and ties go to the lowest id; give the replica to the argmin. Redundant replica i is physical slot
   E + i before placement.
2. Placement (only when each rank holds more than one slot). Sort replicas by their total per-replica load,
   descending (stable). Assign each in turn to the non-full rank that minimises sum_s max_r(per-step rank load after
   the assignment), lowest rank on ties. Rank r's slots [r * slots_per_rank, (r + 1) * slots_per_rank) receive its
   replicas in assignment order.

A replica's per-step load is t[s][e] / (replicas of e): the router spreads an expert's tokens evenly over its
replicas.
"""

from __future__ import annotations

import torch

__all__ = ["max_to_mean_rank_load", "place_replicas", "rebalance_experts", "replicate_experts"]

_TIE_BREAK = 1e-4


def _check_load(load: torch.Tensor, name: str, dims: int) -> torch.Tensor:
    if load.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(load.shape)}")
    if not load.is_floating_point() and load.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an integer or floating tensor, got {load.dtype}")
    load64 = load.detach().to(device="cpu", dtype=torch.float64)
    if load64.numel() and float(load64.min()) < 0:
        raise ValueError(f"{name} must be non-negative, got minimum {float(load64.min())}")
    return load64


def _max_excluding_each(values: torch.Tensor) -> torch.Tensor:
    """others[s, j] = max over j' != j of values[s, j'] (0 when there is no other column). values: [S, J]."""
    num_cols = values.shape[1]
    if num_cols == 1:
        return torch.zeros_like(values)
    top = values.topk(2, dim=1)
    first, second = top.values[:, :1], top.values[:, 1:2]
    is_argmax = torch.arange(num_cols).unsqueeze(0) == top.indices[:, :1]
    return torch.where(is_argmax, second, first)


def replicate_experts(load: torch.Tensor, num_redundant_experts: int) -> torch.Tensor:
    """Choose which logical experts the redundant slots replicate (step 1 of the module docstring).

    Args:
        load: [num_steps, num_logical] non-negative per-step logical expert load of one layer.
        num_redundant_experts: redundant slots to fill (>= 0).

    Returns:
        [num_logical + num_redundant_experts] int64: logical expert of each replica; entry e < num_logical is e,
        entry num_logical + i is the expert chosen for redundant slot i.
    """
    t = _check_load(load, "load", 2)
    if num_redundant_experts < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_experts}")
    num_logical = t.shape[1]
    counts = torch.ones(num_logical, dtype=torch.float64)
    tie_break = _TIE_BREAK * torch.arange(num_logical, dtype=torch.float64)
    chosen = []
    for _ in range(num_redundant_experts):
        others = _max_excluding_each(t / counts)
        score = torch.maximum(others, t / (counts + 1)).sum(dim=0) + tie_break
        expert = int(torch.argmin(score))
        counts[expert] += 1
        chosen.append(expert)
    return torch.cat([torch.arange(num_logical), torch.tensor(chosen, dtype=torch.int64)])


def place_replicas(load: torch.Tensor, replica_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Assign replicas to ranks (step 2 of the module docstring).

    Args:
        load: [num_steps, num_logical] non-negative per-step logical expert load of one layer.
        replica_to_logical: [num_replicas] int64 logical expert of each replica (every expert at least once);
            num_replicas must be a multiple of num_ranks.
        num_ranks: EP ranks (>= 1).

    Returns:
        [num_replicas] int64 physical_to_logical: rank r's slots are entries [r * per_rank, (r + 1) * per_rank).
    """
    t = _check_load(load, "load", 2)
    num_replicas = replica_to_logical.shape[0]
    if num_ranks < 1 or num_replicas % num_ranks != 0:
        raise ValueError(
            f"{num_replicas} replicas do not divide over num_ranks={num_ranks}; num_ranks must be a divisor of "
            f"{num_replicas}"
        )
    counts = torch.bincount(replica_to_logical, minlength=t.shape[1]).to(torch.float64)
    if replica_to_logical.numel() and (counts.shape[0] != t.shape[1] or bool((counts == 0).any())):
        raise ValueError(f"replica_to_logical must cover every one of the {t.shape[1]} logical experts at least once")
    per_rank = num_replicas // num_ranks
    if per_rank == 1:
        return replica_to_logical.clone()
    replica_load = t[:, replica_to_logical] / counts[replica_to_logical]  # [S, num_replicas]
    order = torch.sort(replica_load.sum(dim=0), descending=True, stable=True).indices
    rank_load = torch.zeros(t.shape[0], num_ranks, dtype=torch.float64)
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for replica in order.tolist():
        step_load = replica_load[:, replica : replica + 1]
        score = torch.maximum(_max_excluding_each(rank_load), rank_load + step_load).sum(dim=0)
        full = torch.tensor([len(slots) >= per_rank for slots in assigned])
        score[full] = torch.inf
        rank = int(torch.argmin(score))  # first minimum: lowest rank on ties
        rank_load[:, rank] += step_load[:, 0]
        assigned[rank].append(replica)
    return replica_to_logical[torch.tensor([r for slots in assigned for r in slots], dtype=torch.int64)]


def rebalance_experts(load: torch.Tensor, num_redundant_experts: int, num_ranks: int) -> torch.Tensor:
    """New placement of every MoE layer from its windowed load.

    Args:
        load: [num_steps, num_layers, num_logical] non-negative logical expert load (integer counts or floats),
            summed over EP ranks.
        num_redundant_experts: redundant slots per layer (>= 0).
        num_ranks: EP ranks; must divide num_logical + num_redundant_experts.

    Returns:
        [num_layers, num_logical + num_redundant_experts] int64 physical_to_logical on CPU.
    """
    t = _check_load(load, "load", 3)
    num_physical = t.shape[2] + num_redundant_experts
    if num_ranks < 1 or num_physical % num_ranks != 0:
        raise ValueError(
            f"num_logical + num_redundant_experts = {t.shape[2]} + {num_redundant_experts} = {num_physical} does not "
            f"divide over num_ranks={num_ranks}"
        )
    layers = []
    for layer in range(t.shape[1]):
        replicas = replicate_experts(t[:, layer], num_redundant_experts)
        layers.append(place_replicas(t[:, layer], replicas, num_ranks))
    return torch.stack(layers) if layers else torch.empty(0, num_physical, dtype=torch.int64)


def max_to_mean_rank_load(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> float:
    """Load-imbalance of a placement: sum_s max_r(rank load) / sum_s mean_r(rank load), 1.0 = perfectly even.

    Args:
        load: [num_steps, num_logical] per-step logical expert load of one layer.
        physical_to_logical: [num_physical] logical expert of each slot; rank r holds an even contiguous share.
        num_ranks: EP ranks (must divide num_physical).

    Returns:
        The ratio (>= 1), or 1.0 when there is no load at all.
    """
    t = _check_load(load, "load", 2)
    num_physical = physical_to_logical.shape[0]
    if num_ranks < 1 or num_physical % num_ranks != 0:
        raise ValueError(f"{num_physical} physical experts do not divide over num_ranks={num_ranks}")
    counts = torch.bincount(physical_to_logical, minlength=t.shape[1]).to(torch.float64)
    slot_load = t[:, physical_to_logical] / counts[physical_to_logical]  # [S, num_physical]
    rank_load = slot_load.reshape(t.shape[0], num_ranks, -1).sum(dim=2)
    total_mean = float(rank_load.mean(dim=1).sum())
    if total_mean == 0.0:
        return 1.0
    return float(rank_load.max(dim=1).values.sum()) / total_mean
