"""Collectives over a `RankGroup` on caller-provided (preallocated) buffers.

Each wrapper checks shapes and dtypes, writes into the output buffer the caller owns (so steady-state steps allocate
nothing and buffers can be captured in CUDA graphs) and works on gloo (CPU tensors) and NCCL/HCCL (device tensors)
through the same torch.distributed calls. A group of one rank needs no initialised world: the collectives reduce to
local copies.

Variable-size exchanges (all-to-all-v) need the split sizes on the host; `exchange_counts` / `all_gather_counts`
move them and are the only wrappers that synchronise the host with the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from deepinfer_parallel.groups import RankGroup

__all__ = [
    "all_gather_counts",
    "all_gather_into",
    "all_reduce_",
    "all_to_all_v",
    "exchange_counts",
    "reduce_scatter_into",
]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _check_pair(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{what}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{what}: output device {output.device} differs from input device {input.device}")
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(f"{what}: trailing shapes differ: output {tuple(output.shape)} vs input {tuple(input.shape)}")
    if not output.is_contiguous() or not input.is_contiguous():
        raise ValueError(f"{what}: output and input must be contiguous")


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    group: RankGroup,
) -> torch.Tensor:
    """All-to-all with per-peer row counts: rows input[in_off[p] : in_off[p] + input_split_sizes[p]] go to peer p.

    Args:
        output: [sum(output_split_sizes), *trailing], same dtype/device as input; rows from peer p land in
            order of p.
        input: [sum(input_split_sizes), *trailing], contiguous.
        output_split_sizes: [group.size] rows received from each peer.
        input_split_sizes: [group.size] rows sent to each peer.
        group: the group to exchange over.

    Returns:
        `output`.
    """
    _check_pair(output, input, "all_to_all_v")
    if len(output_split_sizes) != group.size or len(input_split_sizes) != group.size:
        raise ValueError(
            f"all_to_all_v: split sizes need {group.size} entries, got {len(output_split_sizes)} (output) and "
            f"{len(input_split_sizes)} (input)"
        )
    if sum(output_split_sizes) != output.shape[0] or sum(input_split_sizes) != input.shape[0]:
        raise ValueError(
            f"all_to_all_v: split sizes sum to {sum(output_split_sizes)} (output) / {sum(input_split_sizes)} "
            f"(input) but the buffers have {output.shape[0]} / {input.shape[0]} rows"
        )
    if group.size == 1:
        output.copy_(input)
        return output
    dist.all_to_all_single(output, input, list(output_split_sizes), list(input_split_sizes), group=group.process_group)
    return output


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Concatenate every rank's `input` along dim 0, in group order.

    Args:
        output: [group.size * n, *trailing], same dtype/device as input.
        input: [n, *trailing], contiguous.
        group: the group to gather over.

    Returns:
        `output`.
    """
    _check_pair(output, input, "all_gather_into")
    if output.shape[0] != group.size * input.shape[0]:
        raise ValueError(
            f"all_gather_into: output has {output.shape[0]} rows, expected group.size * input rows = "
            f"{group.size} * {input.shape[0]}"
        )
    if group.size == 1:
        output.copy_(input)
        return output
    dist.all_gather_into_tensor(output, input, group=group.process_group)
    return output


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """Sum `input` over ranks and keep this rank's slice: output = sum_ranks(input)[rank * n : (rank + 1) * n].

    Args:
        output: [n, *trailing], same dtype/device as input.
        input: [group.size * n, *trailing], contiguous.
        group: the group to reduce over.

    Returns:
        `output`.
    """
    _check_pair(output, input, "reduce_scatter_into")
    if input.shape[0] != group.size * output.shape[0]:
        raise ValueError(
            f"reduce_scatter_into: input has {input.shape[0]} rows, expected group.size * output rows = "
            f"{group.size} * {output.shape[0]}"
        )
    if group.size == 1:
        output.copy_(input)
        return output
    dist.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=group.process_group)
    return output


def all_reduce_(tensor: torch.Tensor, group: RankGroup, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` in place over the group.

    Args:
        tensor: any shape; overwritten with the reduction.
        group: the group to reduce over.
        op: "sum", "max" or "min".

    Returns:
        `tensor`.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if group.size > 1:
        dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.process_group)
    return tensor


def exchange_counts(send_counts: torch.Tensor, group: RankGroup) -> list[int]:
    """Tell every peer how many rows it will receive from this rank (the split sizes of an all-to-all-v).

    Args:
        send_counts: [group.size] int64; send_counts[p] = rows this rank sends to peer p. On the group's device.

    Returns:
        recv_counts as host ints: recv_counts[p] = rows peer p sends to this rank. Synchronises with the device.
    """
    if send_counts.dtype != torch.int64 or send_counts.shape != (group.size,):
        raise ValueError(
            f"exchange_counts: send_counts must be int64 of shape ({group.size},), got {send_counts.dtype} "
            f"{tuple(send_counts.shape)}"
        )
    recv_counts = torch.empty_like(send_counts)
    all_to_all_v(recv_counts, send_counts.contiguous(), [1] * group.size, [1] * group.size, group)
    counts: list[int] = recv_counts.tolist()
    return counts


def all_gather_counts(count: int, group: RankGroup, device: torch.device) -> list[int]:
    """Gather one host int from every rank, in group order.

    Args:
        count: this rank's value.
        group: the group to gather over.
        device: where the exchange buffer lives (CPU for gloo, the rank's GPU for NCCL).

    Returns:
        [group.size] host ints. Synchronises with the device.
    """
    local = torch.tensor([count], dtype=torch.int64, device=device)
    gathered = torch.empty(group.size, dtype=torch.int64, device=device)
    all_gather_into(gathered, local, group)
    counts: list[int] = gathered.tolist()
    return counts
