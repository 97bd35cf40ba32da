"""The fused small-op Triton kernels (mHC, SwiGLU, router) compiled for a CUDA device (skipped without one) vs the
reference on the CPU, at the model's shapes (m = 4; H = 256 of the tiny preset, 5120 of v41-flash; decode and prefill
token counts; 256 experts, top 6).

Tolerances as test_hyper_connection.py and test_moe_small_ops.py: mHC read and post bitwise; mixes within atol 2e−5,
from the FP32 summation order of the mix GEMM and the device's ``exp``; SwiGLU within rtol 2^−18 (Triton's ``exp`` on
the GPU is off by up to about 2^−20 relative: 1.03 · 2^−20 was seen on the H200); router weights within rtol 2^−20,
router ids equal.
"""

from __future__ import annotations

import pytest
import torch
from _gpu_marks import COMPILED_TRITON_ON_GPU

from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.dependent_launch import dependent_launches
from deepinfer_kernels.testing import assert_bitwise_equal, assert_close, random_normal

pytestmark = COMPILED_TRITON_ON_GPU

_SHAPES = [(1, 256), (64, 256), (1, 5120), (16, 5120), (64, 5120), (777, 5120)]


@pytest.mark.parametrize(("n", "hidden"), _SHAPES)
@pytest.mark.parametrize(("dtype", "tf32"), [(torch.bfloat16, True), (torch.float32, False)])
def test_hc_mixes_gpu(n: int, hidden: int, dtype: torch.dtype, tf32: bool) -> None:
    m, rows = 4, 24
    inputs = (
        random_normal((n, m, hidden), seed=n, dtype=dtype, std=2.0),
        random_normal((rows, m * hidden), seed=n + 1, dtype=torch.float32, std=0.05),
        random_normal((3,), seed=n + 2, dtype=torch.float32).abs() + 0.5,
        random_normal((rows,), seed=n + 3, dtype=torch.float32, std=0.5),
    )
    shapes = ((n, m), (n, m), (n, m, m))
    expected = [torch.empty(s) for s in shapes]
    implementation("hc_mixes", Backend.REFERENCE)(*inputs, 1e-6, 1e-6, 20, tf32, *expected)
    actual = [torch.empty(s, device="cuda") for s in shapes]
    implementation("hc_mixes", Backend.NVIDIA)(*(t.cuda() for t in inputs), 1e-6, 1e-6, 20, tf32, *actual)
    for name, a, e in zip(("read mix", "write mix", "comb"), actual, expected, strict=True):
        assert_close(a.cpu(), e, rtol=0.0, atol=2e-5, message=name)


@pytest.mark.parametrize(("dtype", "tf32"), [(torch.bfloat16, True), (torch.float32, False)])
def test_hc_mixes_rows_keep_their_bits_in_any_batch(dtype: torch.dtype, tf32: bool) -> None:
    """In the batch-invariant mode a token's mixes are the same bits alone (its programs finish the mixes) and at every
    position of a 130-token call (blocks of 8 tokens a program, a partial last block, then the mixes kernel)."""
    m, rows, hidden, n = 4, 24, 5120, 130
    trunk = random_normal((n, m, hidden), seed=40, dtype=dtype, std=2.0).cuda()
    weights = (
        random_normal((rows, m * hidden), seed=41, dtype=torch.float32, std=0.05).cuda(),
        (random_normal((3,), seed=42, dtype=torch.float32).abs() + 0.5).cuda(),
        random_normal((rows,), seed=43, dtype=torch.float32, std=0.5).cuda(),
    )

    def mixes(tokens: torch.Tensor) -> list[torch.Tensor]:
        count = tokens.shape[0]
        out = [torch.empty(s, device="cuda") for s in ((count, m), (count, m), (count, m, m))]
        implementation("hc_mixes", Backend.NVIDIA)(tokens, *weights, 1e-6, 1e-6, 20, tf32, *out)
        return out

    with batch_invariant_ops():
        together = mixes(trunk)
        for row in range(n):
            for alone, batch in zip(mixes(trunk[row : row + 1]), together, strict=True):
                assert torch.equal(alone[0], batch[row]), row


