"""``batch_invariant_ops``: inside it a row's result is bit-identical alone and inside a batch, and equals the op
evaluated in FP64 and rounded once (the reference, exact: tolerance 0); ops outside ``INVARIANT_OPS`` and FP64 inputs
run unchanged; in-place, ``out=`` and ``dtype=`` forms keep their contracts; off, the mode is not entered."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels.batch_invariant import BatchInvariantOps, batch_invariant_ops
from deepinfer_kernels.testing import assert_bitwise_equal, random_normal

Op = Callable[[torch.Tensor], torch.Tensor]

# Row-wise ops: each output row depends on its input row only.
ROW_OPS: dict[str, Op] = {
    "matmul": lambda x: x @ random_normal((x.shape[-1], 24), seed=1).to(x.dtype),
    "linear": lambda x: F.linear(x, random_normal((24, x.shape[-1]), seed=2).to(x.dtype)),
    "einsum": lambda x: torch.einsum("nk,ok->no", x, random_normal((24, x.shape[-1]), seed=3).to(x.dtype)),
    "sum": lambda x: x.sum(dim=-1, keepdim=True),
    "mean": lambda x: x.mean(dim=-1, keepdim=True),
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "log_softmax": lambda x: F.log_softmax(x, dim=-1),
    "logsumexp": lambda x: torch.logsumexp(x, dim=-1, keepdim=True),
    "exp": torch.exp,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "log1p": lambda x: torch.log1p(x.abs()),
    "cos": torch.cos,
    "sin": torch.sin,
    "rsqrt": lambda x: torch.rsqrt(x.abs() + 1),
    "pow": lambda x: x.abs() ** 0.75,
}


@pytest.mark.parametrize("name", sorted(ROW_OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [4, 257, 4096])
def test_a_row_alone_equals_the_row_inside_a_batch(name: str, dtype: torch.dtype, width: int) -> None:
    op = ROW_OPS[name]
    batch = random_normal((16, width), seed=width, dtype=dtype, std=2.0)
    with batch_invariant_ops():
        together = op(batch)
        for row in (0, 7, 15):
            assert_bitwise_equal(op(batch[row : row + 1]), together[row : row + 1], f"{name} row {row}")
    assert together.dtype == op(batch).dtype


@pytest.mark.parametrize("name", ["matmul", "sum", "exp", "softmax", "sigmoid"])
def test_the_result_is_the_fp64_value_rounded_once(name: str) -> None:
    x = random_normal((5, 96), seed=11, std=3.0)
    expected = ROW_OPS[name](x.double()).float()
    with batch_invariant_ops():
        actual = ROW_OPS[name](x)
    assert_bitwise_equal(actual, expected, name)


def test_other_ops_and_fp64_inputs_run_unchanged() -> None:
    x = random_normal((8, 33), seed=5, std=3.0)
    wide = x.double()
    with batch_invariant_ops():
        assert_bitwise_equal(x * 3.0 + x / 7.0, x * 3.0 + x / 7.0)
        sums = wide.sum(dim=-1)
        sorted_values = torch.sort(x, dim=-1).values
    assert_bitwise_equal(sums, wide.sum(dim=-1))
    assert_bitwise_equal(sorted_values, torch.sort(x, dim=-1).values)
    assert sums.dtype == torch.float64


def test_in_place_out_and_dtype_forms() -> None:
    x = random_normal((3, 40), seed=6, std=2.0)
    expected = torch.exp(x.double()).float()
    target = x.clone()
    out = torch.empty_like(x)
    with batch_invariant_ops():
        returned = target.exp_()
        torch.exp(x, out=out)
        probabilities = torch.softmax(x.bfloat16(), dim=-1, dtype=torch.float32)
        sums = x.bfloat16().sum(dim=-1, dtype=torch.float32)
        rotation = torch.polar(torch.ones_like(x), x)
    assert returned is target
    assert_bitwise_equal(target, expected)
    assert_bitwise_equal(out, expected)
    assert probabilities.dtype == torch.float32 and sums.dtype == torch.float32
    assert_bitwise_equal(probabilities, torch.softmax(x.bfloat16().double(), dim=-1).float())
    assert_bitwise_equal(sums, x.bfloat16().double().sum(dim=-1).float())
    assert rotation.dtype == torch.complex64
    assert_bitwise_equal(rotation.real, torch.cos(x.double()).float())


def test_disabled_enters_no_mode() -> None:
    with batch_invariant_ops(enabled=False):
        assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    with batch_invariant_ops():
        assert isinstance(torch.utils._python_dispatch._get_current_dispatch_mode(), BatchInvariantOps)
