"""Static instruction counts of the quantized GEMM kernels for sm_90, on any machine (no GPU needed).

Each kernel variant is compiled by Triton for an H100/H200 target (``GPUTarget("cuda", 90, 32)``, with the
16-divisibility hints a real launch gets for its pointers, strides, N, K and the K chunk), disassembled with the
``cuobjdump`` Triton ships, and its innermost loop (the largest body closed by a backward branch, with
``num_stages=1`` so that software pipelining does not copy it) is counted: SASS instructions per thread per K step,
and per weight element a thread handles in that step. A weight-streaming GEMM is ALU-bound once it needs more than
about 4 instructions per FP4 element (132 SMs x 4 schedulers x 1.98 GHz issue 33 T thread instructions/s against the
8.4 T elements/s that 4.2 TB/s of FP4 carry), so this ratio says how far decoding and operand movement keep a kernel
from the memory roofline before anything is timed (docs/design/kernels.md, "GEMM tiles and split-K").

Usage:
    python benchmarks/kernels_sass.py [--out benchmarks/results/kernels_sass-sm90.json]

Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import tempfile
from typing import Any

import triton
from bench_common import RESULTS, git_commit
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from deepinfer_kernels.cuda.fp8_wgmma import _fp8_wgmma_kernel, fp8_wgmma_constexprs
from deepinfer_kernels.cuda.gemm import _fp8_block_kernel, mxfp4_kernel
from deepinfer_kernels.cuda.gemm_tiles import DECODINGS, decodings
from deepinfer_kernels.cuda.gemv import fp8_gemv_kernel, mxfp4_gemv_kernel
from deepinfer_kernels.cuda.grouped_bf16_wgmma import _grouped_bf16_kernel, grouped_bf16_constexprs
from deepinfer_kernels.cuda.grouped_wgmma import _grouped_wgmma_kernel, gluon_constexprs
from deepinfer_kernels.cuda.swap_bf16 import _swap_bf16_kernel

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {"out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "xs_ptr": "*bf16"}
INDEX_POINTERS = (
    "order_ptr",
    "block_expert_ptr",
    "block_start_ptr",
    "block_end_ptr",
    "tile_expert_ptr",
    "tile_start_ptr",
    "tile_end_ptr",
)
UNALIGNED = ("M", "num_experts")  # runtime values with no divisibility a launch could rely on
CLASSES = {
    "global loads": ("LDG", "LDGSTS"),
    "shared memory": ("LDS", "STS", "LDSM"),
    "barriers": ("BAR",),
    "MMA": ("HMMA", "HGMMA", "QGMMA"),
    "conversions": ("F2FP", "F2F", "HADD2", "I2F", "F2I"),
    "FP32 math": ("FMUL", "FFMA", "FADD"),
    "integer / bit": ("IMAD", "LOP3", "PRMT", "SHF", "IADD3", "LEA", "ISETP", "SEL"),
}


def variants() -> list[dict[str, Any]]:
    """(name, kernel, constexprs, warps, weight elements per thread per K step) of each counted variant: the
    decode-size tiles of the scaled preset's GEMMs (16 × 64 MMA tiles, 2-row FMA tiles with 32 weight rows, the
    quantizing FMA GEMV at one row on 32 × 128, 128 × 128 and 64 × 256 tiles, and the same on codes) and the
    grouped GEMM's 16 × 128 tiles, its 8 × 128 swap_fp8 tile, the Gluon kernel's 8 × 64 tiles (gluon_fp8), the dense
    FP8 Gluon kernel's 8 × 64 and 64 × 64 tiles, the BF16 kernel's tiles (swap_bf16, 8 warps): the grouped
    128 × 128 prefill tile, the dense FP8 128 × 128 and 256 × 128 ones, and the grouped BF16 ring kernel's 128 × 128
    tile (gluon_bf16)."""
    mma = {"SPLIT_GRID": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOT_BF16": True, "NATIVE_FP8": True}
    gemv = {"SPLIT_GRID": True, "ROWS": 2, "BLOCK_N": 32, "BLOCK_K": 128, "NATIVE_FP8": True, "E4M3_BIAS": 0}
    out: list[dict[str, Any]] = []
    for decoding in DECODINGS:
        if decoding in ("gluon_fp8", "dequant_bf16", "swap_bf16", "gluon_bf16"):
            continue  # kernels of their own (cuda.grouped_wgmma, cuda.swap_bf16, cuda.grouped_bf16_wgmma); cuBLAS
        grouped = {**mma, "GROUPED": True, "DECODING": decoding, "SCAN": False}
        out.append({"name": f"mxfp4 grouped MMA {decoding}", "kernel": mxfp4_kernel, "constexprs": grouped})
        if decoding in decodings("fp8_block_gemm"):
            fp8 = {**mma, "DECODING": decoding}
            out.append({"name": f"fp8 MMA {decoding}", "kernel": _fp8_block_kernel, "constexprs": fp8})
    # The grouped GEMM's measured decode tile (16 x 128) and its tuning candidates with a 64-column K step.
    wide = {**mma, "GROUPED": True, "SCAN": False, "BLOCK_N": 128}
    wide_variants = (("scaled_bf16", 128), ("scaled_bf16", 64), ("swap_ab", 64), ("group_fp8", 64), ("swap_fp8", 64))
    for decoding, block_k in wide_variants:
        constexprs = {**wide, "DECODING": decoding, "BLOCK_K": block_k}
        name = f"mxfp4 grouped 16x128 k{block_k} {decoding}"
        out.append({"name": name, "kernel": mxfp4_kernel, "constexprs": constexprs})
    eight = {**wide, "DECODING": "swap_fp8", "BLOCK_K": 64, "BLOCK_M": 8}
    out.append({"name": "mxfp4 grouped 8x128 k64 swap_fp8", "kernel": mxfp4_kernel, "constexprs": eight})
    out.append(
        {"name": "mxfp4 grouped FMA (2 rows)", "kernel": mxfp4_gemv_kernel, "constexprs": {**gemv, "GROUPED": True}}
    )
    out.append({"name": "fp8 FMA (2 rows)", "kernel": fp8_gemv_kernel, "constexprs": gemv})
    # The same reading the BF16 activation and quantizing it in the loop (no quantizer launch before it), at two rows
    # and, for the one-row tiles of MEASURED and the wider tuning candidates, at one; at one row also on codes (a
    # fused norm's FP8 copy).
    one_row = (("2 rows", 2, 32, 128), ("1 row", 1, 32, 128), ("1 row", 1, 128, 128), ("1 row", 1, 64, 256))
    for label, rows, block_n, block_k in one_row:
        tile = "" if block_n == 32 else f" {block_n}x{block_k}"
        constexprs = {**gemv, "ROWS": rows, "BLOCK_N": block_n, "BLOCK_K": block_k}
        out.append(
            {
                "name": f"fp8 FMA ({label}) quantizing{tile}",
                "kernel": fp8_gemv_kernel,
                "constexprs": {**constexprs, "QUANTIZE": True},
                "pointers": {"q_ptr": "*bf16"},
            }
        )
        if rows == 1:
            out.append({"name": f"fp8 FMA ({label}) codes{tile}", "kernel": fp8_gemv_kernel, "constexprs": constexprs})
    for block_k in (128, 256):
        # The Gluon kernel with a ring of three slots.
        out.append(
            {
                "name": f"mxfp4 grouped 8x64 k{block_k} gluon_fp8",
                "kernel": _grouped_wgmma_kernel,
                "constexprs": gluon_constexprs(scan=False, block_m=8, block_k=block_k, num_warps=4, stages=3),
            }
        )
    # The dense FP8 Gluon kernel (both operands from its ring): the one-row tile, whole and split-K, and the 256-row
    # one.
    for block_m, block_k, stages, split in ((8, 256, 3, False), (8, 256, 3, True), (64, 256, 2, False)):
        out.append(
            {
                "name": f"fp8 {block_m}x64 k{block_k} gluon_fp8{' split' if split else ''}",
                "kernel": _fp8_wgmma_kernel,
                "constexprs": {
                    "SPLIT_GRID": split,
                    **fp8_wgmma_constexprs(block_m, block_k, num_warps=4, stages=stages),
                },
            }
        )
    # The BF16 kernel's tiles on even shapes (weight loads as vectors, no K masks): the grouped prefill tile, and the
    # dense FP8 GEMM's at 128 and 256 rows.
    bf16 = {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "DOT_BF16": True,
        "NATIVE": True,
        "EVEN": True,
        "CHUNK_SUMS": False,
    }
    for is_grouped, block_m in ((True, 128), (False, 128), (False, 256)):
        name = f"{'mxfp4 grouped' if is_grouped else 'fp8'} {block_m}x128 k64 swap_bf16"
        constexprs = {**bf16, "GROUPED": is_grouped, "SPLIT_GRID": False, "BLOCK_M": block_m}
        out.append({"name": name, "kernel": _swap_bf16_kernel, "constexprs": constexprs, "warps": 8})
    # The grouped GEMM's BF16 ring kernel (gluon_bf16) on its 128 × 128 prefill tile, four slots.
    out.append(
        {
            "name": "mxfp4 grouped 128x128 k128 gluon_bf16",
            "kernel": _grouped_bf16_kernel,
            "constexprs": grouped_bf16_constexprs(128, 128, num_warps=8, stages=4),
            "warps": 8,
        }
    )
    for v in out:
        c = v["constexprs"]
        v.setdefault("warps", 4)
        v["weight_elements_per_thread"] = c["BLOCK_N"] * c["BLOCK_K"] // (32 * v["warps"])
    return out


# Launch-time constexprs the counted variants leave at their defaults: an ordinary launch, activation row = row,
# codes from the quantizer.
LAUNCH_DEFAULTS = {"PDL": False, "REPEATS": 1, "QUANTIZE": False}


def compile_variant(
    kernel: Any, constexprs: dict[str, Any], warps: int, stages: int = 1, pointers: dict[str, str] | None = None
) -> Any:
    names = kernel.arg_names
    pointer_types = {**POINTER_TYPES, **(pointers or {})}
    constexprs = {**{k: v for k, v in LAUNCH_DEFAULTS.items() if k in names}, **constexprs}
    signature: dict[str, str] = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*i64" if name in INDEX_POINTERS else "*u8")
        else:
            signature[name] = "i32"
    aligned = [n for n in names if n not in constexprs and n not in UNALIGNED]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source_type = GluonASTSource if kernel.is_gluon() else ASTSource
    source = source_type(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": stages})


def sass_text(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, with the cuobjdump Triton ships."""
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def sass(cubin: bytes) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction."""
    text = sass_text(cubin)
    pattern = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(?:\.[A-Z0-9_.]+)?\s*(.*)")
    return [(int(m[1], 16), m[2], m[3]) for m in map(pattern.match, text.splitlines()) if m]


def innermost_loop(instructions: list[tuple[int, str, str]]) -> collections.Counter[str]:
    """Opcode counts of the largest loop body (a backward ``BRA`` and the instructions from its target)."""
    index = {address: i for i, (address, _, _) in enumerate(instructions)}
    best = (0, -1)
    for i, (address, opcode, operands) in enumerate(instructions):
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target[1], 16) < address and int(target[1], 16) in index:
            start = index[int(target[1], 16)]
            if i - start > best[1] - best[0]:
                best = (start, i)
    return collections.Counter(opcode for _, opcode, _ in instructions[best[0] : best[1] + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "kernels_sass-sm90.json")
    args = parser.parse_args()
    rows = []
    for v in variants():
        kernel = compile_variant(v["kernel"], v["constexprs"], v["warps"], pointers=v.get("pointers"))
        ops = innermost_loop(sass(kernel.asm["cubin"]))
        total = sum(ops.values())
        classes = {label: sum(ops[o] for o in opcodes) for label, opcodes in CLASSES.items()}
        rows.append(
            {
                "name": v["name"],
                "constexprs": {
                    name: value if isinstance(value, int | str) else str(value)
                    for name, value in v["constexprs"].items()
                },
                "warps": v["warps"],
                "loop_instructions_per_thread": total,
                "weight_elements_per_thread": v["weight_elements_per_thread"],
                "instructions_per_weight_element": total / v["weight_elements_per_thread"],
                "classes": classes,
                "opcodes": dict(ops.most_common()),
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target": "cuda sm_90", "triton": triton.__version__, "git_commit": git_commit()}
    args.out.write_text(json.dumps({**meta, "results": rows}, indent=1) + "\n")
    labels = list(CLASSES)
    print(f"\nK-loop SASS per thread and K step (Triton {triton.__version__}, sm_90, num_stages=1)")
    print(f"{'kernel':<40} {'instr':>6} {'elem':>5} {'/elem':>6} " + " ".join(f"{lab[:9]:>9}" for lab in labels))
    for r in rows:
        print(
            f"{r['name']:<40} {r['loop_instructions_per_thread']:>6} {r['weight_elements_per_thread']:>5} "
            f"{r['instructions_per_weight_element']:>6.1f} " + " ".join(f"{r['classes'][lab]:>9}" for lab in labels)
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
