"""The package's public surface: every exported name resolves, and importing the package stays cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def _package_imports(root: Path, package: str) -> dict[str, set[str]]:
    """Module → the package modules it imports (``TYPE_CHECKING`` imports included: a circle is a circle)."""
    modules = {
        ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            else:
                continue
            targets.update(target for target in found if target in modules and target != name)
        graph[name] = targets
    return graph


def test_no_import_circle_among_the_model_modules() -> None:
    """No module of the package takes part in an import circle, annotation-only imports included."""
    root = Path(deepinfer_model.__file__).parent
    graph = _package_imports(root, "deepinfer_model")
    # A package's __init__ re-exporting its submodules is not a circle: drop edges into a module's own parents.
    graph = {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
