"""Sparse attention over key sources read straight from their cache pools (docs/design/kernels.md,
"sparse_attention")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_kernels import _registry
from deepinfer_kernels._checks import check_dtype, check_same_device, check_tensor
from deepinfer_kernels.cache_layout import KeySource, width_of
from deepinfer_kernels.kv_cache import INDEX_DTYPES, flat_pool
from deepinfer_kernels.vendor_attention import unwidened_attention

__all__ = ["KeySource", "sparse_attention"]


def _checked_source(index: int, source: KeySource, num_tokens: int, width: int) -> KeySource:
    if not isinstance(source, KeySource):
        raise TypeError(f"sources[{index}] must be a KeySource, got {type(source).__name__}")
    pool = flat_pool(f"sources[{index}].pool", source.pool)
    rows = check_tensor(f"sources[{index}].rows", source.rows)
    check_dtype(f"sources[{index}].rows", rows.dtype, INDEX_DTYPES)
    if rows.dim() != 2 or rows.shape[0] != num_tokens:
        raise ValueError(f"sources[{index}].rows must be [T={num_tokens}, N], got {tuple(rows.shape)}")
    if width_of(source.fmt, pool.shape[1]) != width:
        raise ValueError(
            f"sources[{index}] rows of {pool.shape[1]} bytes hold {width_of(source.fmt, pool.shape[1])} "
            f"{source.fmt.name} elements; q has head dim {width}"
        )
    return KeySource(pool, rows.contiguous(), source.fmt)


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    round_probs_bf16: bool,
    *,
    widen: bool = True,
) -> torch.Tensor:
    """One softmax per (query, head) over the valid keys of all sources plus a per-head sink logit (K = V).

    ``out[t, h] = Σ_j p_j · k_j / (Σ_j exp(s_j − m) + exp(sink[h] − m))`` with ``s_j = scale · q[t, h] · k_j``,
    ``p_j = exp(s_j − m)`` (rounded to BF16 when ``round_probs_bf16``; the denominator keeps FP32), ``m`` the
    maximum of the logits and the sink, and ``k_j`` the decoded rows of every source. FP32 logits, statistics and
    accumulation. A query with no valid key gets zeros.

    Args:
        q: [T, H, D] bf16/fp32.
        sources: key sources; each pool holds rows of width D, each ``rows`` is [T, N_i] (−1 = no key).
        sink: [H] fp32 sink logits.
        scale: softmax scale (``D^−0.5``).
        round_probs_bf16: round the unnormalized probabilities to BF16 before the value product (exact mode).
        widen: always return FP32. False: where a vendor kernel runs the call (FlashMLA inside ``vendor_attention()``
            on the nvidia backend), its BF16 output as it left the kernel, the values of the FP32 result without the
            pass that widens them (a consumer that reads BF16 and FP32 alike, ``rotated_fp8_block_grouped_gemm``).

    Returns:
        [T, H, D] fp32, or bf16 where ``widen`` is false and a vendor kernel ran.
    """
    check_tensor("q", q)
    check_tensor("sink", sink)
    check_dtype("q", q.dtype, (torch.bfloat16, torch.float32))
    check_dtype("sink", sink.dtype, (torch.float32,))
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    num_tokens, num_heads, width = q.shape
    if tuple(sink.shape) != (num_heads,):
        raise ValueError(f"sink must be [H={num_heads}], got {tuple(sink.shape)}")
    checked = [_checked_source(i, source, num_tokens, width) for i, source in enumerate(sources)]
    check_same_device(q=q, sink=sink, **{f"pool{i}": s.pool for i, s in enumerate(checked)})
    check_same_device(q=q, **{f"rows{i}": s.rows for i, s in enumerate(checked)})
    if num_tokens and not widen:
        served = unwidened_attention(q.contiguous(), checked, sink.contiguous(), float(scale), round_probs_bf16)
        if served is not None:
            return served
    out = torch.empty((num_tokens, num_heads, width), dtype=torch.float32, device=q.device)
    if num_tokens:
        impl = _registry.resolve("sparse_attention", q.device.type)
        impl(q.contiguous(), checked, sink.contiguous(), float(scale), bool(round_probs_bf16), out)
    return out
