"""Test setup for deepinfer-kernels, valid under any DEEPINFER_ACCELERATOR the session sets.

- No CUDA device: ``TRITON_INTERPRET=1`` is set (unless the session set it) before any Triton kernel is
  defined, so the nvidia kernels run on CPU tensors in Triton's interpreter.
- ``DEEPINFER_ACCELERATOR=ascend`` without a real torch_npu: the CPU double is installed as ``torch_npu`` for
  the whole session, so the public ops dispatch to the Ascend implementations.
- Backend parity tests ask for ``triton_device`` / ``npu_double`` and so run in every session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Triton picks interpreter or compiler when a kernel is decorated, i.e. when deepinfer_kernels.cuda is first
    # imported; that happens lazily, after this line.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer_kernels import _registry
from deepinfer_kernels.platform import Accelerator, current_accelerator, triton_interpreter_enabled
from deepinfer_kernels.testing_npu_double import (
    NpuDouble,
    accelerator_test_session,
    install_npu_double,
    real_torch_npu_available,
)


@pytest.fixture(scope="session", autouse=True)
def _session_accelerator() -> Iterator[None]:
    _registry.reset()
    with accelerator_test_session():
        yield
    _registry.reset()


@pytest.fixture
def triton_device() -> str:
    """Device for Triton kernel tests: "cpu" under the interpreter, "cuda" with a GPU; skips otherwise."""
    pytest.importorskip("triton", reason="Triton is not installed (the 'nvidia' extra)")
    _registry.reset()
    if triton_interpreter_enabled():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("Triton kernels need a CUDA device or TRITON_INTERPRET=1")


@pytest.fixture
def npu_double() -> Iterator[NpuDouble]:
    """The torch_npu CPU double, installed for one test (skips when a real torch_npu is importable)."""
    if real_torch_npu_available():
        pytest.skip("a real torch_npu is installed; Ascend parity runs on the NPU (marker 'ascend')")
    with install_npu_double() as double:
        yield double


@pytest.fixture
def fresh_platform() -> Iterator[None]:
    """Forget cached platform and registry decisions before and after a test that edits the environment."""
    _registry.reset()
    yield
    _registry.reset()


@pytest.fixture(params=["nvidia", "ascend"])
def fast_backend(request: pytest.FixtureRequest) -> tuple[_registry.Backend, str]:
    """Each fast backend with the device its tensors live on: Triton (interpreter on CPU, or CUDA) and the
    Ascend implementations through the CPU torch_npu double."""
    if request.param == "nvidia":
        return _registry.Backend.NVIDIA, request.getfixturevalue("triton_device")
    request.getfixturevalue("npu_double")
    return _registry.Backend.ASCEND, "cpu"


@pytest.fixture
def op_device() -> str:
    """Device for calling the public ops under the session's accelerator: CUDA when compiled Triton runs them."""
    accelerator = current_accelerator()
    if accelerator is Accelerator.NVIDIA and not triton_interpreter_enabled():
        return "cuda"
    return "cpu"
