"""Manifold-constrained hyper-connections: the ``m``-stream residual trunk
(docs/design/model.md, "Hyper-connections (mHC)").

Glossary:
    trunk: the residual state ``X`` ``[n, m, H]`` (``m`` = ``hc_mult`` streams).
    read-mix ``P`` ``[n, m]``: weights that collapse the trunk into one sub-layer input.
    write-mix ``Q`` ``[n, m]``: how a sub-layer output is written back to each stream.
    comb ``C`` ``[n, m, m]``: doubly-stochastic (Sinkhorn) stream mixing, source ``i`` → destination ``j``.

In the shifted schedule (``hc_shifted``, the default) a sub-layer reads its input with the read-mix computed by the
previous sub-layer (the very first read is a one-hot on stream 0) and the network ends with the last read-mix; in the
non-shifted schedule a sub-layer reads with its own read-mix and an HC head collapses the trunk at the end
(docs/design/model.md, "Shifted schedule").
"""

from __future__ import annotations

import torch

from deepinfer_model.layers.mode import ComputeMode, round_activation

__all__ = [
    "HCMixes",
    "hc_head",
    "hc_mix_logits",
    "hc_mixes",
    "hc_post",
    "hc_read",
    "initial_read_mix",
    "round_to_tf32",
]

HC_POST_MULT = 2.0

HCMixes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values to TF32 (10 mantissa bits, nearest-even); the result stays FP32."""
    bits = x.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)


def hc_mix_logits(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float, mode: ComputeMode) -> torch.Tensor:
    """``μ = γ · fn·z`` (docs/design/model.md, "Mix logits"): ``fn`` applied to the RMS-normalized flattened trunk.

    Args: trunk [n, m, H]; fn [rows, m·H] fp32. Returns: [n, rows] fp32.
    """
    z = trunk.reshape(trunk.shape[0], -1).float()
    mean_square = (z * z).sum(dim=-1, keepdim=True) / z.shape[-1]
    gamma = torch.rsqrt((mean_square + rms_eps).double()).float()
    weight = round_to_tf32(fn) if mode is ComputeMode.EXACT else fn.float()
    return (z @ weight.t()) * gamma


def hc_head(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    mode: ComputeMode,
) -> torch.Tensor:
    """Non-shifted HC head (docs/design/model.md, "Shifted schedule"): collapse the trunk with its own read-mix.

    Args: trunk [n, m, H]; fn [m, m·H]; scale [1]; base [m]. Returns: [n, H] activation dtype.
    """
    read = torch.sigmoid(hc_mix_logits(trunk, fn, rms_eps, mode) * scale[0] + base) + hc_eps
    return hc_read(trunk, read, mode)


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    mode: ComputeMode,
) -> HCMixes:
    """Token-dependent mixes of one sub-layer, FP32 (docs/design/model.md, "Read, write and comb mixes").

    The mix GEMM runs in TF32 in exact mode (``fn`` rounded to TF32; the BF16 trunk is exact in TF32;
    docs/design/numerics.md, "GEMM accumulation") and in plain FP32 otherwise; ``γ`` is a correctly rounded FP32
    reciprocal square root.

    Args:
        trunk: [n, m, H] bf16/fp32.
        fn: [(2+m)·m, m·H] fp32 (norm weight folded in).
        scale: [3] fp32.
        base: [(2+m)·m] fp32.
        rms_eps: ``rms_norm_eps``.
        hc_eps: ``hc_eps``.
        sinkhorn_iters: ``hc_sinkhorn_iters`` (≥ 1).
        mode: compute mode.

    Returns:
        ``(P, Q, C)``: [n, m], [n, m], [n, m, m] fp32.
    """
    m = trunk.shape[1]
    mu = hc_mix_logits(trunk, fn, rms_eps, mode)
    read = torch.sigmoid(mu[:, :m] * scale[0] + base[:m]) + hc_eps
    write = torch.sigmoid(mu[:, m : 2 * m] * scale[1] + base[m : 2 * m]) * HC_POST_MULT
    logits = (mu[:, 2 * m :] * scale[2] + base[2 * m :]).view(-1, m, m)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return read, write, comb


def hc_read(trunk: torch.Tensor, read_mix: torch.Tensor, mode: ComputeMode) -> torch.Tensor:
    """``u = Σ_j P_j · X_j`` accumulated in stream order (docs/design/model.md, "Read and post").

    Args: trunk [n, m, H]; read_mix [n, m]. Returns: [n, H] activation dtype.
    """
    x = trunk.float()
    acc = read_mix[:, 0:1] * x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + read_mix[:, j : j + 1] * x[:, j]
    return round_activation(acc, mode)


def hc_post(
    output: torch.Tensor, trunk: torch.Tensor, write_mix: torch.Tensor, comb: torch.Tensor, mode: ComputeMode
) -> torch.Tensor:
    """``X'_o = Q_o · y + Σ_i C_{i,o} · X_i`` (docs/design/model.md, "Read and post").

    Args:
        output: [n, H] sub-layer output.
        trunk: [n, m, H] the trunk the sub-layer's mixes were computed from.
        write_mix: [n, m]; comb: [n, m, m].

    Returns:
        [n, m, H] activation dtype.
    """
    x, y = trunk.float(), output.float()
    streams = []
    for o in range(x.shape[1]):
        acc = write_mix[:, o : o + 1] * y
        for i in range(x.shape[1]):
            acc = acc + comb[:, i, o : o + 1] * x[:, i]
        streams.append(acc)
    return round_activation(torch.stack(streams, dim=1), mode)


def initial_read_mix(num_tokens: int, hc_mult: int, device: torch.device) -> torch.Tensor:
    """The one-hot read-mix on stream 0 used by the first sub-layer. Returns: [n, m] fp32."""
    mix = torch.zeros(num_tokens, hc_mult, dtype=torch.float32, device=device)
    mix[:, 0] = 1.0
    return mix