@pytest.mark.parametrize("n", [1, 16])
def test_hc_mixes_keep_their_bits_under_dependent_launches(n: int) -> None:
    """Under a dependent launch the per-token mixes kernel asks L2 for its fn tile before its wait, while the post
    that writes its trunk still runs: the same bits as ordinary launches."""
    m, rows, hidden = 4, 24, 5120
    source = random_normal((n, m, hidden), seed=50, dtype=torch.bfloat16, std=2.0).cuda()
    output = random_normal((n, hidden), seed=51, dtype=torch.bfloat16).cuda()
    write, comb = torch.full((n, m), 0.5, device="cuda"), torch.full((n, m, m), 0.25, device="cuda")
    weights = (
        random_normal((rows, m * hidden), seed=52, dtype=torch.float32, std=0.05).cuda(),
        (random_normal((3,), seed=53, dtype=torch.float32).abs() + 0.5).cuda(),
        random_normal((rows,), seed=54, dtype=torch.float32, std=0.5).cuda(),
    )

    def mixes() -> list[torch.Tensor]:
        trunk = torch.empty_like(source)
        implementation("hc_post", Backend.NVIDIA)(output, source, write, comb, trunk)
        out = [torch.empty(s, device="cuda") for s in ((n, m), (n, m), (n, m, m))]
        implementation("hc_mixes", Backend.NVIDIA)(trunk, *weights, 1e-6, 1e-6, 20, True, *out)
        return out

    plain = mixes()
    with dependent_launches():
        launched = mixes()
    for a, b in zip(launched, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("n", "hidden"), _SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_read_and_post_gpu_bitwise(n: int, hidden: int, dtype: torch.dtype) -> None:
    m = 4
    trunk = random_normal((n, m, hidden), seed=n, dtype=dtype, std=2.0)
    y = random_normal((n, hidden), seed=n + 1, dtype=dtype)
    mix = random_normal((n, m), seed=n + 2, dtype=torch.float32)
    comb = random_normal((n, m, m), seed=n + 3, dtype=torch.float32).abs()
    for op, inputs, shape in (("hc_read", (trunk, mix), (n, hidden)), ("hc_post", (y, trunk, mix, comb), trunk.shape)):
        expected = torch.empty(shape, dtype=dtype)
        implementation(op, Backend.REFERENCE)(*inputs, expected)
        actual = torch.empty(shape, dtype=dtype, device="cuda")
        implementation(op, Backend.NVIDIA)(*(t.cuda() for t in inputs), actual)
        assert_bitwise_equal(actual.cpu(), expected, message=op)


@pytest.mark.parametrize(("rows", "half"), [(1, 2048), (384, 2048), (6 * 777, 256), (6 * 777, 2304)])
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_gpu(rows: int, half: int, weighted: bool) -> None:
    t = random_normal((rows, 2 * half), seed=rows, dtype=torch.bfloat16, std=4.0)
    weight = random_normal((rows,), seed=rows + 1, dtype=torch.float32).abs() if weighted else None
    expected = torch.empty(rows, half)
    implementation("swiglu_clamped", Backend.REFERENCE)(t, 10.0, weight, expected)
    actual = torch.empty(rows, half, device="cuda")
    implementation("swiglu_clamped", Backend.NVIDIA)(t.cuda(), 10.0, None if weight is None else weight.cuda(), actual)
    assert_close(actual.cpu(), expected, rtol=2.0**-18, atol=1e-30)


@pytest.mark.parametrize("n", [1, 64, 777])
def test_router_gpu(n: int) -> None:
    logits = random_normal((n, 256), seed=n, dtype=torch.float32, std=8.0)
    bias = random_normal((256,), seed=n + 1, dtype=torch.float32, std=0.5)
    ids_ref, w_ref = torch.empty(n, 6, dtype=torch.int64), torch.empty(n, 6)
    implementation("router_topk", Backend.REFERENCE)(logits, bias, 6, 2.5, ids_ref, w_ref)
    ids, weights = torch.empty(n, 6, dtype=torch.int64, device="cuda"), torch.empty(n, 6, device="cuda")
    implementation("router_topk", Backend.NVIDIA)(logits.cuda(), bias.cuda(), 6, 2.5, ids, weights)
    assert torch.equal(ids.cpu(), ids_ref)
    assert_close(weights.cpu(), w_ref, rtol=2.0**-20, atol=0.0)
