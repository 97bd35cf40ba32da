"""The Triton indexer's sort keys (``cuda.indexer._sort_key``): the int32 keys of BF16 values and 16-bit ids order
exactly as the int64 keys, over every BF16 bit pattern. Runs in Triton's interpreter on CPU tensors, or on a CUDA
device."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the 'nvidia' extra)")
tl = triton.language

from deepinfer_kernels.cuda.indexer import _sort_key  # noqa: E402


@triton.jit
def _keys_kernel(score_ptr, id_ptr, key32_ptr, key64_ptr, BLOCK: tl.constexpr):
    # Both keys of each (score, id); one id in seven (id mod 7 = 3) marks an invalid entry.
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    score = tl.load(score_ptr + i)
    ident = tl.load(id_ptr + i)
    valid = ident % 7 != 3
    tl.store(key32_ptr + i, _sort_key(score, ident, valid, True))
    tl.store(key64_ptr + i, _sort_key(score, ident, valid, False))


def _keys(scores: torch.Tensor, ids: torch.Tensor, device: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    key32 = torch.empty(scores.shape, dtype=torch.int32, device=device)
    key64 = torch.empty(scores.shape, dtype=torch.int64, device=device)
    _keys_kernel[(scores.numel() // block,)](scores.to(device), ids.to(device), key32, key64, BLOCK=block)
    return key32.cpu(), key64.cpu()


def test_int32_keys_order_as_int64_keys(triton_device: str) -> None:
    """Every BF16 value (±0, subnormals, ±inf, NaNs), each twice, with ids below 2^16: the int32 keys sort into the
    int64 keys' order (larger value, then lower id; invalid entries last), tie where they tie, and hold the id in
    their low 16 bits (the complement)."""
    count = 1 << 17
    # The FP32 value of each BF16 bit pattern: its bits, then 16 zeros.
    scores = (torch.arange(count, dtype=torch.int32) << 16).view(torch.float32)
    ids = torch.randperm(count, generator=torch.Generator().manual_seed(0)).to(torch.int32) % (1 << 16)
    key32, key64 = _keys(scores, ids, triton_device, 1024)
    order = torch.argsort(key64, stable=True)
    assert torch.equal(torch.argsort(key32, stable=True), order)
    assert torch.equal(key32[order].diff() == 0, key64[order].diff() == 0)
    valid = ids % 7 != 3
    assert torch.equal(0xFFFF - (key32[valid] & 0xFFFF), ids[valid])
    assert bool((key32[~valid] == torch.iinfo(torch.int32).min).all())


def test_named_values_rank_in_value_order(triton_device: str) -> None:
    """With one id: NaN ties with −inf, below −BF16_MAX (the int32 keys' floor is −inf itself, −FLT_MAX being no BF16
    value), and −0.0 ranks just below +0.0, in both key types."""
    big = torch.finfo(torch.bfloat16).max
    named = torch.tensor([float("nan"), -torch.inf, -big, -1.0, -0.0, 0.0, 1.0, big] + [torch.inf] * 8)
    for keys in _keys(named, torch.full((16,), 5, dtype=torch.int32), triton_device, 16):
        assert keys[0] == keys[1] and bool((keys[1:9].diff() > 0).all())
