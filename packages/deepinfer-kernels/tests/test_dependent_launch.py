"""Programmatic dependent launch (``deepinfer_kernels.dependent_launch``): every Triton and Gluon launch of the nvidia
backend passes the launch options and every kernel it launches waits for the kernels before it ahead of any memory
access (read from the source, so a new kernel cannot skip it): before the wait a kernel may only compute addresses
and ask L2 for a weight's bytes; the options are off outside the mode, on the CPU and in the interpreter; compiled for
sm_90 with the mode on, the kernel's wait comes before its first global load, a weight's prefetches before the wait."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from deepinfer_kernels.dependent_launch import dependent_launches

_CUDA = pathlib.Path(__file__).resolve().parents[1] / "src" / "deepinfer_kernels" / "cuda"


def _decorated(node: ast.FunctionDef, decorator: str) -> bool:
    # ``@triton.jit`` or ``@triton.jit(...)``
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == decorator for d in node.decorator_list)


def _modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(_CUDA.glob("*.py"))}


def _jit_functions(modules: dict[str, ast.Module], decorator: str) -> dict[str, ast.FunctionDef]:
    return {
        node.name: node
        for tree in modules.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and _decorated(node, decorator)
    }


def _launches(modules: dict[str, ast.Module]) -> list[tuple[str, ast.Call, set[str]]]:
    """(module, launch call, names of the kernels it may launch): ``kernel[grid](...)`` calls, where ``kernel`` is
    a jit function's name or a local variable bound to one (``kernel = a if c else b``)."""
    found = []
    for name, tree in modules.items():
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            bound: dict[str, set[str]] = {}
            for node in ast.walk(function):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
                    bound.setdefault(node.targets[0].id, set()).update(names)
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                    launched = node.func.value
                    if isinstance(launched, ast.Name):
                        found.append((name, node, bound.get(launched.id, {launched.id})))
    return found


# What a kernel may call before its wait: index arithmetic, and the L2 prefetch of a weight (an operand no kernel of a
# step writes), named by its parameter.
_PURE_BEFORE_WAIT = {"program_id", "arange", "minimum"}
_PREFETCHES = {"prefetch_rows"}
_WEIGHT_OPERANDS = {"fn_ptr"}


def _before_wait_problems(name: str, statements: list[ast.stmt], wait: str) -> list[str]:
    """What the statements before the kernel's wait do that they may not (empty: nothing, or no wait at all)."""
    waits = [i for i, s in enumerate(statements) if ast.unparse(s) == wait]
    if not waits:
        return [f"{name} does not call {wait} in its body"]
    problems = []
    for statement in statements[: waits[0]]:
        for call in (n for n in ast.walk(statement) if isinstance(n, ast.Call)):
            callee = call.func.attr if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)
            if callee in _PREFETCHES:
                operand = ast.unparse(call.args[0])
                if operand not in _WEIGHT_OPERANDS:
                    problems.append(f"{name} prefetches {operand} before its wait, which is not a weight")
            elif callee not in _PURE_BEFORE_WAIT:
                problems.append(f"{name} calls {callee} before its wait")
    return problems


def test_the_check_of_what_runs_before_the_wait_can_fail() -> None:
    kernel = ast.parse(
        "def k(x_ptr, w_ptr, PDL):\n"
        "    n = tl.program_id(0)\n"
        "    prefetch_rows(x_ptr, n, n, 1, 0, 8, PDL)\n"
        "    v = tl.load(w_ptr)\n"
        "    await_inputs(PDL)\n"
    ).body[0]
    assert isinstance(kernel, ast.FunctionDef)
    assert _before_wait_problems("k", kernel.body, "await_inputs(PDL)") == [
        "k prefetches x_ptr before its wait, which is not a weight",
        "k calls load before its wait",
    ]
    assert _before_wait_problems("k", kernel.body[:1], "await_inputs(PDL)") == [
        "k does not call await_inputs(PDL) in its body"
    ]


def test_every_triton_launch_is_a_dependent_launch_of_a_kernel_that_waits_first() -> None:
    """Triton kernels wait through ``_launch.await_inputs``, the Gluon GEMMs through its Gluon twin
    ``gluon_ring.await_gluon_inputs``."""
    modules = _modules()
    waits = {
        **dict.fromkeys(_jit_functions(modules, "triton.jit").items(), "await_inputs(PDL)"),
        **dict.fromkeys(_jit_functions(modules, "gluon.jit").items(), "await_gluon_inputs(PDL)"),
    }
    kernels_by_name = {name: (node, wait) for (name, node), wait in waits.items()}
    launched: set[str] = set()
    for module, call, names in _launches(modules):
        kernels = names & set(kernels_by_name)
        assert kernels, f"{module}:{call.lineno} launches {sorted(names)}, none of them a jit function"
        options = [k.value for k in call.keywords if k.arg is None]
        assert any(ast.unparse(o).startswith("dependent_launch(") for o in options), (
            f"{module}:{call.lineno}: a launch of {sorted(kernels)} without **dependent_launch(device)"
        )
        launched |= kernels
    assert len(launched) >= 40  # the scan found the launches
    assert {"_fp8_wgmma_kernel", "_grouped_wgmma_kernel"} <= launched
    prefetching = set()
    for name in sorted(launched):
        kernel, wait = kernels_by_name[name]
        assert kernel.args.args[-1].arg == "PDL", f"{name} has no PDL constexpr"
        body = kernel.body
        statements = body[1:] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        assert not _before_wait_problems(name, statements, wait)
        if ast.unparse(statements[0]) != wait:
            prefetching.add(name)
    assert prefetching == {"_token_mixes_kernel"}


