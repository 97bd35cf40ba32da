"""mHC ops: Triton (interpreter on CPU, or CUDA) vs reference on fresh seeded inputs, reference properties, wrapper
checks.

Tolerances: the read and the post run the reference's FP32 operations in its order, so they must be bitwise equal.
The mixes sum ``z²`` and the mix GEMM (``m·H`` products) in another FP32 order, and ``exp`` may differ in its last
bits: the logits move by about 1e−6 at these scales (measured on the H200: 9.5e−7 in a read mix at H = 256), so the
read, write and comb mixes (values in [0, 2]) are held to atol 2e−5.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.batch_invariant import batch_invariant_ops
from deepinfer_kernels.reference.hyper_connection import round_to_tf32
from deepinfer_kernels.testing import assert_bitwise_equal, assert_close, random_normal

# (2, 4, 1280): ten 512-column splits of m·H, which the mixes kernel loads eight at a time.
_SHAPES = [(1, 4, 32), (5, 4, 160), (3, 3, 40), (17, 4, 64), (2, 4, 1280)]


def _mix_inputs(n: int, m: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    rows = (2 + m) * m
    trunk = random_normal((n, m, hidden), seed=seed, dtype=dtype, std=2.0)
    fn = random_normal((rows, m * hidden), seed=seed + 1, dtype=torch.float32, std=0.05)
    scale = random_normal((3,), seed=seed + 2, dtype=torch.float32, std=1.0).abs() + 0.5
    base = random_normal((rows,), seed=seed + 3, dtype=torch.float32, std=0.5)
    return trunk, fn, scale, base


def _run_mixes(backend: Backend, device: str, inputs: tuple[torch.Tensor, ...], tf32: bool) -> list[torch.Tensor]:
    trunk = inputs[0]
    n, m = trunk.shape[:2]
    outs = [torch.empty(shape, device=device) for shape in ((n, m), (n, m), (n, m, m))]
    impl = implementation("hc_mixes", backend)
    impl(*(t.to(device) for t in inputs), 1e-6, 1e-6, 20, tf32, *outs)
    return [o.cpu() for o in outs]


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize(("n", "m", "hidden"), _SHAPES)
@pytest.mark.parametrize(("dtype", "tf32"), [(torch.bfloat16, True), (torch.float32, False)])
def test_hc_mixes_triton_parity(
    triton_device: str, n: int, m: int, hidden: int, dtype: torch.dtype, tf32: bool, invariant: bool
) -> None:
    """Both mix-logits kernels: up to 16 tokens the per-token programs; beyond, the 64-token tiles, or in the
    batch-invariant mode the token kernel with blocks of tokens."""
    inputs = _mix_inputs(n, m, hidden, dtype, seed=n * 100 + hidden)
    expected = _run_mixes(Backend.REFERENCE, "cpu", inputs, tf32)
    with batch_invariant_ops(invariant):
        actual = _run_mixes(Backend.NVIDIA, triton_device, inputs, tf32)
    for name, a, e in zip(("read mix", "write mix", "comb"), actual, expected, strict=True):
        assert_close(a, e, rtol=0.0, atol=2e-5, message=name)


@pytest.mark.parametrize(("n", "m", "hidden"), [(1, 4, 32), (5, 4, 160), (3, 3, 40), (2, 4, 1280)])
def test_token_programs_finish_the_mixes_as_the_mixes_kernel(triton_device: str, n: int, m: int, hidden: int) -> None:
    """Up to 16 tokens the per-token programs finish the mixes themselves (each token's last program): bit for bit
    what ``_mixes_kernel`` makes of the partials they leave, and the tickets are back at zero (a CUDA graph replays
    the launch)."""
    import triton

    from deepinfer_kernels.cuda import hyper_connection as hc
    from deepinfer_kernels.cuda.gemm_operands import split_counters

    trunk, fn, scale, base = (t.to(triton_device) for t in _mix_inputs(n, m, hidden, torch.bfloat16, seed=n + 7))
    width, rows, block_mm = m * hidden, fn.shape[0], triton.next_power_of_2(m)
    splits, block_r = triton.cdiv(width, hc._CHUNK), max(16, triton.next_power_of_2(rows))
    part = torch.empty((splits, n, block_r), device=triton_device)
    sum_sq = torch.empty((splits, n), device=triton_device)
    fused = [torch.full(shape, float("nan"), device=triton_device) for shape in ((n, m), (n, m), (n, m, m))]
    tickets = split_counters(trunk.device, n)
    constexprs = {
        "SPLITS": splits, "M": m, "BLOCK_MM": block_mm, "BLOCK_R": block_r, "POST_MULT": hc.HC_POST_MULT, "PDL": False
    }  # fmt: skip
    hc._token_mixes_kernel[(n, splits)](
        trunk, fn, part, sum_sq, tickets, scale, base, *fused, n, width, rows, 1, 1e-6, 1e-6, 20, CHUNK=hc._CHUNK,
        TF32=True, TOKENS=1, **constexprs, enable_fp_fusion=False,
    )  # fmt: skip
    separate = [torch.full_like(out, float("nan")) for out in fused]
    hc._mixes_kernel[(n,)](
        part, sum_sq, scale, base, *separate, n, float(width), 1e-6, 1e-6, 20, **constexprs,
        enable_fp_fusion=False,
    )  # fmt: skip
    for name, a, b in zip(("read mix", "write mix", "comb"), fused, separate, strict=True):
        assert not a.isnan().any(), name
        assert_bitwise_equal(a.cpu(), b.cpu(), message=name)
    assert not tickets[:n].any()


@pytest.mark.parametrize("n", [12, 21])
def test_invariant_mixes_of_a_token_do_not_depend_on_the_call(triton_device: str, n: int) -> None:
    """In the batch-invariant mode every call gives each program a block of 8 tokens: a token's mixes alone (its
    programs finish them) are its bits at the first, second, a middle and the last place of a 12- and a 21-token call
    (the mixes kernel after the programs; the last block partial). The GPU twin is test_gpu_fused_ops.py's 130-token
    test."""
    m, hidden = 4, 160
    trunk, fn, scale, base = _mix_inputs(n, m, hidden, torch.bfloat16, seed=n + 11)
    with batch_invariant_ops():
        together = _run_mixes(Backend.NVIDIA, triton_device, (trunk, fn, scale, base), True)
        for row in (0, 1, n // 2, n - 1):
            alone = _run_mixes(Backend.NVIDIA, triton_device, (trunk[row : row + 1], fn, scale, base), True)
            for name, a, b in zip(("read mix", "write mix", "comb"), alone, together, strict=True):
                assert_bitwise_equal(a[0], b[row], message=f"{name}, token {row}")


@pytest.mark.parametrize(("n", "m", "hidden"), _SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_read_and_post_triton_bitwise(triton_device: str, n: int, m: int, hidden: int, dtype: torch.dtype) -> None:
    seed = n * 100 + hidden
    trunk = random_normal((n, m, hidden), seed=seed, dtype=dtype, std=2.0)
    y = random_normal((n, hidden), seed=seed + 1, dtype=dtype)
    mix = random_normal((n, m), seed=seed + 2, dtype=torch.float32)
    comb = random_normal((n, m, m), seed=seed + 3, dtype=torch.float32).abs()
    for op, inputs, shape in (("hc_read", (trunk, mix), (n, hidden)), ("hc_post", (y, trunk, mix, comb), trunk.shape)):
        expected = torch.empty(shape, dtype=dtype)
        implementation(op, Backend.REFERENCE)(*inputs, expected)
        actual = torch.empty(shape, dtype=dtype, device=triton_device)
        implementation(op, Backend.NVIDIA)(*(t.to(triton_device) for t in inputs), actual)
        assert_bitwise_equal(actual.cpu(), expected, message=op)


def test_reference_mixes_properties() -> None:
    trunk, fn, scale, base = _mix_inputs(6, 4, 32, torch.bfloat16, seed=7)
    read, write, comb = dk.hc_mixes(trunk, fn, scale, base, 1e-6, 1e-6, 20, True)
    assert bool((read > 0).all() and (read <= 1 + 1e-6).all() and (write > 0).all() and (write < 2).all())
    # Twenty Sinkhorn iterations leave the comb doubly stochastic up to the eps terms.
    assert_close(comb.sum(dim=-1), torch.ones(6, 4), rtol=0.0, atol=1e-3)
    assert_close(comb.sum(dim=-2), torch.ones(6, 4), rtol=0.0, atol=1e-5)
    logits = dk.hc_mix_logits(trunk, fn, 1e-6, True)
    z = trunk.reshape(6, -1).double()
    # The weights rounded to TF32 (the BF16 trunk is exact there), everything else exact: FP32 sums only.
    exact = (z @ round_to_tf32(fn).double().t()) / torch.sqrt((z * z).mean(dim=-1, keepdim=True) + 1e-6)
    assert_close(logits, exact, rtol=1e-5, atol=1e-6)


def test_reference_read_and_post_with_hand_made_mixes() -> None:
    trunk = random_normal((2, 4, 8), seed=1, dtype=torch.bfloat16)
    one_hot = torch.zeros(2, 4)
    one_hot[:, 2] = 1.0
    assert torch.equal(dk.hc_read(trunk, one_hot, torch.bfloat16), trunk[:, 2])
    y = random_normal((2, 8), seed=2, dtype=torch.bfloat16)
    identity = torch.eye(4).expand(2, 4, 4).contiguous()
    out = dk.hc_post(y, trunk, torch.zeros(2, 4), identity, torch.float32)
    assert torch.equal(out, trunk.float())


def test_public_ops_empty_and_checks() -> None:
    trunk, fn, scale, base = _mix_inputs(0, 4, 8, torch.bfloat16, seed=3)
    read, write, comb = dk.hc_mixes(trunk, fn, scale, base, 1e-6, 1e-6, 1, True)
    assert read.shape == (0, 4) and write.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert dk.hc_read(trunk, torch.empty(0, 4), torch.bfloat16).shape == (0, 8)
    trunk, fn, scale, base = _mix_inputs(2, 4, 8, torch.bfloat16, seed=4)
    with pytest.raises(ValueError, match="fn must have shape"):
        dk.hc_mixes(trunk, fn[:, :-1], scale, base, 1e-6, 1e-6, 20, True)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        dk.hc_mixes(trunk, fn, scale, base, 1e-6, 1e-6, 0, True)
    with pytest.raises(ValueError, match="hc_eps"):
        dk.hc_mixes(trunk, fn, scale, base, 1e-6, float("nan"), 20, True)
    with pytest.raises(TypeError, match="trunk has dtype"):
        dk.hc_mixes(trunk.half(), fn, scale, base, 1e-6, 1e-6, 20, True)
    with pytest.raises(ValueError, match="trunk must be"):
        dk.hc_read(trunk[0], torch.ones(2, 4), torch.bfloat16)
    with pytest.raises(ValueError, match="read_mix must have shape"):
        dk.hc_read(trunk, torch.ones(2, 3), torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        dk.hc_read(trunk, torch.ones(2, 4), torch.float16)
    with pytest.raises(ValueError, match="output must have shape"):
        dk.hc_post(torch.ones(2, 7, dtype=torch.bfloat16), trunk, torch.ones(2, 4), torch.ones(2, 4, 4), torch.bfloat16)
    with pytest.raises(ValueError, match="comb must have shape"):
        dk.hc_post(torch.ones(2, 8, dtype=torch.bfloat16), trunk, torch.ones(2, 4), torch.ones(2, 4, 3), torch.bfloat16)
