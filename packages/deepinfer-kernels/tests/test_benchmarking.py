"""`cuda_time_ms`: argument errors everywhere; on CUDA (gpu-marked) graph replay for capturable ops and the eager
fallback for ops that synchronize with the host."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels.benchmarking import cuda_time_ms


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        cuda_time_ms(lambda: None, repeats=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capturable_ops_are_replayed_and_syncing_ops_run_eagerly() -> None:
    x = torch.randn(256, 256, device="cuda")
    ms, graphed = cuda_time_ms(lambda: torch.mm(x, x), warmup=1, repeats=3)
    assert graphed and ms > 0
    ms, graphed = cuda_time_ms(lambda: x.sum().item(), warmup=1, repeats=3)  # .item() cannot be captured
    assert not graphed and ms > 0
