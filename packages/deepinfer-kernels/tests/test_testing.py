"""The numerics helpers in deepinfer_kernels.testing: each check must fail on the case it exists for."""

from __future__ import annotations

import math

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels.testing import (
    assert_bitwise_equal,
    assert_close,
    attention_error,
    cosine_difference,
    random_e4m3,
    random_mxfp4_packed,
    random_normal,
    random_ue8m0,
    random_uniform,
    watch_flashmla,
)


def test_cosine_difference() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert cosine_difference(a, a) == 0.0
    assert cosine_difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert math.isclose(cosine_difference(a, -a), 2.0)
    assert 0.0 < cosine_difference(a, a * 1.01) < 1e-4
    with pytest.raises(ValueError, match="shape mismatch"):
        cosine_difference(a, a[:2])


def test_assert_close_checks_nonfinite_positions_first() -> None:
    expected = torch.tensor([1.0, math.nan, math.inf, -math.inf])
    assert_close(expected.clone(), expected, rtol=0.0, atol=0.0)
    with pytest.raises(AssertionError, match="NaN positions differ"):
        assert_close(torch.tensor([math.nan, 1.0, math.inf, -math.inf]), expected, rtol=1.0, atol=1.0)
    with pytest.raises(AssertionError, match=r"\+inf positions differ"):
        assert_close(torch.tensor([1.0, math.nan, 5.0, -math.inf]), expected, rtol=1.0, atol=10.0)
    with pytest.raises(AssertionError, match="-inf positions differ"):
        assert_close(torch.tensor([1.0, math.nan, math.inf, 5.0]), expected, rtol=1.0, atol=10.0)


def test_assert_close_tolerances() -> None:
    expected = torch.tensor([100.0, 0.0])
    assert_close(torch.tensor([101.0, 0.5]), expected, rtol=0.01, atol=0.5)
    with pytest.raises(AssertionError, match="1 of 2 elements out of tolerance"):
        assert_close(torch.tensor([102.0, 0.5]), expected, rtol=0.01, atol=0.5)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(torch.zeros(3), torch.zeros(2), rtol=0.0, atol=0.0)


def test_assert_bitwise_equal() -> None:
    a = torch.tensor([1.0, -0.0])
    assert_bitwise_equal(a, a.clone())
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        assert_bitwise_equal(a, torch.tensor([1.0, 0.0]))  # −0 and +0 differ in their bytes
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_bitwise_equal(a, a.double())
    q = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert_bitwise_equal(q, q.clone())


def test_builders_are_seeded_and_leave_global_rng_alone() -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    first = random_normal((4, 5), seed=3, dtype=torch.bfloat16)
    assert torch.equal(torch.rand(1), before)
    assert torch.equal(first, random_normal((4, 5), seed=3, dtype=torch.bfloat16))
    assert not torch.equal(first, random_normal((4, 5), seed=4, dtype=torch.bfloat16))
    u = random_uniform((1000,), seed=1, low=-2.0, high=3.0)
    assert u.min() >= -2.0 and u.max() < 3.0
    e4m3 = random_e4m3((4096,), seed=2)
    assert e4m3.dtype == torch.float8_e4m3fn and torch.isfinite(e4m3.float()).all()
    scales = random_ue8m0((1000,), seed=5, low=120, high=130).view(torch.uint8)
    assert scales.min() >= 120 and scales.max() <= 130
    assert random_mxfp4_packed((3, 16), seed=6).dtype == torch.int8
    with pytest.raises(ValueError, match="UE8M0 bytes"):
        random_ue8m0((2,), seed=1, low=0, high=255)


def test_attention_error_is_small_for_the_kernel_and_sees_one_changed_query() -> None:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn((6, 2, 64), generator=generator).to(torch.bfloat16)
    pool = dk.encode_rows(torch.randn((10, 64), generator=generator), dk.RowFormat.FP8)
    sources = [dk.KeySource(pool, torch.randint(0, 10, (6, 4), generator=generator), dk.RowFormat.FP8)]
    sink = torch.zeros(2)
    out = dk.sparse_attention(q, sources, sink, 0.125, True).float()
    picked = torch.tensor([0, 5])
    assert attention_error(q, sources, sink, 0.125, out, picked) <= 2.0**-8  # the backend's own kernel
    out[5, 1, 3] += 1.0
    assert attention_error(q, sources, sink, 0.125, out, picked) > 0.1
    assert attention_error(q, sources, sink, 0.125, out, torch.tensor([0, 1])) <= 2.0**-8  # query 5 not compared


def test_watch_flashmla_records_calls_and_restores_the_module() -> None:
    flashmla = pytest.importorskip("deepinfer_kernels.cuda.flashmla")
    fits, run = flashmla.fits, flashmla.attend
    q = torch.zeros((flashmla.MIN_QUERIES, 64, 512), dtype=torch.bfloat16)
    pool = dk.encode_rows(torch.zeros((1, 512)), dk.RowFormat.FP8)
    source = dk.KeySource(pool, torch.zeros((q.shape[0], 1), dtype=torch.int64), dk.RowFormat.FP8)
    with watch_flashmla() as seen:
        assert flashmla.fits is not fits and flashmla.attend is not run
        assert not flashmla.fits(q, [source], torch.zeros(64), True)  # CPU tensors: never FlashMLA
        assert not flashmla.fits(q[:5], [source], torch.zeros(64), True)
    assert seen.calls == [(flashmla.MIN_QUERIES, False), (5, False)] and seen.taken == 0 and not seen.errors
    assert flashmla.fits is fits and flashmla.attend is run
