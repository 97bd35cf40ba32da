"""Reference Engram ops: the contracts of ``deepinfer_kernels.engram_ngram_rows``, ``engram_lookup`` and
``engram_gate`` in torch ops (the gate's FP32 sums in torch's order)."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels.engram import GATE_FLOOR

__all__ = ["engram_gate", "engram_lookup", "engram_ngram_rows"]


def engram_ngram_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    q_start: torch.Tensor,
    prefix_ids: torch.Tensor,
    old_to_new: torch.Tensor,
    pad_id: int,
    rows: torch.Tensor,
    active: torch.Tensor,
) -> None:
    ngram = prefix_ids.shape[1] + 1
    lookback = torch.arange(ngram, device=input_ids.device)
    offset = (positions - q_start[token_request])[:, None] - lookback[None, :]
    token_index = (torch.arange(input_ids.shape[0], device=input_ids.device)[:, None] - lookback[None, :]).clamp(min=0)
    prefix_col = (offset + ngram - 1).clamp(min=0, max=ngram - 2)
    from_prefix = prefix_ids[token_request[:, None].expand_as(offset), prefix_col]
    raw = torch.where(offset >= 0, input_ids[token_index], from_prefix)
    known = (raw >= 0) & (raw < old_to_new.shape[0])
    compressed = torch.where(known, old_to_new[torch.where(known, raw, 0)], -1)
    compressed = torch.where((positions[:, None] - lookback[None, :]) < 0, pad_id, compressed)
    cut = torch.cummax((compressed < 0).to(torch.int64), dim=1).values.bool()
    rows.copy_(torch.where(cut, pad_id, compressed))
    active.copy_(compressed[:, 0] >= 0)


def engram_lookup(
    rows: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    products = rows * multipliers
    hashes = [products[:, 0]]
    for n in range(1, rows.shape[1]):
        hashes.append(torch.bitwise_xor(hashes[-1], products[:, n]))
    # Column (n − 1)·heads + j: the order-(n + 1) hash modulo its own sub-table's size, in one broadcast remainder.
    shape = (rows.shape[1] - 1, sizes.numel() // (rows.shape[1] - 1))
    h = torch.stack(hashes[1:], dim=1)[:, :, None]
    index = (torch.remainder(h, sizes.view(shape)) + offsets.view(shape)).flatten(1)
    codes.copy_(weight[index].reshape(codes.shape))
    scales.copy_(scale[index].reshape(scales.shape))


def engram_gate(
    trunk: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    active: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    hidden = trunk.shape[-1]
    x, k = trunk.float(), keys.float()
    weight = q_weight.float() * k_weight.float()
    a_x = torch.rsqrt(((x * x).sum(dim=-1) / hidden + eps).double()).float()
    a_k = torch.rsqrt(((k * k).sum(dim=-1) / hidden + eps).double()).float()
    z = (x * weight[None] * k).sum(dim=-1) * a_x * a_k / math.sqrt(hidden)
    # copysign: z = +0 gives sigmoid(+1e−3).
    gate = torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(z.abs(), min=GATE_FLOOR)), z))
    updated = (x + gate[..., None] * value.float()[:, None, :]).to(out.dtype)
    out.copy_(torch.where(active[:, None, None], updated, trunk))
