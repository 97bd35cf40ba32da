"""Find ``wgmma`` A operands overwritten while the ``wgmma`` may still read them, in compiled sm_90 kernels.

A ``wgmma.mma_async`` whose A operand is in registers reads those registers asynchronously: writing them before a
``wgmma.wait_group`` has retired that instruction is undefined behaviour (PTX ISA, "wgmma.wait_group"). Triton's
pipeliner splits a register-operand dot into one ``wgmma`` per 16 (BF16) or 32 (FP8) columns of K and, with
``num_stages`` > 1, waits for all but the last ``n − 1`` of them at the end of the loop body; ptxas may then give the
next iteration's operand values the registers of the ``wgmma`` instructions still in flight (triton-lang/triton
issue 9433). On the H200 this produced sporadic garbage in whole output columns of a tile (docs/design/kernels.md,
"GEMM tiles and split-K").

The scan works on SASS (``cuobjdump -sass``): for every loop that contains ``HGMMA``/``QGMMA`` instructions it walks
the body twice (the second pass sees the writes of the next iteration), keeps the ``wgmma`` instructions in flight
(``WARPGROUP.DEPBAR.LE gsb0, n`` retires all but the last ``n`` issued) and reports every instruction that writes one
of their A registers. A report names the ``wgmma`` address, the writing instruction and the registers.

Usage:
    python benchmarks/wgmma_hazards.py                         # compile the GEMM variants of kernels_sass.py here
    python benchmarks/wgmma_hazards.py --cache ~/.triton/cache  # every cubin a run compiled (on the device)

Prints a table last and writes JSON (``--out``, default benchmarks/results/wgmma_hazards-sm90.json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

from bench_common import RESULTS, git_commit

_MMA = ("HGMMA", "QGMMA")
# Opcodes whose first operand is not a register they write.
_NO_DESTINATION = (
    "ST", "LDGSTS", "BAR", "BRA", "WARPGROUP", "DEPBAR", "RED", "ATOM", "EXIT", "RET", "WARPSYNC", "NOP",
    "LDGDEPBAR", "CALL", "MEMBAR", "FENCE", "SYNCS", "UTMA", "CCTL", "ERRBAR", "YIELD",
)  # fmt: skip
_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)((?:\.[A-Za-z0-9_]+)*)\s*([^;]*);")


def parse_sass(text: str) -> list[tuple[int, str, str, str]]:
    """(address, opcode, modifiers, operands) of every instruction of ``cuobjdump -sass`` output."""
    return [(int(m[1], 16), m[2], m[3], m[4].strip()) for m in map(_LINE.match, text.splitlines()) if m]


def _written(opcode: str, modifiers: str, operands: str) -> set[int]:
    # The general registers an instruction writes: its first operand, 1, 2 or 4 wide by the access size.
    if opcode.startswith(_NO_DESTINATION) or opcode.startswith(_MMA) or opcode.startswith("U"):
        return set()
    first = re.match(r"\s*R(\d+)\b", operands)
    if first is None:
        return set()
    width = 4 if ".128" in modifiers else 2 if ".64" in modifiers else 1
    return set(range(int(first[1]), int(first[1]) + width))


def _loops(instructions: list[tuple[int, str, str, str]]) -> Iterator[list[tuple[int, str, str, str]]]:
    index = {address: i for i, (address, *_) in enumerate(instructions)}
    for i, (address, opcode, _, operands) in enumerate(instructions):
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target[1], 16) < address and int(target[1], 16) in index:
            yield instructions[index[int(target[1], 16)] : i + 1]


def hazards(sass_text: str) -> list[dict[str, Any]]:
    """Writes to the register A operand of a ``wgmma`` that may still be in flight (module docstring)."""
    found = []
    for body in _loops(parse_sass(sass_text)):
        if not any(op.startswith(_MMA) for _, op, _, _ in body):
            continue
        in_flight: list[tuple[int, set[int]]] = []
        for second_pass in (False, True):
            for address, opcode, modifiers, operands in body:
                if opcode.startswith(_MMA):
                    a = re.match(r"R(\d+)$", operands.split(",")[1].strip())
                    in_flight.append((address, set(range(int(a[1]), int(a[1]) + 4)) if a else set()))
                elif opcode == "WARPGROUP" and "DEPBAR" in modifiers:
                    keep = int(re.search(r"0x([0-9a-f]+)", operands)[1], 16)  # type: ignore[index]
                    in_flight = in_flight[len(in_flight) - keep :] if keep else []
                elif second_pass:
                    written = _written(opcode, modifiers, operands)
                    for mma_address, registers in in_flight:
                        if written & registers:
                            found.append(
                                {
                                    "wgmma": hex(mma_address),
                                    "writer": hex(address),
                                    "opcode": opcode + modifiers,
                                    "registers": sorted(written & registers),
                                }
                            )
    return found


def _cache_kernels(cache: pathlib.Path) -> Iterator[tuple[str, bytes]]:
    for cubin in sorted(cache.rglob("*.cubin")):
        yield cubin.stem, cubin.read_bytes()


def _compiled_variants(stages: int) -> Iterator[tuple[str, bytes]]:
    import kernels_sass

    for v in kernels_sass.variants():
        yield v["name"], kernels_sass.compile_variant(v["kernel"], v["constexprs"], v["warps"], stages).asm["cubin"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=pathlib.Path, help="a Triton cache directory: scan every cubin in it")
    parser.add_argument("--stages", type=int, default=3, help="num_stages of the compiled variants (default 3)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "wgmma_hazards-sm90.json")
    args = parser.parse_args()
    import kernels_sass

    kernels = _cache_kernels(args.cache) if args.cache else _compiled_variants(args.stages)
    rows = []
    for name, cubin in kernels:
        text = kernels_sass.sass_text(cubin)
        mmas = sum(op.startswith(_MMA) for _, op, _, _ in parse_sass(text))
        rows.append({"kernel": name, "wgmma": mmas, "hazards": hazards(text)})
    meta = {"source": str(args.cache) if args.cache else f"kernels_sass variants, num_stages={args.stages}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**meta, "git_commit": git_commit(), "results": rows}, indent=1) + "\n")
    print(f"\n{'kernel':<50} {'wgmma':>6} {'A writes in flight':>19}")
    for r in rows:
        if r["wgmma"]:
            print(f"{r['kernel'][:50]:<50} {r['wgmma']:>6} {len(r['hazards']):>19}")
    print(f"{sum(not r['wgmma'] for r in rows)} kernels without wgmma; wrote {args.out}")


if __name__ == "__main__":
    main()
