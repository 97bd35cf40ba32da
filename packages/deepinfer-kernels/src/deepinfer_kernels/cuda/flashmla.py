"""FlashMLA's SM90 sparse prefill kernel behind ``sparse_attention`` (docs/design/kernels.md, "FlashMLA sparse
prefill").

FlashMLA has no SM90 kernel for the V4.1 row formats, but the ``sgl-flash-mla`` wheel's legacy extension runs
``flash_mla_sparse_fwd(q, kv, indices, ..., use_legacy=True)`` over BF16 keys: ``kv [rows, 1, D]`` and per query
``indices [T, 1, keys]`` into it (−1: no key), with the per-head sink added to the softmax's denominator as ours is.
So the sources' keys are decoded into one BF16 table first (exact: every row format's values are BF16 numbers): a
pool of at most ``WHOLE_POOL_ROWS_PER_QUERY`` rows a query (the step's own window keys) is decoded whole; a larger one
(the rings of every request, the compressed cache pool: millions of rows at a large cache) only at the rows the step
reads, found by ``torch.unique`` (a host sync, hence eager prompt-sized calls only).

What differs from the package's kernels: FlashMLA's online softmax rounds each probability to BF16 against the
running maximum, not the final one, and writes BF16 (docs/design/kernels.md, "sparse_attention", "Why two passes").
Measured against the reference at the scaled preset's shape: 2.5e-3 of max |ref| (the package's kernel 6e-4).
Its BF16 output is widened into the FP32 ``out`` by ``widen`` (exact), one Triton pass of 16-byte loads: ATen's
converting copy ran at about 1.9 TB/s on an H100, 6.7 ms of an 8K prefill (profile_step-h100-s29-8k.json).
"""

# Triton reads parameter annotations as kernel type hints, so @triton.jit functions stay unannotated.
# ruff: noqa: ANN001, ANN202

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch
import triton
import triton.language as tl

from deepinfer_kernels.batch_invariant import invariant_kernels
from deepinfer_kernels.cache_layout import KeySource
from deepinfer_kernels.cuda._launch import await_inputs, check_launchable, dependent_launch
from deepinfer_kernels.row_formats import decode_rows
from deepinfer_kernels.vendor_attention import vendor_attention_requested

__all__ = [
    "MIN_QUERIES",
    "attend",
    "available",
    "fits",
    "key_table",
    "sparse_attention",
    "takes",
    "unavailable_reason",
    "widen",
]

# Prompt-sized calls only: decode steps (CUDA graphs; the split path's bits) keep the package's kernels, and below
# about a thousand queries the table's decoding and the host sync would eat what the kernel saves.
MIN_QUERIES = 1024
# The kernel's shapes: 64 or 128 query heads, 512 columns, index lists in whole 128-key blocks (the SM90 kernel
# asserts topk % (2·B_TOPK) == 0 with its 64-key B_TOPK; 64-key padding failed on an H100).
HEADS = (64, 128)
WIDTH = 512
KEY_BLOCK = 128
# A pool of at most this many rows a query is decoded whole (it holds about the step's own keys); a larger one is read
# at its distinct rows: decoding costs by the pool's rows, the unique by the row list's entries.
WHOLE_POOL_ROWS_PER_QUERY = 2
# Elements a widening program converts: 32 a thread at 4 warps, four 16-byte loads and eight 16-byte stores each.
_WIDEN_BLOCK = 4096


@functools.cache
def _load(device_index: int) -> tuple[ModuleType | None, str]:
    """The ``flash_mla`` module when it imports and the device is SM90 (the legacy kernels' only target), else None
    and why not."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability != (9, 0):
        return None, f"cuda:{device_index} is SM{capability[0]}{capability[1]}; its legacy kernels run on SM90 only"
    try:
        import flash_mla
    # A wheel built against another torch fails with more than ImportError (undefined symbols, OSError); FlashMLA is
    # optional, so any import failure means the package's kernels, with the reason logged by the engine.
    except Exception as error:
        return None, f"flash_mla does not import ({type(error).__name__}: {error}); pip install --no-deps sgl-flash-mla"
    return flash_mla, ""


def _flash_mla(device_index: int) -> ModuleType | None:
    return _load(device_index)[0]


def unavailable_reason(device_index: int | None = None) -> str | None:
    """Why FlashMLA cannot run on the CUDA device (default: the current one), or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    module, reason = _load(torch.cuda.current_device() if device_index is None else device_index)
    return None if module is not None else reason