def test_launch_options_are_off_off_the_gpu() -> None:
    pytest.importorskip("triton")
    from deepinfer_kernels.cuda._launch import dependent_launch

    off = {"PDL": False, "launch_pdl": False}
    assert dependent_launch(torch.device("cpu")) == off
    with dependent_launches():
        assert dependent_launch(torch.device("cpu")) == off  # CPU tensors: the interpreter, no launch attribute


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_kernels.cuda.paging import _paged_rows_kernel as kernel
types = {n: "*i64" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
signature = {**types, "BLOCK": "constexpr", "PDL": "constexpr"}
for pdl in (True, False):
    source = ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK": 128, "PDL": pdl})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(pdl, ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"), ptx.find("ld.global"))
"""

# The same for a Gluon GEMM (the first global access being a load or a cp.async copy).
_COMPILE_GLUON = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from deepinfer_kernels.cuda.fp8_wgmma import _fp8_wgmma_kernel as kernel, fp8_wgmma_constexprs
constexprs = {"SPLIT_GRID": True, **fp8_wgmma_constexprs(8, 256, 4, 3)}
types = {n: "*u8" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
pointers = {"out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}
signature = {**types, **dict.fromkeys([*constexprs, "PDL"], "constexpr"), **pointers}
# A launch's 16-byte alignment facts (pointers, strides, N, K and the K chunk; not M), which the copies need.
aligned = [n for n in kernel.arg_names if signature[n] != "constexpr" and n != "M"]
attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
for pdl in (True, False):
    source = GluonASTSource(fn=kernel, signature=signature, constexprs={**constexprs, "PDL": pdl}, attrs=attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    first = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
    print(pdl, ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents"), first)
"""

# The per-token mHC mixes kernel, which asks L2 for its fn tile before the wait: the prefetch's first position, then the
# wait's and the first load's.
_COMPILE_PREFETCH = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer_kernels.cuda.hyper_connection import _token_mixes_kernel as kernel
shape = {"CHUNK": 512, "SPLITS": 40, "BLOCK_R": 32, "TF32": True, "TOKENS": 1, "M": 4, "BLOCK_MM": 4, "POST_MULT": 2.0}
types = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
floats = dict.fromkeys(["rms_eps", "hc_eps"], "fp32")
signature = {**types, **floats, "z_ptr": "*bf16", "counter_ptr": "*i32", **dict.fromkeys([*shape, "PDL"], "constexpr")}
for pdl in (True, False):
    source = ASTSource(fn=kernel, signature=signature, constexprs={**shape, "PDL": pdl})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    print(pdl, ptx.find(PREFETCH), ptx.find("griddepcontrol.wait"), ptx.find("ld.global"))
"""


def _compiled_positions(script: str) -> dict[str, list[int]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = f"PREFETCH = 'prefetch.global.L2'\n{script}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.split()[0]: [int(v) for v in line.split()[1:]] for line in result.stdout.splitlines()}


def test_compiled_kernel_waits_before_its_first_load() -> None:
    """Offline compile for sm_90 (no GPU needed; a process of its own, as this session's kernels run in the
    interpreter): with PDL the PTX waits, then lets the next kernel launch, then loads; without, neither."""
    pytest.importorskip("triton.backends.nvidia")
    rows = _compiled_positions(_COMPILE)
    wait, launch, load = rows["True"]
    assert 0 <= wait < launch < load
    assert rows["False"][:2] == [-1, -1] and rows["False"][2] >= 0


def test_compiled_gluon_gemm_waits_before_its_first_copy() -> None:
    """The same for the dense FP8 Gluon GEMM. Its kernels are written against Triton 3.6's Gluon (the H200's,
    docs/hardware.md; later releases renamed parts of it), so other versions skip."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernels compile with Triton 3.6, this is {triton.__version__}")
    rows = _compiled_positions(_COMPILE_GLUON)
    wait, launch, first_copy = rows["True"]
    assert 0 <= wait < launch < first_copy
    assert rows["False"][:2] == [-1, -1] and rows["False"][2] >= 0


def test_compiled_mixes_kernel_prefetches_its_weight_before_the_wait() -> None:
    """The per-token mixes kernel under a dependent launch: L2 prefetches, then the wait, then the first load; without
    the mode no prefetch (nothing would run ahead of the loads)."""
    pytest.importorskip("triton.backends.nvidia")
    rows = _compiled_positions(_COMPILE_PREFETCH)
    prefetch, wait, load = rows["True"]
    assert 0 <= prefetch < wait < load
    assert rows["False"][:2] == [-1, -1] and rows["False"][2] >= 0
