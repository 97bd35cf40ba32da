"""Vendor attention kernels for ``sparse_attention`` (docs/design/kernels.md, "FlashMLA sparse prefill"): inside
``vendor_attention()`` the nvidia backend hands prompt-sized calls to FlashMLA's SM90 sparse prefill kernel when the
``flash_mla`` module (the ``sgl-flash-mla`` wheel) is importable and the call fits it.

The mode is a ``ModeFlag`` (a context variable), like ``dependent_launches``; the engine enters it with
``EngineArgs.flashmla``. Off by default, so a caller gets the package's own kernels unless it asks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from deepinfer_kernels.mode_flag import ModeFlag

__all__ = ["vendor_attention", "vendor_attention_requested"]

_VENDOR_ATTENTION = ModeFlag("vendor_attention")


def vendor_attention_requested() -> bool:
    """Whether the calling code runs inside ``vendor_attention()`` (the launcher also checks the library and shapes)."""
    return _VENDOR_ATTENTION.requested()


def vendor_attention(enabled: bool = True) -> AbstractContextManager[None]:
    """Let ``sparse_attention`` use FlashMLA's sparse prefill kernel in the body where it fits (a no-op when
    ``enabled`` is false)."""
    return _VENDOR_ATTENTION.scope(enabled)