def available() -> bool:
    """Whether the current CUDA device is SM90 and ``flash_mla`` imports (tests and benchmarks skip without it)."""
    return unavailable_reason() is None


def takes(q: torch.Tensor, sink: torch.Tensor, round_probs_bf16: bool) -> bool:
    """Whether the kernel takes a call of this shape and these dtypes, wherever the tensors live: BF16 queries with
    rounded probabilities (the exact mode), an FP32 sink, at least ``MIN_QUERIES`` queries, and its heads and width."""
    if not round_probs_bf16 or q.dtype != torch.bfloat16 or sink.dtype != torch.float32 or q.dim() != 3:
        return False
    tokens, heads, width = q.shape
    return tokens >= MIN_QUERIES and heads in HEADS and width == WIDTH


def fits(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, round_probs_bf16: bool) -> bool:
    """Whether ``sparse_attention`` may run this call on FlashMLA: inside ``vendor_attention()``, not in the
    batch-invariant mode, at least one source, a call the kernel ``takes``, on a CUDA device outside graph capture,
    and the library importable on an SM90 device."""
    if not vendor_attention_requested() or invariant_kernels() or not sources or not takes(q, sink, round_probs_bf16):
        return False
    if q.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    return _flash_mla(q.device.index if q.device.index is not None else torch.cuda.current_device()) is not None


def key_table(sources: Sequence[KeySource], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sources' keys as one BF16 table ``[rows, 1, D]`` and every query's keys as int32 indices into it ``[T, 1,
    keys]``, the sources side by side and padded with −1 to whole ``KEY_BLOCK``-key blocks (the module docstring says
    which pools are decoded whole)."""
    tables, indices, offset = [], [], 0
    for source in sources:
        rows = source.rows.to(torch.int64)
        if source.pool.shape[0] <= WHOLE_POOL_ROWS_PER_QUERY * tokens:
            table = decode_rows(source.pool, source.fmt)
        else:
            read, compact = torch.unique(rows.clamp_min(0), return_inverse=True)
            table, rows = decode_rows(source.pool[read], source.fmt), torch.where(rows >= 0, compact, -1)
        tables.append(table.to(torch.bfloat16))
        indices.append(torch.where(rows >= 0, rows + offset, -1))
        offset += table.shape[0]
    keys = sum(i.shape[1] for i in indices)
    pad = -keys % KEY_BLOCK
    if pad:
        indices.append(torch.full((tokens, pad), -1, dtype=torch.int64, device=tables[0].device))
    return torch.cat(tables)[:, None, :], torch.cat(indices, dim=1).to(torch.int32)[:, None, :]


def attend(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float) -> torch.Tensor:
    """FlashMLA's sparse attention of ``q`` over ``sources`` as it leaves the kernel, [T, H, D] BF16 (``fits`` must
    hold)."""
    module = _flash_mla(q.device.index if q.device.index is not None else torch.cuda.current_device())
    assert module is not None, "sparse_attention called on FlashMLA where fits() does not hold"
    table, indices = key_table(sources, q.shape[0])
    result, _, _ = module.flash_mla_sparse_fwd(
        q.contiguous(), table, indices, scale, d_v=q.shape[2], attn_sink=sink, use_legacy=True
    )
    return result


def sparse_attention(
    q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """``out`` [T, H, D] FP32 ← :func:`attend`'s output, widened."""
    widen(attend(q, sources, sink, scale), out)


@triton.jit
def _widen_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    await_inputs(PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(src_ptr + offsets, mask=mask).to(tl.float32), mask=mask)


def widen(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (fp32) ← ``src`` (bf16, the same shape), exactly; one Triton pass where both are contiguous, else
    ATen's converting copy."""
    if src.shape != out.shape or src.dtype != torch.bfloat16 or out.dtype != torch.float32:
        raise ValueError(f"widen takes bf16 into fp32 of one shape, got {src.dtype} {tuple(src.shape)} into "
                         f"{out.dtype} {tuple(out.shape)}")  # fmt: skip
    if not (src.is_contiguous() and out.is_contiguous()):
        out.copy_(src)
        return
    check_launchable(src=src, out=out)
    n = src.numel()
    if n:
        _widen_kernel[(triton.cdiv(n, _WIDEN_BLOCK),)](
            src, out, n, BLOCK=_WIDEN_BLOCK, num_warps=4, **dependent_launch(out.device)
        )
