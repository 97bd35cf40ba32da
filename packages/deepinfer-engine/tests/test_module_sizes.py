"""The engine stays in small modules with one job: none over 400 lines, and the `LLM` facade under 200."""

from __future__ import annotations

from pathlib import Path

import deepinfer_engine

SOURCE = Path(deepinfer_engine.__file__).parent


def test_no_engine_module_is_over_400_lines() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in SOURCE.glob("*.py")}
    assert sizes, f"no modules found under {SOURCE}"
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_the_llm_facade_is_thin() -> None:
    assert len((SOURCE / "llm.py").read_text().splitlines()) < 200
