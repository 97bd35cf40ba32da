"""Numerics helpers for tests of every DeepInfer package (library code; never imports pytest).

- :func:`cosine_difference` — ``1 − 2·⟨a, b⟩ / (‖a‖² + ‖b‖²)`` in FP64: 0 for identical tensors, scale-aware,
  the usual acceptance metric for GEMM-like results (≈1e-5 is typical for bf16 outputs).
- :func:`assert_close` — compares inf/NaN positions first (they must match exactly), then finite values with
  ``|actual − expected| ≤ atol + rtol·|expected|``.
- :func:`assert_bitwise_equal` — same dtype, shape and bytes.
- :func:`attention_error` — a ``sparse_attention`` output against the reference on some of its queries.
- :func:`watch_flashmla` — records which ``sparse_attention`` calls FlashMLA takes and checks each it runs.
- Seeded input builders — every builder takes an explicit ``seed`` and draws on the CPU with its own
  ``torch.Generator`` (then moves to ``device``), so the same seed gives the same values on every device and
  no global RNG state is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.cache_layout import KeySource

__all__ = [
    "FlashMLACalls",
    "assert_bitwise_equal",
    "assert_close",
    "attention_error",
    "cosine_difference",
    "random_e4m3",
    "random_mxfp4_packed",
    "random_normal",
    "random_ue8m0",
    "random_uniform",
    "seeded_generator",
    "watch_flashmla",
]


def cosine_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``1 − 2·⟨a, b⟩ / (‖a‖² + ‖b‖²)`` over all elements, computed in FP64.

    Args:
        actual: any shape and float dtype.
        expected: same shape as ``actual``.

    Returns:
        A float ≥ 0 (0 when the tensors are equal; 0 also when both are all zeros).

    Raises:
        ValueError: shapes differ.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a = actual.detach().double().flatten().cpu()
    b = expected.detach().double().flatten().cpu()
    denominator = float((a * a).sum() + (b * b).sum())
    if denominator == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((a * b).sum()) / denominator


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, message: str = "") -> None:
    """Assert equal non-finite positions, then ``|actual − expected| ≤ atol + rtol·|expected|`` elsewhere.

    Args:
        actual: any shape; compared in FP64 on the CPU.
        expected: same shape.
        rtol: relative tolerance (≥ 0).
        atol: absolute tolerance (≥ 0).
        message: prefix for the failure message.

    Raises:
        AssertionError: shapes differ, NaN or ±inf positions differ, or a finite element is out of tolerance.
    """
    prefix = f"{message}: " if message else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    for name, mask_a, mask_e in (
        ("NaN", torch.isnan(a), torch.isnan(e)),
        ("+inf", torch.isposinf(a), torch.isposinf(e)),
        ("-inf", torch.isneginf(a), torch.isneginf(e)),
    ):
        if not torch.equal(mask_a, mask_e):
            where = torch.nonzero(mask_a != mask_e)[:5].tolist()
            raise AssertionError(f"{prefix}{name} positions differ (first indices {where})")
    finite = torch.isfinite(e)
    error = (a - e).abs()
    bad = finite & (error > atol + rtol * e.abs())
    if bool(bad.any()):
        index = torch.nonzero(bad)[0].tolist()
        raise AssertionError(
            f"{prefix}{int(bad.sum())} of {bad.numel()} elements out of tolerance (rtol={rtol}, atol={atol}); "
            f"first at {index}: actual {a[tuple(index)].item()!r} vs expected {e[tuple(index)].item()!r}; "
            f"max abs error {error[finite].max().item()!r}"
        )


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, message: str = "") -> None:
    """Assert same dtype, same shape and identical bytes (NaN payloads included).

    Raises:
        AssertionError: on any difference; the message gives the count and the first differing index.
    """
    prefix = f"{message}: " if message else ""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{prefix}dtype mismatch: actual {actual.dtype} vs expected {expected.dtype}")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    a = actual.detach().contiguous().cpu().view(torch.uint8).reshape(*actual.shape, -1)
    e = expected.detach().contiguous().cpu().view(torch.uint8).reshape(*expected.shape, -1)
    differs = (a != e).any(dim=-1)
    if bool(differs.any()):
        index = torch.nonzero(differs)[0].tolist()
        raise AssertionError(
            f"{prefix}{int(differs.sum())} of {differs.numel()} elements differ; first at {index}: "
            f"actual bytes {a[tuple(index)].tolist()} vs expected {e[tuple(index)].tolist()}"
        )


def attention_error(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    queries: torch.Tensor,
) -> float:
    """``max |out − ref| / max |ref|`` over the ``queries`` (int64 indices) of a ``sparse_attention`` call of exact
    numerics (rounded probabilities), ``ref`` being the reference backend's output on those queries' keys."""
    expected = torch.empty((queries.numel(), *q.shape[1:]), dtype=torch.float32, device=q.device)
    picked = [KeySource(s.pool, s.rows[queries], s.fmt) for s in sources]
    implementation("sparse_attention", Backend.REFERENCE)(q[queries], picked, sink, scale, True, expected)
    return float((out[queries].float() - expected).abs().max()) / float(expected.abs().max())


@dataclasses.dataclass
class FlashMLACalls:
    """What :func:`watch_flashmla` saw: every NVIDIA ``sparse_attention`` call as (queries, whether FlashMLA took
    it), and the :func:`attention_error` of each call FlashMLA ran."""

    calls: list[tuple[int, bool]] = dataclasses.field(default_factory=list)
    errors: list[float] = dataclasses.field(default_factory=list)

    @property
    def taken(self) -> int:
        return sum(took for _, took in self.calls)


@contextlib.contextmanager
def watch_flashmla(check: int = 64) -> Iterator[FlashMLACalls]:
    """Within the block, ``cuda.flashmla``'s ``fits`` and ``attend`` (every FlashMLA run, widened or not) record each
    call; every call FlashMLA runs is compared with the reference on its first and last ``check`` queries
    (``attention_error``). Imports the NVIDIA backend's module (the caller skips where it does not import)."""
    from deepinfer_kernels.cuda import flashmla

    seen = FlashMLACalls()
    fits, run = flashmla.fits, flashmla.attend

    def fits_seen(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, round_probs_bf16: bool) -> bool:
        seen.calls.append((q.shape[0], fits(q, sources, sink, round_probs_bf16)))
        return seen.calls[-1][1]

    def run_checked(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, scale: float) -> torch.Tensor:
        out = run(q, sources, sink, scale)
        tokens = q.shape[0]
        picked = torch.cat([torch.arange(min(check, tokens)), torch.arange(max(tokens - check, 0), tokens)])
        seen.errors.append(attention_error(q, sources, sink, scale, out.float(), picked.unique().to(q.device)))
        return out

    flashmla.fits, flashmla.attend = fits_seen, run_checked
    try:
        yield seen
    finally:
        flashmla.fits, flashmla.attend = fits, run


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (independent of the global RNG)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def random_normal(
    shape: tuple[int, ...],
    *,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    std: float = 1.0,
) -> torch.Tensor:
    """Normal(0, std²) values drawn in FP32 on the CPU, rounded to ``dtype``, moved to ``device``; shape ``shape``."""
    values = torch.randn(shape, generator=seeded_generator(seed), dtype=torch.float32) * std
    return values.to(dtype).to(device)


