"""benchmarks/wgmma_hazards.py: writes to a wgmma's register A operand while it may be in flight, on SASS text."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def wgmma_hazards(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import wgmma_hazards

    return wgmma_hazards


def _loop(last_wait: int) -> str:
    # Two wgmma a K step on A operands R88..R91 and R92..R95; the body's next iteration rewrites R92 first.
    body = [
        "LDS.U16 R92, [R9+0xc020]",
        "F2FP.F16.E4M3.UNPACK_B R88, R88",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0",
        f"WARPGROUP.DEPBAR.LE gsb0, 0x{min(last_wait, 1):x}",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR12], R24, gsb0",
        f"WARPGROUP.DEPBAR.LE gsb0, 0x{last_wait:x}",
        "LDGSTS.E.64 [R5+0xc000], desc[UR12][R92.64], P6",
        "BRA 0x100",
    ]
    return "\n".join(f"        /*{0x100 + 16 * i:04x}*/                   {line} ;" for i, line in enumerate(body))


def test_a_write_before_the_last_wgmma_retires_is_reported(wgmma_hazards):
    found = wgmma_hazards.hazards(_loop(last_wait=1))
    assert [(h["wgmma"], h["writer"], h["registers"]) for h in found] == [("0x160", "0x100", [92])]


def test_waiting_for_every_wgmma_leaves_nothing_in_flight(wgmma_hazards):
    assert wgmma_hazards.hazards(_loop(last_wait=0)) == []


def test_store_addresses_are_reads(wgmma_hazards):
    assert wgmma_hazards.parse_sass(_loop(0))[8][1:] == ("LDGSTS", ".E.64", "[R5+0xc000], desc[UR12][R92.64], P6")
    assert wgmma_hazards.hazards(_loop(0).replace("LDS.U16 R92", "LDS.U16 R40")) == []
