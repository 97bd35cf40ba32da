"""Public Engram ops (docs/design/model.md, "N-gram rows", "Engram hash", "Engram lookup and gate"): validation and
allocation, then the resolved backend (docs/design/kernels.md, "engram_ngram_rows", "engram_lookup", "engram_gate")."""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_shape, check_tensor

__all__ = ["GATE_FLOOR", "engram_gate", "engram_lookup", "engram_ngram_rows"]

# The gate's floor on |z| before the square root (sqrt(1e−6) = 1e−3 at z = 0).
GATE_FLOOR = 1e-6
_DTYPES = (torch.bfloat16, torch.float32)
# Bytes a gathered code and its scale are stored in (read and copied as they are).
_CODE_DTYPE = torch.float8_e4m3fn
_SCALE_DTYPE = torch.float8_e8m0fnu


def engram_ngram_rows(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    token_request: torch.Tensor,
    q_start: torch.Tensor,
    prefix_ids: torch.Tensor,
    old_to_new: torch.Tensor,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed n-gram ids of a step's tokens (docs/design/model.md, "N-gram rows").

    Column ``j < N`` of token ``t`` (request ``r = token_request[t]``) is the token ``j`` places back: this step's
    token ``t − j`` where that position is in the step's chunk (``positions[t] − q_start[r] ≥ j``), else
    ``prefix_ids[r, N − 1 + positions[t] − q_start[r] − j]``. Its compressed id is ``old_to_new[id]``, −1 for an id
    outside the table; the pad id before position 0; and from the first negative id on, that column included (the
    n-gram cut there), the pad id.

    Args:
        input_ids: [T] int64 token ids of the step, requests in order.
        positions: [T] int64 absolute positions.
        token_request: [T] int64 request of each token.
        q_start: [R] int64 first position each request computes this step.
        prefix_ids: [R, N − 1] int64 tokens before each request's chunk (oldest first; −1 for none), ``N ≥ 2``.
        old_to_new: [V] int64 compressed id of every token id (−1: none).
        pad_id: the compressed pad id.

    Returns:
        ``(rows [T, N] int64, active [T] bool)``: active where the token's own compressed id is not negative.

    Raises:
        TypeError: an argument is not a tensor, not int64, or ``pad_id`` not an int.
        ValueError: shapes disagree, or devices differ.
    """
    for name, tensor in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("token_request", token_request),
        ("q_start", q_start),
        ("prefix_ids", prefix_ids),
        ("old_to_new", old_to_new),
    ):
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, (torch.int64,))
    if not isinstance(pad_id, int):
        raise TypeError(f"pad_id must be an int, got {type(pad_id).__name__}")
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must have shape [T], got {tuple(input_ids.shape)}")
    tokens = input_ids.shape[0]
    check_shape("positions", positions, (tokens,))
    check_shape("token_request", token_request, (tokens,))
    if (
        q_start.dim() != 1
        or prefix_ids.dim() != 2
        or prefix_ids.shape[0] != q_start.shape[0]
        or prefix_ids.shape[1] < 1
    ):
        raise ValueError(
            f"q_start and prefix_ids must be [R] and [R, N - 1] with N >= 2, got {tuple(q_start.shape)}, "
            f"{tuple(prefix_ids.shape)}"
        )
    if old_to_new.dim() != 1:
        raise ValueError(f"old_to_new must have shape [V], got {tuple(old_to_new.shape)}")
    check_same_device(
        input_ids=input_ids,
        positions=positions,
        token_request=token_request,
        q_start=q_start,
        prefix_ids=prefix_ids,
        old_to_new=old_to_new,
    )
    rows = torch.empty((tokens, prefix_ids.shape[1] + 1), dtype=torch.int64, device=input_ids.device)
    active = torch.empty((tokens,), dtype=torch.bool, device=input_ids.device)
    if tokens:
        _registry.resolve("engram_ngram_rows", input_ids.device.type)(
            input_ids.contiguous(),
            positions.contiguous(),
            token_request.contiguous(),
            q_start.contiguous(),
            prefix_ids.contiguous(),
            old_to_new.contiguous(),
            pad_id,
            rows,
            active,
        )
    return rows, active


def engram_lookup(
    rows: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The hashed table rows of each token, gathered as stored.

    Per token ``t`` the hash folds its n-gram ids left to right in int64 arithmetic that wraps:
    ``h_0 = rows[t, 0] · a_0``, ``h_n = h_(n−1) xor rows[t, n] · a_n``. Column ``c = (n − 1) · heads + j``
    (``n = 1 … N − 1``, ``j < heads``) takes table row ``(h_n mod sizes[c]) + offsets[c]`` (the remainder in
    ``[0, sizes[c])``): ``codes[t, c·d : (c+1)·d] = weight[row]`` and ``scales[t, c·s : (c+1)·s] = scale[row]``.

    Args:
        rows: [T, N] int64 n-gram ids (``N ≥ 2``).
        multipliers: [N] int64 hash multipliers ``a``.
        sizes: [(N − 1) · heads] int64, each column's sub-table size (positive).
        offsets: [(N − 1) · heads] int64, each column's first table row.
        weight: [R, d] float8_e4m3fn table.
        scale: [R, s] float8_e8m0fnu, the table rows' scales.

    Returns:
        ``(codes [T, (N − 1) · heads · d], scales [T, (N − 1) · heads · s])`` in weight's and scale's dtypes.

    Raises:
        TypeError: an argument is not a tensor or has another dtype.
        ValueError: shapes disagree, or devices differ.
    """
    for name, tensor, dtype in (
        ("rows", rows, torch.int64),
        ("multipliers", multipliers, torch.int64),
        ("sizes", sizes, torch.int64),
        ("offsets", offsets, torch.int64),
        ("weight", weight, _CODE_DTYPE),
        ("scale", scale, _SCALE_DTYPE),
    ):
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, (dtype,))
    if rows.dim() != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must have shape [T, N] with N >= 2, got {tuple(rows.shape)}")
    tokens, ngram = rows.shape
    check_shape("multipliers", multipliers, (ngram,))
    if sizes.dim() != 1 or sizes.numel() == 0 or sizes.numel() % (ngram - 1):
        raise ValueError(f"sizes must have shape [(N - 1) * heads] with N = {ngram}, got {tuple(sizes.shape)}")
    check_shape("offsets", offsets, tuple(sizes.shape))
    if weight.dim() != 2 or scale.dim() != 2 or scale.shape[0] != weight.shape[0]:
        raise ValueError(f"weight and scale must be [R, d] and [R, s], got {tuple(weight.shape)}, {tuple(scale.shape)}")
    check_same_device(rows=rows, multipliers=multipliers, sizes=sizes, offsets=offsets, weight=weight, scale=scale)
    columns = sizes.numel()
    codes = torch.empty((tokens, columns * weight.shape[1]), dtype=weight.dtype, device=weight.device)
    scales = torch.empty((tokens, columns * scale.shape[1]), dtype=scale.dtype, device=scale.device)
    if tokens:
        _registry.resolve("engram_lookup", rows.device.type)(
            rows.contiguous(), multipliers, sizes, offsets, weight.contiguous(), scale.contiguous(), codes, scales
        )
    return codes, scales


