"""Device comparison that treats "cuda" and "cuda:<current index>" as the same device."""

from __future__ import annotations

import torch


def same_device(a: torch.device, b: torch.device) -> bool:
    """True when `a` and `b` name the same device; an index left out means "any index of that type"."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
