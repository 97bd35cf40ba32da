"""Argument checks shared by the public op wrappers; each failure names the argument, its value and what is allowed."""

from __future__ import annotations

import torch

__all__ = [
    "FLOAT_DTYPES",
    "OUT_DTYPES",
    "check_dtype",
    "check_ndim_at_least",
    "check_same_device",
    "check_shape",
    "check_tensor",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise TypeError naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(name: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    """Raise TypeError unless ``dtype`` is one of ``allowed``."""
    if dtype not in allowed:
        raise TypeError(f"{name} has dtype {dtype}; allowed: {', '.join(str(d) for d in allowed)}")


def check_ndim_at_least(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """Raise ValueError unless ``tensor`` has at least ``ndim`` dimensions."""
    if tensor.dim() < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimension(s), got shape {tuple(tensor.shape)}")


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise ValueError unless ``tensor`` has exactly ``shape``."""
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor lives on the same device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")
