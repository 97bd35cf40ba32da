"""Accelerator resolution: env values, clear errors, caching, and side-effect-free import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from deepinfer_kernels.platform import (
    Accelerator,
    clear_accelerator_cache,
    current_accelerator,
    triton_interpreter_enabled,
)
from deepinfer_kernels.testing_npu_double import install_npu_double

pytestmark = pytest.mark.usefixtures("fresh_platform")


def test_bogus_value_names_variable_value_and_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "bogus")
    with pytest.raises(ValueError) as info:
        current_accelerator()
    message = str(info.value)
    assert "DEEPINFER_ACCELERATOR" in message
    assert "'bogus'" in message
    for allowed in ("'nvidia'", "'ascend'", "'cpu'"):
        assert allowed in message


@pytest.mark.parametrize("raw", ["cpu", "CPU", " cpu "])
def test_cpu_values(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", raw)
    assert current_accelerator() is Accelerator.CPU


def test_resolution_is_cached_until_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert current_accelerator() is Accelerator.CPU
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "bogus")
    assert current_accelerator() is Accelerator.CPU
    clear_accelerator_cache()
    with pytest.raises(ValueError, match="bogus"):
        current_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_nvidia_without_gpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed (the 'nvidia' extra)")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError) as info:
        current_accelerator()
    assert "TRITON_INTERPRET=1" in str(info.value)
    assert "DEEPINFER_ACCELERATOR=cpu" in str(info.value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    clear_accelerator_cache()
    assert triton_interpreter_enabled()
    assert current_accelerator() is Accelerator.NVIDIA


def test_nvidia_without_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "nvidia")
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(RuntimeError, match="needs Triton, which is not importable"):
        current_accelerator()


def test_ascend_without_torch_npu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    # A None entry in sys.modules makes ``import torch_npu`` raise ImportError.
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError) as info:
        current_accelerator()
    assert "torch_npu is not importable" in str(info.value)
    assert "ascend" in str(info.value)


def test_ascend_with_torch_npu_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with install_npu_double():
        assert current_accelerator() is Accelerator.ASCEND


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto-detection picks nvidia on a GPU machine")
def test_auto_detect_without_devices_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEEPINFER_ACCELERATOR", raising=False)
    with install_npu_double():  # importable torch_npu but no NPU → still cpu
        assert current_accelerator() is Accelerator.CPU


def test_import_reads_no_environment_and_loads_no_backend() -> None:
    script = textwrap.dedent(
        """
        import sys
        import deepinfer_kernels
        assert "triton" not in sys.modules, "importing deepinfer_kernels imported triton"
        assert "torch_npu" not in sys.modules, "importing deepinfer_kernels imported torch_npu"
        assert "deepinfer_kernels.cuda" not in sys.modules
        assert "deepinfer_kernels.testing_npu_double" not in sys.modules
        print("ok")
        """
    )
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "bogus"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
