"""No import circle inside any package of the workspace.

Every module's import-time imports (its top level, class bodies, and `if`/`try`/`with` blocks there; not function
bodies and not `if TYPE_CHECKING:` blocks) form a graph between the modules of its package; the graph must have no
cycle. A package's `__init__` re-exports do not count: `__init__` modules are neither sources nor targets. The checker
is run once on a throwaway package with a circle to show that it bites.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_modules(src: Path, package: str) -> dict[str, Path]:
    """Module name → file of every non-`__init__` module of `package` under `src`."""
    modules = {}
    for path in sorted((src / package).rglob("*.py")):
        if path.name == "__init__.py":
            continue
        modules[".".join(path.relative_to(src).with_suffix("").parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _import_time_imports(node.body)
            found += _import_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                found += _import_time_imports(block)
        elif isinstance(node, ast.With | ast.ClassDef):
            found += _import_time_imports(node.body)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `node`, in `module`, imports."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parent = module.split(".")[: -node.level]
            base = ".".join([*parent, base] if base else parent)
        names = [f"{base}.{alias.name}" for alias in node.names] + [base]
    found = set()
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):  # the longest prefix that is a module of the package
            candidate = ".".join(parts[:end])
            if candidate in modules:
                found.add(candidate)
                break
    return found


def import_cycles(src: Path, package: str) -> list[list[str]]:
    """Every import circle among the modules of `package` (strongly connected components of more than one module,
    or a module importing itself), each sorted."""
    modules = _package_modules(src, package)
    graph = {
        name: {
            target
            for node in _import_time_imports(ast.parse(path.read_text()).body)
            for target in _targets(node, name, modules)
        }
        for name, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return cycles


def test_no_package_has_an_import_circle() -> None:
    found = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for package in sorted(p.name for p in src.iterdir() if (p / "__init__.py").exists()):
            cycles = import_cycles(src, package)
            if cycles:
                found[package] = cycles
    assert not found, f"import circles (module-level imports): {found}"


def test_the_checker_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\nA = 1\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nfrom ..c import C\n")
    (package / "c.py").write_text("import pkg.a\nC = 1\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n")
    (package / "e.py").write_text("def f():\n    from pkg.d import D\n")
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.c", "pkg.sub.b"]]
