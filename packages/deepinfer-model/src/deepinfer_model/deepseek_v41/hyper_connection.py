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

import deepinfer_kernels as dk
from deepinfer_model.layers.mode import ComputeMode

__all__ = [
    "HCMixes",
    "hc_head",
    "hc_mix_logits",
    "hc_mixes",
    "hc_post",
    "hc_read",
    "initial_read_mix",
]

HCMixes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def hc_mix_logits(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float, mode: ComputeMode) -> torch.Tensor:
    """``μ = γ · fn·z`` (docs/design/model.md, "Mix logits"): ``fn`` applied to the RMS-normalized flattened trunk.

    Args: trunk [n, m, H]; fn [rows, m·H] fp32. Returns: [n, rows] fp32.
    """
    return dk.hc_mix_logits(trunk, fn, rms_eps, tf32=mode is ComputeMode.EXACT)


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
    reciprocal square root. One kernels op (``deepinfer_kernels.hc_mixes``: two kernels on NVIDIA).

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
    return dk.hc_mixes(trunk, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, tf32=mode is ComputeMode.EXACT)


def hc_read(trunk: torch.Tensor, read_mix: torch.Tensor, mode: ComputeMode) -> torch.Tensor:
    """``u = Σ_j P_j · X_j`` accumulated in stream order (docs/design/model.md, "Read and post").

    Args: trunk [n, m, H]; read_mix [n, m]. Returns: [n, H] activation dtype.
    """
    return dk.hc_read(trunk, read_mix.float(), mode.activation_dtype)


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
    return dk.hc_post(output, trunk, write_mix, comb, mode.activation_dtype)


def initial_read_mix(num_tokens: int, hc_mult: int, device: torch.device) -> torch.Tensor:
    """The one-hot read-mix on stream 0 used by the first sub-layer. Returns: [n, m] fp32."""
    mix = torch.zeros(num_tokens, hc_mult, dtype=torch.float32, device=device)
    mix[:, 0] = 1.0
    return mix
