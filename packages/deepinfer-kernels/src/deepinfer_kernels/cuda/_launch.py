"""Device checks for the Triton launchers: CUDA tensors, or any tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import torch

from deepinfer_kernels.platform import triton_interpreter_enabled

__all__ = ["check_launchable"]


def check_launchable(**tensors: torch.Tensor) -> None:
    """Raise ValueError if a tensor cannot be used by a compiled Triton kernel.

    Under Triton's interpreter (``TRITON_INTERPRET=1``) every device is accepted (CPU tensors are the point);
    otherwise every tensor must be a CUDA tensor.
    """
    if triton_interpreter_enabled():
        return
    for name, tensor in tensors.items():
        if tensor.device.type != "cuda":
            raise ValueError(
                f"{name} is on {tensor.device}, but the nvidia backend runs Triton kernels on CUDA tensors; move the "
                "inputs to a CUDA device (or set TRITON_INTERPRET=1 to run the kernels on CPU tensors for testing)"
            )
