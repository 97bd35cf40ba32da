"""Clamped SwiGLU and router selection: Triton (interpreter on CPU, or CUDA) vs reference on fresh seeded inputs,
reference properties, wrapper checks.

Tolerances: both kernels run the reference's FP32 operations in order, except ``exp`` (last bits) and, in the
router, ``log1p`` (``log(1 + x) · x / ((1 + x) − 1)``) and the order of the sum over the chosen experts: SwiGLU within
rtol 2^−18 + atol 1e−30 (the compiled ``exp`` is off by up to about 2^−20 relative, 1.03 · 2^−20 seen on the H200);
router ids equal (random logits have no near-ties) and weights within rtol 2^−20.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import assert_close, random_normal


# 768 columns: 256-column tiles of 4 rows, the second row tile partial.
@pytest.mark.parametrize(("rows", "half"), [(1, 16), (7, 100), (33, 1300), (5, 768)])
@pytest.mark.parametrize("limit", [None, 3.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_triton_parity(
    triton_device: str, rows: int, half: int, limit: float | None, weighted: bool, dtype: torch.dtype
) -> None:
    t = random_normal((rows, 2 * half), seed=rows + half, dtype=dtype, std=4.0)
    weight = random_normal((rows,), seed=rows, dtype=torch.float32).abs() if weighted else None
    expected = torch.empty(rows, half)
    implementation("swiglu_clamped", Backend.REFERENCE)(t, limit, weight, expected)
    actual = torch.empty(rows, half, device=triton_device)
    implementation("swiglu_clamped", Backend.NVIDIA)(
        t.to(triton_device), limit, None if weight is None else weight.to(triton_device), actual
    )
    assert_close(actual.cpu(), expected, rtol=2.0**-18, atol=1e-30)


@pytest.mark.parametrize(("n", "experts", "top_k"), [(1, 8, 2), (5, 64, 6), (19, 256, 8), (3, 12, 12)])
def test_router_triton_parity(triton_device: str, n: int, experts: int, top_k: int) -> None:
    logits = random_normal((n, experts), seed=n + experts, dtype=torch.float32, std=8.0)
    bias = random_normal((experts,), seed=experts, dtype=torch.float32, std=0.5)
    ids_ref, w_ref = torch.empty(n, top_k, dtype=torch.int64), torch.empty(n, top_k)
    implementation("router_topk", Backend.REFERENCE)(logits, bias, top_k, 2.5, ids_ref, w_ref)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=triton_device)
    weights = torch.empty(n, top_k, device=triton_device)
    implementation("router_topk", Backend.NVIDIA)(
        logits.to(triton_device), bias.to(triton_device), top_k, 2.5, ids, weights
    )
    assert torch.equal(ids.cpu(), ids_ref)
    assert_close(weights.cpu(), w_ref, rtol=2.0**-20, atol=0.0)


def test_router_ties_go_to_the_lower_expert(triton_device: str) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -30.0]])
    bias = torch.zeros(6)
    for backend, device in ((Backend.REFERENCE, "cpu"), (Backend.NVIDIA, triton_device)):
        ids = torch.empty(1, 4, dtype=torch.int64, device=device)
        weights = torch.empty(1, 4, device=device)
        implementation("router_topk", backend)(logits.to(device), bias.to(device), 4, 1.0, ids, weights)
        assert ids.cpu().tolist() == [[1, 2, 4, 0]], backend
        assert abs(float(weights.sum()) - 1.0) < 1e-6


def test_reference_swiglu_formula() -> None:
    t = torch.tensor([[30.0, -2.0, 30.0, 50.0]])
    out = dk.swiglu_clamped(t, 10.0, torch.tensor([0.5]))
    gate = torch.tensor([10.0, -2.0])
    assert_close(out[0], gate * torch.sigmoid(gate) * torch.tensor([10.0, 10.0]) * 0.5, rtol=1e-6, atol=0.0)
    assert torch.equal(dk.swiglu_clamped(t, None)[0, 0], torch.tensor(30.0) / (1 + torch.exp(torch.tensor(-30.0))) * 30)


def test_public_op_checks() -> None:
    with pytest.raises(ValueError, match="even width"):
        dk.swiglu_clamped(torch.ones(2, 3), None)
    with pytest.raises(ValueError, match="limit"):
        dk.swiglu_clamped(torch.ones(2, 4), -1.0)
    with pytest.raises(ValueError, match="row_weight must have shape"):
        dk.swiglu_clamped(torch.ones(2, 4), None, torch.ones(3))
    with pytest.raises(TypeError, match="t has dtype"):
        dk.swiglu_clamped(torch.ones(2, 4, dtype=torch.float16), None)
    assert dk.swiglu_clamped(torch.ones(0, 4), 1.0).shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        dk.router_topk(torch.ones(2, 4), torch.zeros(4), 5, 1.0)
    with pytest.raises(ValueError, match="bias must have shape"):
        dk.router_topk(torch.ones(2, 4), torch.zeros(3), 2, 1.0)
    with pytest.raises(TypeError, match="logits has dtype"):
        dk.router_topk(torch.ones(2, 4, dtype=torch.bfloat16), torch.zeros(4), 2, 1.0)
    ids, weights = dk.router_topk(torch.ones(0, 4), torch.zeros(4), 2, 1.0)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)
