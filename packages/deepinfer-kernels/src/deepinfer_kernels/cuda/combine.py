"""Triton MoE combine: one launch for the widening, the ``k`` in-order FP32 adds and the rounding that the torch
version runs as ``k + 2`` kernels (docs/design/kernels.md, "moe_combine"). Each element sees the same FP32 additions
in the same order (``+0`` or the bias first), so the result equals the torch version bit for bit."""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.cuda._formats import to_output_dtype
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch

__all__ = ["moe_combine"]

_BLOCK = 1024


@triton.jit
def _combine_kernel(  # type: ignore[no-untyped-def]
    routed_ptr, bias_ptr, out_ptr, k, hidden, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    if HAS_BIAS:
        total = tl.load(bias_ptr + row * hidden + cols, mask=mask, other=0).to(tl.float32)
    else:
        total = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in range(0, k):
        total += tl.load(routed_ptr + (row * k + choice) * hidden + cols, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, to_output_dtype(total, out_ptr), mask=mask)


def moe_combine(routed: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """Triton ``deepinfer_kernels.moe_combine`` (contiguous tensors, shapes there)."""
    check_launchable(routed=routed, out=out, **({} if bias is None else {"bias": bias}))
    n, k, hidden = routed.shape
    block = min(_BLOCK, triton.next_power_of_2(hidden))
    _combine_kernel[(n, triton.cdiv(hidden, block))](
        routed,
        out if bias is None else bias,
        out,
        k,
        hidden,
        HAS_BIAS=bias is not None,
        BLOCK=block,
        **dependent_launch(out.device),
    )
