"""Registry: explicit registration, one resolution per op, fallback logged once, clear errors."""

from __future__ import annotations

import logging

import pytest

from deepinfer_kernels._registry import Backend, OpRegistry
from deepinfer_kernels.platform import Accelerator
from deepinfer_kernels.reference import quant as reference_quant
from deepinfer_kernels.testing_npu_double import NpuDouble


def _registry_for(accelerator: Accelerator) -> OpRegistry:
    return OpRegistry(accelerator=lambda: accelerator)


def test_cpu_resolves_reference() -> None:
    registry = _registry_for(Accelerator.CPU)
    assert registry.resolve("quantize_mxfp4") is reference_quant.quantize_mxfp4


def test_unknown_op_is_a_clear_error() -> None:
    registry = _registry_for(Accelerator.CPU)
    with pytest.raises(ValueError, match=r"unknown op 'no_such_op'.*rms_norm"):
        registry.resolve("no_such_op")
    with pytest.raises(ValueError, match="unknown op 'no_such_op'"):
        registry.implementation("no_such_op", Backend.REFERENCE)


def test_unknown_backend_is_a_clear_error() -> None:
    registry = _registry_for(Accelerator.CPU)
    with pytest.raises(TypeError, match="backend must be a Backend"):
        registry.implementation("rms_norm", "nvidia")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="backend must be a Backend"):
        registry.register("rms_norm", "gpu", reference_quant.quantize_mxfp4)  # type: ignore[arg-type]


def test_registration_rules() -> None:
    registry = OpRegistry(accelerator=lambda: Accelerator.CPU)
    registry.register("toy", Backend.REFERENCE, abs)
    with pytest.raises(ValueError, match="already has a 'reference' implementation"):
        registry.register("toy", Backend.REFERENCE, abs)
    with pytest.raises(ValueError, match="has no reference implementation"):
        registry.register("other", Backend.NVIDIA, abs)
    with pytest.raises(TypeError, match="not callable"):
        registry.register("third", Backend.REFERENCE, 3)  # type: ignore[arg-type]


def test_missing_fast_implementation_is_an_error_without_fallback(npu_double: NpuDouble) -> None:
    registry = _registry_for(Accelerator.ASCEND)
    with pytest.raises(ValueError, match="'quantize_mxfp4' has no 'ascend' implementation"):
        registry.implementation("quantize_mxfp4", Backend.ASCEND)


def test_fallback_logs_once_per_op(npu_double: NpuDouble, caplog: pytest.LogCaptureFixture) -> None:
    registry = _registry_for(Accelerator.ASCEND)
    with caplog.at_level(logging.INFO, logger="deepinfer_kernels"):
        first = registry.resolve("quantize_mxfp4")
        second = registry.resolve("quantize_mxfp4")
        registry.resolve("ue8m0_to_float")
        registry.resolve("ue8m0_to_float")
    assert first is second is reference_quant.quantize_mxfp4
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer_kernels"]
    assert sum("'quantize_mxfp4'" in m for m in messages) == 1
    assert sum("'ue8m0_to_float'" in m for m in messages) == 1
    assert all("using the reference" in m for m in messages)


def test_fast_backend_is_chosen_when_registered(npu_double: NpuDouble, caplog: pytest.LogCaptureFixture) -> None:
    from deepinfer_kernels.ascend import norm as ascend_norm

    registry = _registry_for(Accelerator.ASCEND)
    with caplog.at_level(logging.INFO, logger="deepinfer_kernels"):
        assert registry.resolve("rms_norm") is ascend_norm.rms_norm
    assert not caplog.records


def test_resolution_happens_once_per_op() -> None:
    calls: list[int] = []

    def accelerator() -> Accelerator:
        calls.append(1)
        return Accelerator.CPU

    registry = OpRegistry(accelerator=accelerator)
    for _ in range(3):
        registry.resolve("rms_norm")
    assert len(calls) == 1
    registry.clear_resolution_cache()
    registry.resolve("rms_norm")
    assert len(calls) == 2


def test_cpu_tensors_use_the_reference_on_a_fast_backend(npu_double: NpuDouble) -> None:
    from deepinfer_kernels.ascend import norm as ascend_norm
    from deepinfer_kernels.reference import norm as reference_norm

    registry = _registry_for(Accelerator.ASCEND)
    assert registry.resolve("rms_norm", "cpu") is reference_norm.rms_norm
    assert registry.resolve("rms_norm", "npu") is ascend_norm.rms_norm
    assert registry.resolve("rms_norm") is ascend_norm.rms_norm


def test_nvidia_backend_serves_cuda_tensors_only(triton_device: str) -> None:
    from deepinfer_kernels.cuda import norm as cuda_norm
    from deepinfer_kernels.reference import norm as reference_norm

    registry = _registry_for(Accelerator.NVIDIA)
    assert registry.resolve("rms_norm", "cuda") is cuda_norm.rms_norm
    assert registry.resolve("rms_norm", "cpu") is reference_norm.rms_norm


def test_public_op_on_cpu_tensors_never_reaches_the_npu(npu_double: NpuDouble) -> None:
    import torch

    from deepinfer_kernels import _registry, rms_norm
    from deepinfer_kernels.platform import clear_accelerator_cache

    _registry.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_ACCELERATOR", "ascend")
        clear_accelerator_cache()
        rms_norm(torch.ones(2, 32), torch.ones(32), 1e-6)
    _registry.reset()
    assert npu_double.calls == []


def test_first_resolution_from_many_threads_registers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    registry = _registry_for(Accelerator.CPU)
    register = registry.register

    def slow_register(*args: object) -> None:
        time.sleep(0.002)  # widen the window in which an unguarded second loader would register again
        register(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(registry, "register", slow_register)
    with ThreadPoolExecutor(max_workers=8) as pool:
        impls = list(pool.map(lambda _: registry.resolve("quantize_mxfp4"), range(32)))
    assert all(impl is reference_quant.quantize_mxfp4 for impl in impls)
