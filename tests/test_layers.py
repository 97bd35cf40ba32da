"""The dependency direction between the five packages is enforced by import-linter.

The contracts live in the root ``pyproject.toml``. These tests run the real ``lint-imports`` command: once on the
workspace (it must pass) and once on a throwaway tree with an upward import (it must fail), so the check is known to
bite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["deepinfer_kernels", "deepinfer_parallel", "deepinfer_model", "deepinfer_sampling", "deepinfer_engine"]


def _lint_imports(config: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--config", str(config), "--no-cache"], capture_output=True, text=True, env=env, check=False
    )


def _write_tree(root: Path, imports: dict[str, list[str]]) -> None:
    for package in PACKAGES:
        pkg = root / package
        pkg.mkdir(parents=True)
        lines = [f"import {target}" for target in imports.get(package, [])]
        (pkg / "__init__.py").write_text("\n".join(lines) + "\n")


def _copy_contracts(dest: Path) -> Path:
    """The root pyproject's import-linter section, alone, so the throwaway tree is checked by the same rules."""
    section = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[tool.importlinter]", f"root_packages = {section['root_packages']!r}".replace("'", '"')]
    for contract in section["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        for key, value in contract.items():
            lines.append(f"{key} = {value!r}".replace("'", '"'))
    config = dest / "importlinter.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def test_workspace_imports_only_point_down() -> None:
    result = _lint_imports(ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_downward_tree_passes(tmp_path: Path) -> None:
    _write_tree(
        tmp_path / "src",
        {
            "deepinfer_engine": ["deepinfer_model", "deepinfer_sampling", "deepinfer_parallel", "deepinfer_kernels"],
            "deepinfer_model": ["deepinfer_parallel", "deepinfer_kernels"],
            "deepinfer_parallel": ["deepinfer_kernels"],
            "deepinfer_sampling": ["deepinfer_kernels"],
        },
    )
    result = _lint_imports(_copy_contracts(tmp_path), tmp_path / "src")
    assert result.returncode == 0, result.stdout + result.stderr


def test_upward_import_fails(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"deepinfer_kernels": ["deepinfer_model"]})
    result = _lint_imports(_copy_contracts(tmp_path), tmp_path / "src")
    assert result.returncode != 0
    assert "deepinfer_kernels -> deepinfer_model" in result.stdout, result.stdout


def test_model_and_sampling_never_import_each_other(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"deepinfer_sampling": ["deepinfer_model"]})
    result = _lint_imports(_copy_contracts(tmp_path), tmp_path / "src")
    assert result.returncode != 0
    assert "deepinfer_sampling -> deepinfer_model" in result.stdout, result.stdout


def test_sampling_never_imports_parallel(tmp_path: Path) -> None:
    _write_tree(tmp_path / "src", {"deepinfer_sampling": ["deepinfer_parallel"]})
    result = _lint_imports(_copy_contracts(tmp_path), tmp_path / "src")
    assert result.returncode != 0
    assert "deepinfer_sampling -> deepinfer_parallel" in result.stdout, result.stdout


def test_contract_text_is_in_sync_with_this_test() -> None:
    section = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert sorted(section["root_packages"]) == sorted(PACKAGES), textwrap.shorten(str(section), 200)
