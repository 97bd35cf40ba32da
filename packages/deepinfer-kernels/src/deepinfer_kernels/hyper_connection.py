"""Public mHC ops (docs/design/model.md, "Hyper-connections (mHC)"): validation and allocation, then the resolved
backend. A decode step calls each of them twice per block; the nvidia backend runs the mixes (mix GEMM, sigmoids,
softmax and every Sinkhorn iteration) in two kernels and the read and the post in one kernel each, where the PyTorch
formulation launches about 150, 9 and 40 kernels (docs/design/kernels.md, "mHC ops").

Numerics: ``reference.hyper_connection`` defines them. The read and the post are the same FP32 operations in the same
order (bitwise equal); the mixes differ from the reference in the FP32 summation order of the mix GEMM and in the
last bits of ``exp``.
"""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor

__all__ = ["hc_mix_logits", "hc_mixes", "hc_post", "hc_read"]

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)


def _check_trunk(trunk: torch.Tensor) -> tuple[int, int, int]:
    check_tensor("trunk", trunk)
    check_dtype("trunk", trunk.dtype, _ACTIVATION_DTYPES)
    if trunk.dim() != 3 or trunk.shape[1] == 0 or trunk.shape[2] == 0:
        raise ValueError(f"trunk must be [n, m, H] with m, H >= 1, got shape {tuple(trunk.shape)}")
    n, m, hidden = trunk.shape
    return n, m, hidden


def _check_fp32(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    check_tensor(name, tensor)
    check_dtype(name, tensor.dtype, (torch.float32,))
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _check_eps(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


def hc_mix_logits(trunk: torch.Tensor, fn: torch.Tensor, rms_eps: float, tf32: bool) -> torch.Tensor:
    """``μ = γ · fn·z`` for the flattened trunk ``z`` (docs/design/model.md, "Mix logits").

    Args:
        trunk: [n, m, H] bf16/fp32.
        fn: [R, m·H] fp32, same device.
        rms_eps: finite, >= 0.
        tf32: round ``fn`` to TF32 (exact mode) instead of a plain FP32 GEMM.

    Returns:
        [n, R] fp32.
    """
    n, m, hidden = _check_trunk(trunk)
    check_tensor("fn", fn)
    if fn.dim() != 2 or fn.shape[1] != m * hidden:
        raise ValueError(f"fn must be [R, {m * hidden}] for trunk {tuple(trunk.shape)}, got {tuple(fn.shape)}")
    _check_fp32("fn", fn, tuple(fn.shape))
    _check_eps("rms_eps", rms_eps)
    check_same_device(trunk=trunk, fn=fn)
    out = torch.empty((n, fn.shape[0]), dtype=torch.float32, device=trunk.device)
    if n:
        _registry.resolve("hc_mix_logits", trunk.device.type)(trunk.contiguous(), fn.contiguous(), rms_eps, tf32, out)
    return out


def hc_mixes(
    trunk: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    tf32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read-mix, write-mix and Sinkhorn comb of one sub-layer (docs/design/model.md, "Read, write and comb mixes").

    Args:
        trunk: [n, m, H] bf16/fp32.
        fn: [(2+m)·m, m·H] fp32 (norm weight folded in).
        scale: [3] fp32.
        base: [(2+m)·m] fp32.
        rms_eps: ``rms_norm_eps`` (finite, >= 0).
        hc_eps: ``hc_eps`` (finite, >= 0).
        sinkhorn_iters: ``hc_sinkhorn_iters`` (>= 1).
        tf32: round ``fn`` to TF32 (exact mode) instead of a plain FP32 GEMM.

    Returns:
        ``(P, Q, C)``: [n, m], [n, m], [n, m, m] fp32 (``C[t, i, o]``: source ``i`` to destination ``o``).

    Raises:
        TypeError: a tensor argument is not a tensor or has an unsupported dtype.
        ValueError: shapes disagree, an eps is negative or not finite, ``sinkhorn_iters < 1``, or devices differ.
    """
    n, m, hidden = _check_trunk(trunk)
    rows = (2 + m) * m
    _check_fp32("fn", fn, (rows, m * hidden))
    _check_fp32("scale", scale, (3,))
    _check_fp32("base", base, (rows,))
    _check_eps("rms_eps", rms_eps)
    _check_eps("hc_eps", hc_eps)
    if not isinstance(sinkhorn_iters, int) or sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be an int >= 1, got {sinkhorn_iters!r}")
    check_same_device(trunk=trunk, fn=fn, scale=scale, base=base)
    read = torch.empty((n, m), dtype=torch.float32, device=trunk.device)
    write = torch.empty((n, m), dtype=torch.float32, device=trunk.device)
    comb = torch.empty((n, m, m), dtype=torch.float32, device=trunk.device)
    if n:
        _registry.resolve("hc_mixes", trunk.device.type)(
            trunk.contiguous(),
            fn.contiguous(),
            scale.contiguous(),
            base.contiguous(),
            rms_eps,
            hc_eps,
            sinkhorn_iters,
            tf32,
            read,
            write,
            comb,
        )
    return read, write, comb


def hc_read(trunk: torch.Tensor, read_mix: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``u = Σ_j P_j · X_j`` in FP32, accumulated in stream order, rounded once (docs/design/model.md, "Read and post").

    Args:
        trunk: [n, m, H] bf16/fp32.
        read_mix: [n, m] fp32, same device.
        out_dtype: bf16 or fp32.

    Returns:
        [n, H] ``out_dtype``.
    """
    n, m, hidden = _check_trunk(trunk)
    _check_fp32("read_mix", read_mix, (n, m))
    check_dtype("out_dtype", out_dtype, _ACTIVATION_DTYPES)
    check_same_device(trunk=trunk, read_mix=read_mix)
    out = torch.empty((n, hidden), dtype=out_dtype, device=trunk.device)
    if n:
        _registry.resolve("hc_read", trunk.device.type)(trunk.contiguous(), read_mix.contiguous(), out)
    return out


def hc_post(
    output: torch.Tensor, trunk: torch.Tensor, write_mix: torch.Tensor, comb: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``X'_o = Q_o · y + Σ_i C_{i,o} · X_i`` in FP32, sources in order, rounded once
    (docs/design/model.md, "Read and post").

    Args:
        output: [n, H] bf16/fp32 sub-layer output ``y``.
        trunk: [n, m, H] bf16/fp32 the mixes were computed from.
        write_mix: [n, m] fp32.
        comb: [n, m, m] fp32.
        out_dtype: bf16 or fp32.

    Returns:
        [n, m, H] ``out_dtype``.
    """
    n, m, hidden = _check_trunk(trunk)
    check_tensor("output", output)
    check_dtype("output", output.dtype, _ACTIVATION_DTYPES)
    if tuple(output.shape) != (n, hidden):
        raise ValueError(f"output must have shape {(n, hidden)} for trunk {tuple(trunk.shape)}, got {output.shape}")
    _check_fp32("write_mix", write_mix, (n, m))
    _check_fp32("comb", comb, (n, m, m))
    check_dtype("out_dtype", out_dtype, _ACTIVATION_DTYPES)
    check_same_device(output=output, trunk=trunk, write_mix=write_mix, comb=comb)
    out = torch.empty((n, m, hidden), dtype=out_dtype, device=trunk.device)
    if n:
        _registry.resolve("hc_post", trunk.device.type)(
            output.contiguous(), trunk.contiguous(), write_mix.contiguous(), comb.contiguous(), out
        )
    return out
