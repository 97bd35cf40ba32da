"""Test session setup for deepinfer-engine under the accelerator target the session requests.

nox runs these tests with ``DEEPINFER_ACCELERATOR=nvidia`` (Triton kernels in Triton's interpreter on CPU tensors
when no GPU is present; nox sets ``TRITON_INTERPRET=1``) and with ``DEEPINFER_ACCELERATOR=ascend`` (the torch_npu
call sites run against the CPU test double of ``deepinfer_kernels.testing_npu_double`` when no NPU is present).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from deepinfer_kernels.testing_npu_double import NpuDouble, accelerator_test_session
from deepinfer_sampling.speculative import DecodeCostCurve


@pytest.fixture(scope="session", autouse=True)
def _accelerator_target() -> Iterator[None]:
    with accelerator_test_session():
        yield


@pytest.fixture(scope="session", autouse=True)
def _single_thread() -> Iterator[None]:
    """The tiny model's many small ops run faster on one torch thread on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def rank_processes_without_npu_double() -> Iterator[None]:
    """For modules that spawn rank processes: under the ascend target without an NPU this process runs with the
    torch_npu test double, which spawned ranks cannot inherit; they compute on CPU tensors (the reference path either
    way), so they run as "cpu"."""
    with pytest.MonkeyPatch.context() as patch:
        if isinstance(sys.modules.get("torch_npu"), NpuDouble):
            patch.setenv("DEEPINFER_ACCELERATOR", "cpu")
        yield


@pytest.fixture
def flat_decode_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Varlen engines plan on a flat decode cost curve instead of one measured at start-up, for tests about what
    drafting emits rather than about the planner: a curve measured on a busy host can make any number of drafts
    look worth verifying (once 8 drafts for 200 requests, CI) or none of them (once, CI)."""
    monkeypatch.setattr(
        "deepinfer_engine.engine.decode_cost_curve",
        lambda model, args, env, config: DecodeCostCurve((1, 1024), (1.0, 1.0)),
    )
