"""Which operands the Gluon GEMMs' ``cp.async`` rings take (``fits``): whole K steps and chunks, aligned rows and
bases; everything else runs the ``swap_fp8`` tile (the same bits). And on which Triton releases the Gluon kernels
run at all. Pure arithmetic: runs without a GPU."""

from __future__ import annotations

import torch

from deepinfer_kernels.cuda import fp8_wgmma, gluon_ring, grouped_wgmma
from deepinfer_kernels.cuda.gemm_tiles import BlockConfig

_TILE = BlockConfig(8, 64, num_warps=4, num_stages=3, split_grid=False, block_k=256, decoding="gluon_fp8")


def _fp8_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    q = torch.zeros(m, k, dtype=torch.uint8)
    q_scale = torch.zeros(m, k // 32, dtype=torch.uint8)
    return q, q_scale, torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n // 32, k // 32, dtype=torch.uint8)


def test_the_dense_ring_takes_whole_steps_and_aligned_rows() -> None:
    n, k = 4096, 5120
    assert fp8_wgmma.fits(n, k, *_fp8_operands(4, n, k), groups=1, cfg=_TILE)
    q, q_scale, w_q, w_scale = _fp8_operands(4, n, k + 128)
    # K = 5,248 is no multiple of the 256-column step.
    assert not fp8_wgmma.fits(n, k + 128, q, q_scale, w_q, w_scale, groups=1, cfg=_TILE)
    q, q_scale, w_q, w_scale = _fp8_operands(4, n, k)
    wide = torch.zeros(4, k + 8, dtype=torch.uint8)[:, :k]  # rows 8 bytes apart from 16-byte alignment
    assert not fp8_wgmma.fits(n, k, wide, q_scale, w_q, w_scale, groups=1, cfg=_TILE)
    shifted = torch.zeros(4 * k + 4, dtype=torch.uint8)[4:].view(4, k)  # base 4 bytes off
    assert not fp8_wgmma.fits(n, k, shifted, q_scale, w_q, w_scale, groups=1, cfg=_TILE)
    # Grouped: 8 groups of 1,000 weight rows are no whole number of 64-row tiles; of 1,024 they are.
    assert not fp8_wgmma.fits(8000, 4096, *_fp8_operands(4, 8000, 4096), groups=8, cfg=_TILE)
    assert fp8_wgmma.fits(8192, 4096, *_fp8_operands(4, 8192, 4096), groups=8, cfg=_TILE)


def test_the_grouped_ring_takes_whole_steps_and_aligned_scales() -> None:
    experts, n, k = 4, 512, 2304
    packed = torch.zeros(experts, n, k // 2, dtype=torch.uint8)
    scale = torch.zeros(experts, n, k // 32, dtype=torch.uint8)
    assert grouped_wgmma.fits(k, packed, scale, 256)
    assert not grouped_wgmma.fits(k, packed, scale, 512)  # 2,304 is 4.5 steps of 512
    odd = torch.zeros(experts, n, k // 32 + 4, dtype=torch.uint8)[:, :, : k // 32]  # 76-byte scale rows
    assert not grouped_wgmma.fits(k, packed, odd, 256)


def test_the_gluon_kernels_run_only_on_the_triton_they_were_written_for() -> None:
    # Gluon's API moved after 3.6 (3.9 lacks thread_barrier and _reinterpret); other releases take the Triton tiles.
    assert gluon_ring.gluon_supported("3.6.0")
    assert gluon_ring.gluon_supported("3.6.1+git1234abcd")
    assert not gluon_ring.gluon_supported("3.9.0")
    assert not gluon_ring.gluon_supported("3.5.1")
    assert not gluon_ring.gluon_supported("4.6.0")
    assert not gluon_ring.available(torch.device("cpu"))
