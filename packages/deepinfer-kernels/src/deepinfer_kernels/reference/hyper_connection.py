"""Reference mHC ops (docs/design/model.md, "Hyper-connections (mHC)"): mix logits, the read/write/comb mixes with
their Sinkhorn iterations, the read and the post. Plain PyTorch, FP32; these define the fused Triton kernels.

Shapes: trunk ``X`` ``[n, m, H]`` (``m`` = ``hc_mult`` streams); ``fn`` ``[R, m·H]`` with ``R = (2+m)·m`` rows for
the mixes (read ``m``, write ``m``, comb ``m·m`` row-major) or ``m`` for the non-shifted HC head.
"""

from __future__ import annotations

import torch

__all__ = ["HC_POST_MULT", "hc_mix_logits", "hc_mixes", "hc_post", "hc_read", "round_to_tf32"]

HC_POST_MULT = 2.0


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values to TF32 (10 mantissa bits, nearest-even); the result stays FP32."""
    bits = x.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    return ((bits + 0xFFF + lsb) & ~0x1FFF).view(torch.float32)


def _mix_logits(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float, tf32: bool) -> torch.Tensor:
    """``μ = γ · fn·z`` with ``z`` the flattened trunk and ``γ = 1/sqrt(mean(z²) + eps)`` (docs/design/model.md,
    "Mix logits"): FP32 sum of squares and mean, ``+ eps`` in FP32, the reciprocal square root in FP64 rounded once
    to FP32; the GEMM in FP32 with ``fn`` rounded to TF32 when ``tf32`` (the BF16 trunk is exact in TF32).

    Args: trunk [n, m, H] bf16/fp32; fn [R, m·H] fp32. Returns: [n, R] fp32.
    """
    z = trunk.reshape(trunk.shape[0], -1).float()
    mean_square = (z * z).sum(dim=-1, keepdim=True) / z.shape[-1]
    gamma = torch.rsqrt((mean_square + rms_eps).double()).float()
    weight = round_to_tf32(fn) if tf32 else fn.float()
    return (z @ weight.t()) * gamma


def hc_mix_logits(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float, tf32: bool, out: torch.Tensor) -> None:
    """Mix logits ``μ`` (see ``_mix_logits``). Args: trunk [n, m, H]; fn [R, m·H] fp32; out [n, R] fp32, written."""
    out.copy_(_mix_logits(trunk, fn, rms_eps, tf32))


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    tf32: bool,
    read: torch.Tensor,
    write: torch.Tensor,
    comb: torch.Tensor,
) -> None:
    """Read-mix ``P``, write-mix ``Q`` and comb ``C`` of one sub-layer (docs/design/model.md, "Read, write and comb
    mixes"), FP32.

    ``P = sigmoid(μ_P·s₀ + b_P) + ε``, ``Q = 2·sigmoid(μ_Q·s₁ + b_Q)``, ``C`` = softmax over destinations of
    ``μ_C·s₂ + b_C`` plus ``ε``, then a column normalization and ``sinkhorn_iters − 1`` (row, column) normalization
    pairs, each dividing by the sum plus ``ε``.

    Args:
        trunk: [n, m, H] bf16/fp32.
        fn: [(2+m)·m, m·H] fp32.
        scale: [3] fp32.
        base: [(2+m)·m] fp32.
        rms_eps: added to the mean square of the flattened trunk.
        hc_eps: the mixes' ``ε``.
        sinkhorn_iters: ≥ 1.
        tf32: round ``fn`` to TF32 (exact mode).
        read: [n, m] fp32, written.
        write: [n, m] fp32, written.
        comb: [n, m, m] fp32, written.
    """
    m = trunk.shape[1]
    mu = _mix_logits(trunk, fn, rms_eps, tf32)
    read.copy_(torch.sigmoid(mu[:, :m] * scale[0] + base[:m]) + hc_eps)
    write.copy_(torch.sigmoid(mu[:, m : 2 * m] * scale[1] + base[m : 2 * m]) * HC_POST_MULT)
    logits = (mu[:, 2 * m :] * scale[2] + base[2 * m :]).view(-1, m, m)
    c = torch.softmax(logits, dim=-1) + hc_eps
    c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + hc_eps)
        c = c / (c.sum(dim=-2, keepdim=True) + hc_eps)
    comb.copy_(c)


def hc_read(trunk: torch.Tensor, read_mix: torch.Tensor, out: torch.Tensor) -> None:
    """``u = Σ_j P_j · X_j`` in FP32, products and sums each rounded, in stream order; one rounding to ``out``
    (docs/design/model.md, "Read and post").

    Args: trunk [n, m, H] bf16/fp32; read_mix [n, m] fp32; out [n, H] bf16/fp32, written.
    """
    x = trunk.float()
    acc = read_mix[:, 0:1] * x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + read_mix[:, j : j + 1] * x[:, j]
    out.copy_(acc)


def hc_post(
    output: torch.Tensor, trunk: torch.Tensor, write_mix: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> None:
    """``X'_o = Q_o · y + Σ_i C_{i,o} · X_i`` in FP32, products and sums each rounded, sources in order; one rounding
    to ``out`` (docs/design/model.md, "Read and post").

    Args:
        output: [n, H] bf16/fp32 sub-layer output ``y``.
        trunk: [n, m, H] bf16/fp32.
        write_mix: [n, m] fp32; comb: [n, m, m] fp32 (source ``i``, destination ``o``).
        out: [n, m, H] bf16/fp32, written.
    """
    x, y = trunk.float(), output.float()
    streams = []
    for o in range(x.shape[1]):
        acc = write_mix[:, o : o + 1] * y
        for i in range(x.shape[1]):
            acc = acc + comb[:, i, o : o + 1] * x[:, i]
        streams.append(acc)
    out.copy_(torch.stack(streams, dim=1))
