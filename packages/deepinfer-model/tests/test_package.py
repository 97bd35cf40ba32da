"""The package's public surface: every exported name resolves, and importing the package stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import deepinfer_model


def test_every_public_name_resolves_to_its_module_object() -> None:
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer_model.loading.load import load_checkpoint_dir

    for name in deepinfer_model.__all__:
        assert getattr(deepinfer_model, name).__name__ == name
    assert deepinfer_model.DeepseekV41ForCausalLM is DeepseekV41ForCausalLM
    assert deepinfer_model.load_checkpoint_dir is load_checkpoint_dir
    assert set(deepinfer_model.__all__) <= set(dir(deepinfer_model))
    with pytest.raises(AttributeError, match="no attribute 'hf_to_internal'"):
        _ = deepinfer_model.hf_to_internal


def test_import_does_not_import_torch() -> None:
    code = "import sys, deepinfer_model; print(sorted(m for m in ('torch', 'deepinfer_kernels') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]"
