"""Rotary position embedding: the public rotation op and the RoPE/YaRN table builders
(docs/design/model.md, "RoPE and YaRN").

The table builders are plain FP32 PyTorch functions run once at model build time (CPU by default):

- :func:`rope_inverse_frequencies` — base inverse frequencies ``f_i = 1 / base^(2i/r)``.
- :func:`yarn_inverse_frequencies` — YaRN-blended inverse frequencies (magnitude scale is exactly 1).
- :func:`rope_cos_sin` — cos/sin tables from FP32 angles ``fp32(t · f_i)``.

:func:`rope_table` builds the rotations of a step's positions on their device (one launch on a GPU): the rows of
those tables at the positions, with the negated sines of the inverse rotation beside them.

:func:`apply_rope` rotates interleaved pairs (docs/design/model.md, "RoPE and YaRN"), :func:`apply_rope_` in place. The
inverse ("conjugate") rotation is ``apply_rope(x, cos, -sin)``, which is bit-identical to the conjugate rotation
formula.
"""

from __future__ import annotations

import math

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_ndim_at_least, check_same_device, check_tensor

__all__ = [
    "apply_rope",
    "apply_rope_",
    "rope_cos_sin",
    "rope_inverse_frequencies",
    "rope_table",
    "yarn_inverse_frequencies",
]

_ROPE_DTYPES = (torch.bfloat16, torch.float32)


def _check_rope_dim(rope_dim: int) -> None:
    if not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even int, got {rope_dim!r}")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _base_powers(rope_dim: int, base: float) -> torch.Tensor:
    """``base^(2i/r)`` in FP32 (exponent formed in FP32, power in FP32); [rope_dim // 2]."""
    exponent = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    return torch.pow(torch.tensor(base, dtype=torch.float32), exponent)


def rope_inverse_frequencies(rope_dim: int, base: float) -> torch.Tensor:
    """Base inverse frequencies ``f_i = 1 / base^(2i/r)`` (docs/design/model.md, "RoPE and YaRN").

    Args:
        rope_dim: rotary dimension ``r`` (positive, even).
        base: RoPE base (``rope_theta`` or ``compress_rope_theta``).

    Returns:
        [rope_dim // 2] fp32 CPU tensor.
    """
    _check_rope_dim(rope_dim)
    _check_positive("base", base)
    return 1.0 / _base_powers(rope_dim, base)


