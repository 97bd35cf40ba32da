"""Every package's tests can be collected in one pytest run, as a GPU machine runs them: the test directories are not
Python packages, so pytest imports each module by its file name, and two modules of one name in different packages
stop the run at collection ("import file mismatch")."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_two_packages_have_a_test_module_of_the_same_name() -> None:
    modules = [path for path in ROOT.glob("packages/*/tests/*.py") if path.name != "conftest.py"]
    assert modules, f"no test modules under {ROOT / 'packages'}"
    names = collections.Counter(path.name for path in modules)
    assert {name: count for name, count in names.items() if count > 1} == {}
