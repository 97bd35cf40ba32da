"""Vendor attention kernels for ``sparse_attention`` (docs/design/kernels.md, "FlashMLA sparse prefill"): inside
``vendor_attention()`` the nvidia backend hands prompt-sized calls to FlashMLA's SM90 sparse prefill kernel when the
``flash_mla`` module (the ``sgl-flash-mla`` wheel) is importable and the call fits it.

The mode is a ``ModeFlag`` (a context variable), like ``dependent_launches``; the engine enters it with
``EngineArgs.flashmla``. Off by default, so a caller gets the package's own kernels unless it asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from deepinfer_kernels.cache_layout import KeySource
from deepinfer_kernels.mode_flag import ModeFlag
from deepinfer_kernels.platform import Accelerator, current_accelerator

__all__ = [
    "unwidened_attention",
    "vendor_attention",
    "vendor_attention_requested",
    "vendor_attention_unavailable",
]

_VENDOR_ATTENTION = ModeFlag("vendor_attention")


def vendor_attention_requested() -> bool:
    """Whether the calling code runs inside ``vendor_attention()`` (the launcher also checks the library and shapes)."""
    return _VENDOR_ATTENTION.requested()


def vendor_attention(enabled: bool = True) -> AbstractContextManager[None]:
    """Let ``sparse_attention`` use FlashMLA's sparse prefill kernel in the body where it fits (a no-op when
    ``enabled`` is false)."""
    return _VENDOR_ATTENTION.scope(enabled)


def unwidened_attention(
    q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float, round_probs_bf16: bool
) -> torch.Tensor | None:
    """``sparse_attention``'s output as the kernel that runs the call leaves it, where the nvidia backend serves it
    (FlashMLA's BF16, values the FP32 result would hold exactly, where it takes the call; else FP32); None elsewhere."""
    if q.device.type != "cuda" or current_accelerator() is not Accelerator.NVIDIA:
        return None
    from deepinfer_kernels.cuda import attention

    return attention.unwidened_attention(q, sources, sink, scale, round_probs_bf16)


def vendor_attention_unavailable(device: torch.device, heads: int, head_dim: int) -> str | None:
    """Why ``vendor_attention()`` would change nothing for attention of ``heads`` query heads of ``head_dim`` on
    ``device``, or None when FlashMLA can take its prompt-sized calls (the start-up line of the engine says which)."""
    if device.type != "cuda" or current_accelerator() is not Accelerator.NVIDIA:
        return f"no vendor attention kernel for {device.type} devices on the {current_accelerator().value} backend"
    from deepinfer_kernels.cuda import flashmla

    if heads not in flashmla.HEADS or head_dim != flashmla.WIDTH:
        allowed = " or ".join(str(h) for h in flashmla.HEADS)
        return f"its kernel takes {allowed} heads of {flashmla.WIDTH}; this model has {heads} of {head_dim}"
    return flashmla.unavailable_reason(device.index)