def yarn_inverse_frequencies(
    rope_dim: int,
    base: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
) -> torch.Tensor:
    """YaRN inverse frequencies (docs/design/model.md, "RoPE and YaRN").

    ``corr(R) = r·ln(L0 / (2π·R)) / (2·ln base)`` in float64; ``lo = max(floor(corr(β_fast)), 0)``,
    ``hi = min(ceil(corr(β_slow)), r − 1)`` (``hi += 0.001`` when equal); per pair ``i`` in FP32:
    ``ramp = clamp((i − lo)/(hi − lo), 0, 1)``, ``mask = 1 − ramp``,
    ``f_i = (1/(φ·b_i))·(1 − mask) + (1/b_i)·mask`` with ``b_i = base^(2i/r)``.

    Args:
        rope_dim: rotary dimension ``r`` (positive, even).
        base: RoPE base.
        factor: YaRN scaling factor ``φ``.
        original_max_position_embeddings: ``L0``.
        beta_fast: ``β_f``.
        beta_slow: ``β_s``.

    Returns:
        [rope_dim // 2] fp32 CPU tensor.
    """
    _check_rope_dim(rope_dim)
    for name, value in (
        ("base", base),
        ("factor", factor),
        ("original_max_position_embeddings", original_max_position_embeddings),
        ("beta_fast", beta_fast),
        ("beta_slow", beta_slow),
    ):
        _check_positive(name, value)

    def correction(rotations: float) -> float:
        return rope_dim * math.log(original_max_position_embeddings / (2 * math.pi * rotations)) / (2 * math.log(base))

    low = float(max(math.floor(correction(beta_fast)), 0))
    high = float(min(math.ceil(correction(beta_slow)), rope_dim - 1))
    if low == high:
        high += 0.001
    powers = _base_powers(rope_dim, base)
    index = torch.arange(rope_dim // 2, dtype=torch.float32)
    ramp = torch.clamp((index - low) / (high - low), 0.0, 1.0)
    mask = 1.0 - ramp
    return (1.0 / (factor * powers)) * (1.0 - mask) + (1.0 / powers) * mask


def rope_cos_sin(inverse_frequencies: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin tables for positions ``0 … num_positions − 1`` (docs/design/model.md, "RoPE and YaRN").

    Angles are FP32 products ``fp32(t · f_i)``; cos and sin are evaluated in FP32 through the complex
    polar form.

    Args:
        inverse_frequencies: [rope_dim // 2] fp32.
        num_positions: number of table rows ``P`` (a capacity, ≥ 0).

    Returns:
        ``(cos, sin)``, each [num_positions, rope_dim // 2] fp32 on ``inverse_frequencies``'s device.
    """
    check_tensor("inverse_frequencies", inverse_frequencies)
    check_dtype("inverse_frequencies", inverse_frequencies.dtype, (torch.float32,))
    if inverse_frequencies.dim() != 1:
        raise ValueError(f"inverse_frequencies must be 1-D, got shape {tuple(inverse_frequencies.shape)}")
    if not isinstance(num_positions, int) or num_positions < 0:
        raise ValueError(f"num_positions must be a non-negative int, got {num_positions!r}")
    positions = torch.arange(num_positions, dtype=torch.float32, device=inverse_frequencies.device)
    angles = torch.outer(positions, inverse_frequencies)
    rotation = torch.polar(torch.ones_like(angles), angles)
    return rotation.real.contiguous(), rotation.imag.contiguous()


def rope_table(positions: torch.Tensor, inverse_frequencies: torch.Tensor) -> torch.Tensor:
    """The rotations of ``positions`` (docs/design/model.md, "RoPE and YaRN"): planes ``cos``, ``sin`` and ``−sin`` of
    the FP32 angles ``fp32(t · f_i)``, the values of :func:`rope_cos_sin`'s rows at those positions. Planes 0 and 1 are
    the rotation :func:`apply_rope` takes, planes 0 and 2 the inverse one.

    Args:
        positions: [n] int32 or int64 token positions (each converted to FP32 before the product, as a table's row
            index is).
        inverse_frequencies: [rope_dim // 2] fp32 on ``positions``'s device.

    Returns:
        [3, n, rope_dim // 2] fp32, contiguous.

    Raises:
        TypeError: a tensor argument is missing or has an unsupported dtype.
        ValueError: a tensor is not 1-D, or the devices differ.
    """
    check_tensor("positions", positions)
    check_tensor("inverse_frequencies", inverse_frequencies)
    check_dtype("positions", positions.dtype, (torch.int32, torch.int64))
    check_dtype("inverse_frequencies", inverse_frequencies.dtype, (torch.float32,))
    for name, tensor in (("positions", positions), ("inverse_frequencies", inverse_frequencies)):
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    check_same_device(positions=positions, inverse_frequencies=inverse_frequencies)
    out = torch.empty(
        (3, positions.shape[0], inverse_frequencies.shape[0]), dtype=torch.float32, device=positions.device
    )
    if out.numel():
        _registry.resolve("rope_table", out.device.type)(positions.contiguous(), inverse_frequencies.contiguous(), out)
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dimension of ``x`` (docs/design/model.md, "RoPE and YaRN").

    For pair ``i``: ``x'[2i] = fma(x[2i], c, −(x[2i+1]·s))``, ``x'[2i+1] = fma(x[2i], s, x[2i+1]·c)`` in FP32,
    rounded once to ``x``'s dtype. The caller slices the rope part of each vector and gathers the table rows of
    each token's position.

    Args:
        x: [num_tokens, rope_dim] or [num_tokens, ..., rope_dim] bf16 or fp32 (any strides); rope_dim even.
        cos: [num_tokens, rope_dim // 2] fp32, same device as ``x``.
        sin: [num_tokens, rope_dim // 2] fp32, same device as ``x``.

    Returns:
        Rotated tensor with ``x``'s shape and dtype, contiguous.

    Raises:
        TypeError: a tensor argument is missing or has an unsupported dtype.
        ValueError: shapes disagree or devices differ.
    """
    _check_rope_args(x, cos, sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        x3 = x.reshape(x.shape[0], -1, x.shape[-1]).contiguous()
        _rotate(x3, cos, sin, out.view(x3.shape))
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rope` in place: ``x`` (a strided slice too, e.g. the rope tail of wider vectors) is overwritten
    with its rotation, the same bits, and returned. With a unit stride in the last dimension and the middle dimensions
    viewable as one, the backend reads and writes ``x`` where it lies (one launch on a GPU, no copies); otherwise the
    rotation is copied back."""
    _check_rope_args(x, cos, sin)
    if not x.numel():
        return x
    try:
        x3 = x.view(x.shape[0], -1, x.shape[-1])
    except RuntimeError:  # the middle dimensions are not one strided dimension
        x3 = None
    if x3 is not None and x3.stride(-1) == 1:
        _rotate(x3, cos, sin, x3)
    else:
        x.copy_(apply_rope(x, cos, sin))
    return x


def _check_rope_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_tensor("x", x)
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    check_dtype("x", x.dtype, _ROPE_DTYPES)
    check_dtype("cos", cos.dtype, (torch.float32,))
    check_dtype("sin", sin.dtype, (torch.float32,))
    check_ndim_at_least("x", x, 2)
    rope_dim = x.shape[-1]
    if rope_dim == 0 or rope_dim % 2:
        raise ValueError(f"the last dimension of x must be even and non-zero, got shape {tuple(x.shape)}")
    expected = (x.shape[0], rope_dim // 2)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} for x {tuple(x.shape)}, got {tuple(table.shape)}")
    check_same_device(x=x, cos=cos, sin=sin)


def _rotate(x3: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out3: torch.Tensor) -> None:
    # Backends take [tokens, heads, rope_dim] with a unit last stride; out3 may be x3 (each element is read before
    # it is written).
    _registry.resolve("apply_rope", x3.device.type)(x3, cos.contiguous(), sin.contiguous(), out3)
