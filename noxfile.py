"""Developer sessions for the DeepInfer workspace.

Every test session runs in its own uv-built environment that holds exactly one package, its declared
dependencies (resolved through the committed ``uv.lock``) and the root ``dev`` group (test tools only), so a
dependency a package forgot to declare fails there.

    nox -t test                       everything CI runs: per-package x target tests, workspace checks, lint,
                                      typecheck and the wheel build
    nox -s slow                       the tests marked slow (long end-to-end runs; not in CI's time)
    nox -s "tests(kernels, nvidia)"   one package under one target
    nox -s lint typecheck build gpu   the other sessions

Accelerator targets: ``nvidia`` runs Triton kernels under the Triton interpreter on CPU tensors when no CUDA
device is present; ``ascend`` runs the torch_npu call sites against the test double of
``deepinfer_kernels.testing_npu_double`` when no NPU is present (docs/hardware.md says what ran on real hardware).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

ROOT = Path(__file__).parent
PACKAGES = ["kernels", "model", "parallel", "sampling", "engine"]
TARGETS = ["nvidia", "ascend"]
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def _sync(session: nox.Session, *args: str) -> None:
    """Install the locked set of ``args`` (uv sync flags) into this session's virtualenv."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--no-default-groups",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        silent=True,
    )


def _pytest(session: nox.Session, paths: list[str], env: dict[str, str], marker: str) -> None:
    """Run pytest. Exit code 5 (no test selected, e.g. no gpu-marked test in a package) is not a failure."""
    session.run(
        "python",
        "-m",
        "pytest",
        *paths,
        "-m",
        marker,
        "-p",
        "no:cacheprovider",
        *session.posargs,
        env=env,
        success_codes=[0, 5],
    )


@nox.session(python=PYTHON, tags=["test"])
@nox.parametrize("target", TARGETS, ids=TARGETS)
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str, target: str) -> None:
    """One package's tests in an environment holding only that package, under one accelerator target."""
    extras = ["--extra", "nvidia"] if package == "kernels" and target == "nvidia" else []
    _sync(session, "--package", f"deepinfer-{package}", "--group", "dev", *extras)
    env = {"DEEPINFER_ACCELERATOR": target}
    if target == "nvidia":
        env["TRITON_INTERPRET"] = "1"
    _pytest(session, [f"packages/deepinfer-{package}/tests"], env, "not slow and not gpu")


# Not in the "test" tag: CI runs that tag in at most 90 minutes on 2 cores, and with these long runs it took 88.
@nox.session(python=PYTHON, tags=["slow"])
def slow(session: nox.Session) -> None:
    """Tests marked slow (long end-to-end runs), all packages, on the reference kernels."""
    _sync(session, "--all-packages", "--group", "dev")
    paths = [f"packages/deepinfer-{p}/tests" for p in PACKAGES]
    for path in paths:
        _pytest(session, [path], {"DEEPINFER_ACCELERATOR": "cpu"}, "slow and not gpu")


@nox.session(python=PYTHON, tags=["test"])
def workspace(session: nox.Session) -> None:
    """Workspace-wide checks: the lock is current and packages import only downward."""
    session.run("uv", "lock", "--check", external=True)
    _sync(session, "--all-packages", "--group", "dev")
    session.run("lint-imports", "--config", str(ROOT / "pyproject.toml"))
    _pytest(session, ["tests"], {}, "not slow")


@nox.session(python=PYTHON, tags=["test", "check"])
def lint(session: nox.Session) -> None:
    """ruff lint + format check over the whole tree."""
    _sync(session, "--only-group", "dev")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["test", "check"])
def typecheck(session: nox.Session) -> None:
    """mypy over every package's sources."""
    _sync(session, "--all-packages", "--group", "dev")
    session.run("mypy", *[f"packages/deepinfer-{p}/src" for p in PACKAGES])


@nox.session(python=PYTHON, tags=["test", "check"])
def build(session: nox.Session) -> None:
    """Build every wheel, install each alone into a fresh environment with its declared dependencies, import it."""
    dist = ROOT / "dist"
    session.run("uv", "build", "--all-packages", "--wheel", "-o", str(dist), "--clear", external=True)
    for package in PACKAGES:
        (wheel,) = dist.glob(f"deepinfer_{package}-*.whl")
        venv = Path(session.create_tmp()) / f"only-{package}"
        session.run("uv", "venv", "--quiet", "--clear", "--python", sys.executable, str(venv), external=True)
        python = str(venv / "bin" / "python")
        # Siblings are not on PyPI yet: they resolve from the freshly built wheels beside this one. Every version is
        # still 0.1.0, so uv's cache must not serve a wheel built from an older tree.
        refresh = [arg for p in PACKAGES for arg in ("--refresh-package", f"deepinfer-{p}")]
        session.run(
            "uv",
            "pip",
            "install",
            "--quiet",
            "--python",
            python,
            *refresh,
            "--find-links",
            str(dist),
            str(wheel),
            external=True,
        )
        # Resolve every public name: lazily exported names import their modules (and so their dependencies) too.
        check = (
            f"import deepinfer_{package} as p; names = [getattr(p, n) for n in p.__all__]; "
            "print(p.__name__, 'imports with', len(names), 'public names')"
        )
        session.run(python, "-c", check, external=True)


@nox.session(python=PYTHON, tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """Tests marked gpu, across all packages; skips with a message when no CUDA device is present."""
    _sync(session, "--all-packages", "--group", "dev")
    has_cuda = session.run("python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True)
    if has_cuda is None or has_cuda.strip() != "1":
        session.skip("no CUDA device present: gpu tests need an NVIDIA GPU")
    paths = [f"packages/deepinfer-{p}/tests" for p in PACKAGES]
    _pytest(session, paths, {"DEEPINFER_ACCELERATOR": "nvidia", **os.environ}, "gpu")
