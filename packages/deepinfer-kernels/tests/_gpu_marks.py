"""The marks of a test that runs compiled Triton kernels on a CUDA device (skipped on CPU and under the interpreter):
``pytestmark = COMPILED_TRITON_ON_GPU`` for a whole module, ``@compiled_triton_on_gpu`` for one test."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from deepinfer_kernels.platform import triton_interpreter_enabled

COMPILED_TRITON_ON_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or triton_interpreter_enabled(),
        reason="needs a CUDA device with compiled (non-interpreted) Triton",
    ),
]

_Test = TypeVar("_Test", bound=Callable[..., object])


def compiled_triton_on_gpu(test: _Test) -> _Test:
    for mark in COMPILED_TRITON_ON_GPU:
        test = mark(test)
    return test
