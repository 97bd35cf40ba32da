"""The grouped MXFP4 GEMM's BF16 ring kernel (``gluon_bf16``, cuda.grouped_bf16_wgmma) on a Hopper GPU, against the
reference (FP64 sums on the same device) and the Triton ``swap_bf16`` tile of the same products and sums.

Tolerance: the FP32 accumulation bound of _gemm_support (one bf16 ulp of the reference plus the FP32 summation
term; the products are exact, so no FP8-MMA term).
"""

from __future__ import annotations

import pytest
import torch
from _gemm_support import assert_gemm_close
from _gpu_marks import COMPILED_TRITON_ON_GPU
from test_gpu_gemm import _activation, _bytes, _generator, _grouped_magnitude, _ids, _mxfp4, _run

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig, gluon_bf16_tile, swap_bf16_tile
from deepinfer_kernels.cuda.grouped_gemm import _gluon_tile

pytestmark = COMPILED_TRITON_ON_GPU

_K = 4096
# One and two warpgroups, 64 and 128 rows, rings of three and four slots, K steps of 128 and 256 columns.
_TILES = [
    gluon_bf16_tile(128, 8, 128, 4),
    gluon_bf16_tile(64, 8, 128, 3),
    gluon_bf16_tile(128, 4, 128, 4),
    gluon_bf16_tile(32, 4, 256, 3),
]


def _grouped(cfg: BlockConfig, *inputs: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    ids, packed = inputs[1], inputs[2]
    out = torch.zeros(ids.numel(), packed.shape[1], dtype=torch.bfloat16, device="cuda")
    implementation("mxfp4_grouped_gemm", Backend.NVIDIA)(*inputs, out, config=cfg, repeats=repeats)
    return out


def test_the_gluon_kernel_runs_where_it_can() -> None:
    """On a Hopper GPU the launcher keeps the tile (the fallback to swap_bf16 is for other GPUs and the interpreter),
    so the tests below time and check the Gluon kernel itself."""
    packed, scale = _mxfp4((4, 256), seed=1)
    for cfg in _TILES:
        assert _gluon_tile(cfg, packed, scale, torch.device("cuda")) == cfg


@pytest.mark.parametrize("cfg", _TILES, ids=lambda c: f"m{c.block_m}-w{c.num_warps}-k{c.block_k}-s{c.num_stages}")
@pytest.mark.parametrize("n", [2048, 2000])
def test_gluon_bf16_meets_the_fp32_bound(cfg: BlockConfig, n: int) -> None:
    """1,200 rows over 16 experts (about 75 an expert: several tiles each, partial ones), N a multiple of the tile
    and not: within the reference's FP32 bound; rows without an expert stay zero."""
    experts, m = 16, 1200
    packed, scale = _mxfp4((experts, n), seed=60)
    x = _activation(m, seed=61)
    ids = _ids(m, experts, seed=62)
    fast = _grouped(cfg, x, ids, packed, scale)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, m, n, x, ids, packed, scale)
    assert_gemm_close(fast, ref, _grouped_magnitude(x, ids, packed, scale), _K)
    assert torch.all(fast[ids < 0] == 0)


@pytest.mark.parametrize("cfg", _TILES, ids=lambda c: f"m{c.block_m}-w{c.num_warps}-k{c.block_k}-s{c.num_stages}")
def test_gluon_bf16_equals_the_swap_bf16_tile_bitwise(cfg: BlockConfig) -> None:
    """The same exact products summed over K in the same order of 16-column BF16 wgmma steps: the bits of the Triton
    swap_bf16 tile of the same rows."""
    experts, n, m = 16, 2048, 1200
    packed, scale = _mxfp4((experts, n), seed=70)
    x = _activation(m, seed=71)
    ids = _ids(m, experts, seed=72)
    gluon = _grouped(cfg, x, ids, packed, scale)
    triton_tile = _grouped(swap_bf16_tile(cfg.block_m, cfg.block_n, cfg.num_warps), x, ids, packed, scale)
    assert torch.equal(gluon, triton_tile)


def test_gluon_bf16_repeated_rows_and_a_short_k() -> None:
    """Top-k product rows reading one activation row each (repeats 3), and K = 384, which a 256-column step does not
    divide (the launcher shortens it to 128): within the bound, equal to swap_bf16 bit for bit."""
    experts, n, k, tokens, repeats = 8, 320, 384, 400, 3
    x = torch.randn((tokens, k), generator=_generator(80), device="cuda").to(torch.bfloat16)
    packed = _bytes((experts, n, k // 2), seed=81).view(torch.int8)
    scale = _bytes((experts, n, k // 32), seed=82, low=118, high=127).view(torch.float8_e8m0fnu)
    ids = _ids(tokens * repeats, experts, seed=83)
    gluon = _grouped(gluon_bf16_tile(64, 4, 256, 3), x, ids, packed, scale, repeats=repeats)
    triton_tile = _grouped(swap_bf16_tile(64, 64, 4), x, ids, packed, scale, repeats=repeats)
    rows = x.repeat_interleave(repeats, dim=0)
    ref = _run("mxfp4_grouped_gemm", Backend.REFERENCE, rows.shape[0], n, rows, ids, packed, scale)
    assert_gemm_close(gluon, ref, _grouped_magnitude(rows, ids, packed, scale), k)
    assert torch.equal(gluon, triton_tile)
