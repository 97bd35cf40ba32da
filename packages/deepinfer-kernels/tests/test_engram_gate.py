"""engram_gate: the public op's contract and validation; the Triton kernel (interpreter on CPU, compiled on CUDA)
against the reference on fresh random inputs.

Tolerance: the two sum the three FP32 dot products in different orders (torch's vs fixed column chunks), which moves
z by a few FP32 ulps of Σ|terms|; the gate (a sigmoid of a square root) moves less than z, and the output is rounded
once to BF16, so outputs agree to one BF16 ulp of the output's magnitude (and exactly where the rounding does not
flip). The bound used: |a − b| ≤ 2^−7 · |b| + 2^−7 · |g·v| (one BF16 ulp of the result plus one of the update).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation
from deepinfer_kernels.testing import random_normal


def _inputs(tokens: int, streams: int, hidden: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    g = torch.Generator().manual_seed(seed)
    kv = random_normal((tokens, streams + 1, hidden), seed=seed, dtype=torch.bfloat16)
    return {
        "trunk": random_normal((tokens, streams, hidden), seed=seed + 1, dtype=dtype),
        "keys": kv[:, :streams],  # a strided view, as the model passes it
        "value": kv[:, streams],
        "q_weight": (1 + 0.1 * torch.randn(streams, hidden, generator=g)).to(torch.bfloat16),
        "k_weight": (1 + 0.1 * torch.randn(streams, hidden, generator=g)).to(torch.bfloat16),
        "active": torch.rand(tokens, generator=g) < 0.8,
        "eps": 1e-6,
    }


def _run(backend: Backend, device: str, args: dict) -> torch.Tensor:
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = torch.empty(args["trunk"].shape, dtype=args["trunk"].dtype, device=device)
    implementation("engram_gate", backend)(**moved, out=out)
    return out.cpu()


def _update_magnitude(args: dict) -> torch.Tensor:
    """|g·v| ≤ |v| (the gate lies in (0, 1)), broadcast over the streams."""
    return args["value"].float().abs()[:, None, :].expand(args["trunk"].shape)


@pytest.mark.parametrize(
    ("tokens", "streams", "hidden", "dtype"), [(5, 4, 1024, torch.bfloat16), (3, 3, 700, torch.float32)]
)
def test_triton_matches_the_reference(
    triton_device: str, tokens: int, streams: int, hidden: int, dtype: torch.dtype
) -> None:
    args = _inputs(tokens, streams, hidden, seed=tokens + hidden, dtype=dtype)
    fast = _run(Backend.NVIDIA, triton_device, args)
    ref = _run(Backend.REFERENCE, "cpu", args)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    bound = ulp * ref.float().abs() + ulp * _update_magnitude(args)
    assert torch.all((fast.float() - ref.float()).abs() <= bound)
    inactive = ~args["active"]
    assert torch.equal(fast[inactive], args["trunk"][inactive])  # untouched, bit for bit
    assert not torch.equal(fast[args["active"]], args["trunk"][args["active"]])


def test_triton_token_does_not_depend_on_the_batch(triton_device: str) -> None:
    """A token's streams alone equal the same token inside a batch of 9, bit for bit (fixed per-token order)."""
    args = _inputs(9, 4, 1536, seed=3)
    together = _run(Backend.NVIDIA, triton_device, args)
    for t in (0, 6):
        alone = {
            k: (v[t : t + 1] if isinstance(v, torch.Tensor) and k not in ("q_weight", "k_weight") else v)
            for k, v in args.items()
        }
        assert torch.equal(_run(Backend.NVIDIA, triton_device, alone)[0], together[t])


@pytest.mark.parametrize("backend", [Backend.REFERENCE, Backend.NVIDIA])
def test_zero_dot_counts_as_positive(backend: Backend, triton_device: str) -> None:
    """z = +0 (a zero key) gives g = sigmoid(+1e−3), the documented sign at zero."""
    args = _inputs(2, 2, 256, seed=8)
    args["keys"] = torch.zeros_like(args["keys"])
    args["active"] = torch.ones(2, dtype=torch.bool)
    args["trunk"] = args["trunk"].float()
    out = _run(backend, triton_device if backend is Backend.NVIDIA else "cpu", args)
    gate = torch.sigmoid(torch.tensor(1e-3))
    expected = args["trunk"] + gate * args["value"].float()[:, None, :]
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)


def test_public_op_runs_the_session_backend(op_device: str) -> None:
    args = _inputs(4, 4, 512, seed=11)
    moved = {k: (v.to(op_device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = dk.engram_gate(**moved)
    assert out.shape == args["trunk"].shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    ref = _run(Backend.REFERENCE, "cpu", args)
    bound = 2.0**-7 * ref.float().abs() + 2.0**-7 * _update_magnitude(args)
    assert torch.all((out.cpu().float() - ref.float()).abs() <= bound)
    empty = {
        k: (v[:0] if isinstance(v, torch.Tensor) and k not in ("q_weight", "k_weight") else v) for k, v in moved.items()
    }
    assert dk.engram_gate(**empty).shape == (0, 4, 512)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"trunk": torch.zeros(4, 4, 512, dtype=torch.float16)}, TypeError, "trunk has dtype torch.float16"),
        ({"keys": torch.zeros(4, 3, 512)}, ValueError, r"keys must have shape \(4, 4, 512\)"),
        ({"value": torch.zeros(4, 511)}, ValueError, r"value must have shape \(4, 512\)"),
        ({"active": torch.ones(4, dtype=torch.int64)}, TypeError, "active has dtype torch.int64"),
        ({"eps": 0.0}, ValueError, "eps must be a positive finite float"),
        ({"trunk": torch.zeros(4, 512)}, ValueError, r"trunk must have shape \[T, m, H\]"),
    ],
)
def test_validation_names_the_argument(change: dict, error: type, message: str) -> None:
    args = {**_inputs(4, 4, 512, seed=12), **change}
    with pytest.raises(error, match=message):
        dk.engram_gate(**args)