def engram_gate(
    trunk: torch.Tensor,
    keys: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    active: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The Engram gate on ``m`` residual streams, in FP32 with one rounding per output.

    Per token ``t`` and stream ``j``, with ``x = trunk[t, j]``, ``k = keys[t, j]``, ``w = q_weight[j] · k_weight[j]``
    (FP32 product), ``a(u) = 1 / sqrt(Σu² / H + eps)`` (the mean square in FP32, the reciprocal root in FP64, then
    FP32), ``z = Σ(x · w · k) · a(x) · a(k) / sqrt(H)`` and ``g = sigmoid(copysign(sqrt(max(|z|, 1e−6)), z))``:
    ``out[t, j] = round(x + g · value[t])`` to trunk's dtype for active tokens, ``trunk[t, j]`` unchanged otherwise.
    Backends may sum in their own order (the reference: torch's FP32 sums).

    Args:
        trunk: [T, m, H] bf16 or fp32, the streams (last dimension contiguous).
        keys: [T, m, H] bf16 or fp32, one key per stream (any strides with a contiguous last dimension: a view of
            the projection's output is fine).
        value: [T, H] bf16 or fp32, the value shared by the streams (same stride rule).
        q_weight, k_weight: [m, H] bf16 or fp32.
        active: [T] bool; inactive tokens keep their streams.
        eps: positive finite float added to the mean squares.

    Returns:
        [T, m, H] tensor with trunk's dtype, contiguous.

    Raises:
        TypeError: an argument is not a tensor or has an unsupported dtype.
        ValueError: shapes disagree, ``eps`` is not positive and finite, or devices differ.
    """
    for name, tensor in (("trunk", trunk), ("keys", keys), ("value", value), ("q_weight", q_weight)):
        check_tensor(name, tensor)
        check_dtype(name, tensor.dtype, _DTYPES)
    check_tensor("k_weight", k_weight)
    check_dtype("k_weight", k_weight.dtype, _DTYPES)
    check_tensor("active", active)
    check_dtype("active", active.dtype, (torch.bool,))
    if trunk.dim() != 3:
        raise ValueError(f"trunk must have shape [T, m, H], got {tuple(trunk.shape)}")
    tokens, streams, hidden = trunk.shape
    check_shape("keys", keys, (tokens, streams, hidden))
    check_shape("value", value, (tokens, hidden))
    check_shape("q_weight", q_weight, (streams, hidden))
    check_shape("k_weight", k_weight, (streams, hidden))
    check_shape("active", active, (tokens,))
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    check_same_device(trunk=trunk, keys=keys, value=value, q_weight=q_weight, k_weight=k_weight, active=active)
    out = torch.empty(trunk.shape, dtype=trunk.dtype, device=trunk.device)
    if trunk.numel() == 0:
        return out
    rows = [t if t.stride(-1) == 1 else t.contiguous() for t in (trunk, keys, value)]
    _registry.resolve("engram_gate", trunk.device.type)(
        *rows, q_weight.contiguous(), k_weight.contiguous(), active, float(eps), out
    )
    return out
