"""The grouped row decoding of the attention prefill kernel (``cuda.row_formats.decode_groups``): bit-exact with the
reference on rows of random bytes, every code and scale byte included, gathered by index as the kernel gathers keys
(−1 rows give zeros), whole rows and column blocks. Runs in Triton's interpreter on CPU tensors, or on a CUDA device
(hardware e4m3 conversion and PTX e2m1 decoding)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels.testing import assert_bitwise_equal, seeded_generator

triton = pytest.importorskip("triton", reason="Triton is not installed (the 'nvidia' extra)")
tl = triton.language

from deepinfer_kernels.cuda.row_formats import FORMAT_CODES, decode_groups  # noqa: E402

F = dk.RowFormat
_KEYS = 32


@triton.jit
def _gather_kernel(pool_ptr, idx_ptr, out_ptr, row_bytes, WIDTH: tl.constexpr, FIRST: tl.constexpr,
                   COLS: tl.constexpr, FMT: tl.constexpr, N: tl.constexpr):  # fmt: skip
    n = tl.arange(0, N)
    idx = tl.load(idx_ptr + n)
    values = decode_groups(pool_ptr, tl.maximum(idx, 0) * row_bytes, idx >= 0, FIRST, COLS, WIDTH, FMT)
    tl.store(out_ptr + n[:, None] * COLS + tl.arange(0, COLS)[None, :], values)


@pytest.mark.parametrize(
    ("fmt", "width", "first", "cols"),
    [(F.FP8, 512, 0, 512), (F.FP8, 512, 256, 128), (F.FP8, 64, 0, 64), (F.FP8, 96, 0, 128), (F.FP4_E4M3, 512, 0, 512),
     (F.FP4_E4M3, 64, 32, 32), (F.FP4_E4M3, 48, 0, 64), (F.FP4_UE8M0, 128, 0, 128), (F.RAW_FP32, 96, 64, 32)],
)  # fmt: skip
def test_decode_groups_bit_exact(triton_device: str, fmt: dk.RowFormat, width: int, first: int, cols: int) -> None:
    generator = seeded_generator(width + first + cols)
    pool = torch.randint(0, 256, (301, dk.bytes_per_row(fmt, width)), dtype=torch.uint8, generator=generator)
    idx = torch.randperm(301, generator=generator)[:_KEYS]
    idx[::5] = -1
    out = torch.full((_KEYS, cols), float("nan"), device=triton_device)
    _gather_kernel[(1,)](
        pool.to(triton_device), idx.to(triton_device), out, pool.shape[1],
        WIDTH=width, FIRST=first, COLS=cols, FMT=FORMAT_CODES[fmt], N=_KEYS,
    )  # fmt: skip
    decoded = torch.zeros((_KEYS, first + cols))
    decoded[:, :width] = dk.decode_rows(pool[idx.clamp(min=0)], fmt)[:, : first + cols]
    decoded[idx < 0] = 0.0
    expected = decoded[:, first:]
    got = out.cpu()
    assert torch.equal(got.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert_bitwise_equal(got[numbers], expected[numbers])