def random_uniform(
    shape: tuple[int, ...],
    *,
    seed: int,
    low: float,
    high: float,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Uniform[low, high) values drawn in FP32 on the CPU, rounded to ``dtype``, moved to ``device``."""
    values = torch.rand(shape, generator=seeded_generator(seed), dtype=torch.float32) * (high - low) + low
    return values.to(dtype).to(device)


def random_e4m3(shape: tuple[int, ...], *, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random finite float8_e4m3fn values: every byte except the two NaN codes 0x7F and 0xFF is equally likely."""
    finite_codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    index = torch.randint(0, finite_codes.numel(), shape, generator=seeded_generator(seed))
    return finite_codes[index].view(torch.float8_e4m3fn).to(device)


def random_ue8m0(
    shape: tuple[int, ...], *, seed: int, low: int = 100, high: int = 140, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Random UE8M0 scales (float8_e8m0fnu) with bytes uniform in ``[low, high]`` (defaults: 2^−27 … 2^13)."""
    if not 0 <= low <= high <= 254:
        raise ValueError(f"need 0 <= low <= high <= 254 for UE8M0 bytes, got low={low}, high={high}")
    values = torch.randint(low, high + 1, shape, generator=seeded_generator(seed), dtype=torch.int32)
    return values.to(torch.uint8).view(torch.float8_e8m0fnu).to(device)


def random_mxfp4_packed(shape: tuple[int, ...], *, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random packed MXFP4 bytes (int8; every e2m1 code pair equally likely); shape [out, in / 2]."""
    values = torch.randint(0, 256, shape, generator=seeded_generator(seed), dtype=torch.int32)
    return values.to(torch.uint8).view(torch.int8).to(device)
