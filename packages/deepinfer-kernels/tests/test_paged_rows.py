"""paged_rows: the Triton kernel (interpreter on CPU, compiled on CUDA) equals the reference on random tables, with
missing rows (−1), rows past the table and requests outside it; the public op against the formula; validation."""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk
from deepinfer_kernels._registry import Backend, implementation


def _run(backend: Backend, device: str, table: torch.Tensor, request: torch.Tensor, rows: torch.Tensor, rpb: int):
    out = torch.full(rows.shape, 7, dtype=torch.int64, device=device)
    implementation("paged_rows", backend)(table.to(device), request.to(device), rows.to(device), rpb, out)
    return out.cpu()


@pytest.mark.parametrize("shape", [(37,), (9, 130)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_triton_equals_the_reference(triton_device: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(len(shape))
    rpb, blocks = 8, 12
    table = torch.randint(0, 1000, (6, blocks), generator=generator).to(dtype)
    request = torch.randint(0, 6, (shape[0],), generator=generator).to(dtype)
    request[0] = 6  # a request past the table: every row of it is missing
    rows = torch.randint(-1, rpb * blocks + 20, shape, generator=generator).to(dtype)  # −1 and rows past the table
    fast = _run(Backend.NVIDIA, triton_device, table, request, rows, rpb)
    ref = _run(Backend.REFERENCE, "cpu", table, request, rows, rpb)
    assert torch.equal(fast, ref)
    r = rows.long().view(shape[0], -1)
    expected = torch.full(r.shape, -1, dtype=torch.int64)
    for i in range(r.shape[0]):
        for j in range(r.shape[1]):
            row, req = int(r[i, j]), int(request[i])
            if row >= 0 and row // rpb < blocks and req < table.shape[0]:
                expected[i, j] = int(table[req, row // rpb]) * rpb + row % rpb
    assert torch.equal(ref.view(shape[0], -1), expected)
    assert (ref == -1).any() and (ref >= 0).any()


def test_public_op(op_device: str) -> None:
    table = torch.tensor([[3, 5], [7, 2]], device=op_device)
    rows = torch.tensor([[0, 9, -1], [15, 4, 16]], device=op_device)
    out = dk.paged_rows(table, torch.tensor([1, 0], device=op_device), rows, 8)
    assert out.dtype == torch.int64
    assert out.cpu().tolist() == [[56, 17, -1], [47, 28, -1]]
    none = torch.zeros(0, dtype=torch.int64, device=op_device)
    assert dk.paged_rows(table, none, none.view(0, 1).expand(0, 4), 8).shape == (0, 4)
    one = torch.tensor([0], device=op_device)
    assert dk.paged_rows(table[:, :0], one, one + 3, 8).cpu().tolist() == [-1]  # a table without pages


_I64 = torch.int64
_TABLE = torch.zeros(2, 3, dtype=_I64)
_ONE = torch.zeros(1, dtype=_I64)


@pytest.mark.parametrize(
    ("table", "owners", "rows", "rpb", "error", "message"),
    [
        (torch.zeros(2, 3), _ONE, _ONE, 8, TypeError, "block_table has dtype"),
        (_TABLE, torch.zeros(2, dtype=_I64), _ONE, 8, ValueError, r"request must have shape \(1,\)"),
        (torch.zeros(3, dtype=_I64), _ONE, _ONE, 8, ValueError, r"block_table must be \[R, B\]"),
        (_TABLE, _ONE, torch.zeros(1, 2, 2, dtype=_I64), 8, ValueError, r"rows must be \[N\] or \[N, K\]"),
        (_TABLE, _ONE, _ONE, 0, ValueError, "rows_per_block must be an int >= 1"),
    ],
)
def test_validation_names_the_argument(
    table: torch.Tensor, owners: torch.Tensor, rows: torch.Tensor, rpb: int, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        dk.paged_rows(table, owners, rows, rpb)
