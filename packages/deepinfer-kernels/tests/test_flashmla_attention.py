"""FlashMLA's sparse prefill kernel behind ``sparse_attention`` (``cuda.flashmla``; docs/design/kernels.md, "FlashMLA
sparse prefill"): when the call may take it, its key table and indices, and on an SM90 GPU with ``flash_mla``
importable its output against the reference.

Tolerance on the GPU: max |out − ref| ≤ 2^−7 · max |ref|. FlashMLA rounds each probability to BF16 against a running
maximum and writes BF16 (each up to 2^−9 relative), where the package's kernels meet 2^−8; measured 2.5e-3 at the
scaled preset's shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.platform import Accelerator
from deepinfer_kernels.testing import attention_error
from deepinfer_kernels.vendor_attention import vendor_attention, vendor_attention_unavailable

flashmla = pytest.importorskip("deepinfer_kernels.cuda.flashmla")


def _call(tokens: int, heads: int = 64, width: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((tokens, heads, width), dtype=torch.bfloat16), torch.zeros(heads)


@pytest.mark.parametrize(
    ("tokens", "heads", "width", "rounded", "taken"),
    [
        (2048, 64, 512, True, True),
        (flashmla.MIN_QUERIES, 128, 512, True, True),
        (flashmla.MIN_QUERIES - 1, 64, 512, True, False),
        (2048, 32, 512, True, False),
        (2048, 64, 256, True, False),
        (2048, 64, 512, False, False),
    ],
)
def test_the_kernel_takes_prompt_sized_calls_of_its_heads_and_width(
    tokens: int, heads: int, width: int, rounded: bool, taken: bool
) -> None:
    q, sink = _call(tokens, heads, width)
    assert flashmla.takes(q, sink, rounded) is taken
    assert not flashmla.takes(q.float(), sink, rounded)
    assert not flashmla.takes(q, sink.bfloat16(), rounded)


def test_off_the_gpu_outside_the_mode_or_when_invariant_the_call_keeps_the_package_kernels() -> None:
    q, sink = _call(2048)
    source = dk.KeySource(torch.zeros((4, 528), dtype=torch.uint8), torch.zeros((2048, 64)), dk.RowFormat.FP8)
    assert flashmla.takes(q, sink, True)
    assert not flashmla.fits(q, [source], sink, True)  # outside the mode
    with vendor_attention():
        assert not flashmla.fits(q, [source], sink, True)  # CPU tensors
        assert not flashmla.fits(q, [], sink, True)
        with batch_invariant_ops():
            assert not flashmla.fits(q, [source], sink, True)


@pytest.fixture
def fresh_load():
    flashmla._load.cache_clear()
    yield
    flashmla._load.cache_clear()


def test_unavailable_names_the_device_or_the_import_failure(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))
    assert "SM100" in flashmla.unavailable_reason(0) and "SM90 only" in flashmla.unavailable_reason(0)
    flashmla._load.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # not installed
    assert "ModuleNotFoundError" in flashmla.unavailable_reason(1) and "sgl-flash-mla" in flashmla.unavailable_reason(1)
    flashmla._load.cache_clear()
    # A wheel built against another torch: its extension fails to load with something other than ImportError.
    (tmp_path / "flash_mla.py").write_text("raise OSError('undefined symbol: c10_foo')\n")
    monkeypatch.delitem(sys.modules, "flash_mla")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "OSError: undefined symbol: c10_foo" in flashmla.unavailable_reason(2)
    assert flashmla._flash_mla(2) is None


def test_vendor_attention_says_why_it_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "cpu devices" in vendor_attention_unavailable(torch.device("cpu"), 64, 512)
    monkeypatch.setattr("deepinfer_kernels.vendor_attention.current_accelerator", lambda: Accelerator.NVIDIA)
    reason = vendor_attention_unavailable(torch.device("cuda"), 8, 64)
    assert reason == "its kernel takes 64 or 128 heads of 512; this model has 8 of 64"


def test_the_key_table_holds_every_source_and_pads_to_whole_blocks() -> None:
    """A pool of at most two rows a query is decoded whole; a larger one only at the rows read; −1 stays −1."""
    generator = torch.Generator().manual_seed(0)
    small = dk.encode_rows(torch.randn((4, 64), generator=generator), dk.RowFormat.FP8)
    large = dk.encode_rows(torch.randn((40, 64), generator=generator), dk.RowFormat.FP8)
    rows_small = torch.tensor([[0, 3, -1], [2, -1, -1]])
    rows_large = torch.tensor([[39, 7], [7, -1]])
    sources = [dk.KeySource(small, rows_small, dk.RowFormat.FP8), dk.KeySource(large, rows_large, dk.RowFormat.FP8)]
    table, indices = flashmla.key_table(sources, 2)
    # The large pool at rows 7 and 39, and at row 0 for its −1 entries (clamped before the unique).
    assert table.dtype == torch.bfloat16 and table.shape == (4 + 3, 1, 64)
    assert indices.dtype == torch.int32 and indices.shape == (2, 1, flashmla.KEY_BLOCK)
    keys = torch.cat([dk.decode_rows(small, dk.RowFormat.FP8), dk.decode_rows(large, dk.RowFormat.FP8)])
    wanted = torch.cat([rows_small, torch.where(rows_large >= 0, rows_large + 4, -1)], dim=1)
    for t in range(2):
        for n, row in enumerate(wanted[t].tolist()):
            index = int(indices[t, 0, n])
            assert (index < 0) == (row < 0)
            if row >= 0:
                assert torch.equal(table[index, 0].float(), keys[row])
    assert (indices[:, 0, wanted.shape[1] :] == -1).all()


@pytest.mark.parametrize("shape", [(3, 5, 512), (1,), (4097,), (0, 64)])
def test_widen_converts_the_kernel_s_bf16_output_exactly(triton_device: str, shape: tuple[int, ...]) -> None:
    """FlashMLA's BF16 output widened into FP32: bitwise the conversion, a whole program, a partial last one, none;
    non-finite values and signed zeros kept; non-contiguous operands through ATen; wrong dtypes or shapes refused."""
    src = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(torch.bfloat16)
    if src.numel() >= 4:
        src.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, float("nan")])
    src = src.to(triton_device)
    out = torch.full(shape, 7.0, dtype=torch.float32, device=triton_device)
    flashmla.widen(src, out)
    assert torch.equal(out.view(torch.int32), src.float().view(torch.int32))
    if src.dim() == 3:
        strided = torch.empty((shape[0], shape[2], shape[1]), dtype=torch.float32, device=triton_device)
        flashmla.widen(src, strided.transpose(1, 2))
        assert torch.equal(strided.transpose(1, 2).view(torch.int32), src.float().view(torch.int32))
    with pytest.raises(ValueError, match="bf16 into fp32"):
        flashmla.widen(src.float(), out)
    with pytest.raises(ValueError, match="bf16 into fp32"):
        flashmla.widen(src, out.view(-1)[:-1] if out.numel() else out.view(-1, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not flashmla.available(), reason="needs an SM90 GPU with flash_mla (the sgl-flash-mla wheel)")
@pytest.mark.parametrize(
    ("tokens", "window_keys", "compressed_keys", "pool_rows"),
    [(1024, 100, 64, 1 << 17), (3000, 128, 512, 1 << 14)],  # the window pools decoded whole, the others at their rows
)
def test_flashmla_meets_the_reference_bound(
    tokens: int, window_keys: int, compressed_keys: int, pool_rows: int
) -> None:
    """The scaled preset's heads and width: a window source (−1 where a query has fewer keys; 100 keys a query
    leave the index list short of a whole block) and a compressed FP4_E4M3 source."""
    generator = torch.Generator(device="cuda").manual_seed(tokens)

    def pool(rows: int, fmt: dk.RowFormat) -> torch.Tensor:
        return dk.encode_rows(torch.randn((rows, 512), generator=generator, device="cuda"), fmt)

    window = torch.randint(0, tokens, (tokens, window_keys), generator=generator, device="cuda")
    window[:, window_keys - 20 :] = -1
    compressed = torch.randint(0, pool_rows, (tokens, compressed_keys), generator=generator, device="cuda")
    sources = [
        dk.KeySource(pool(tokens, dk.RowFormat.FP8), window, dk.RowFormat.FP8),
        dk.KeySource(pool(pool_rows, dk.RowFormat.FP4_E4M3), compressed, dk.RowFormat.FP4_E4M3),
    ]
    q = torch.randn((tokens, 64, 512), generator=generator, device="cuda").to(torch.bfloat16)
    sink = torch.randn((64,), generator=generator, device="cuda")
    out = torch.empty(q.shape, dtype=torch.float32, device="cuda")
    with vendor_attention():
        assert flashmla.fits(q, sources, sink, True)
        implementation("sparse_attention", Backend.NVIDIA)(q, sources, sink, 512**-0.5, True, out)
        kept = dk.sparse_attention(q, sources, sink, 512**-0.5, True, widen=False)
    check = torch.arange(128, device="cuda")
    assert attention_error(q, sources, sink, 512**-0.5, out, check) <= 2.0**-7
    # Unwidened: the kernel's BF16 output, whose values the widened output holds exactly.
    assert kept.dtype == torch.bfloat16 and torch.equal(kept.float(), out)
    assert dk.sparse_attention(q, sources, sink, 512**-0.5, True, widen=False).dtype == torch.float32
