"""Where the ranks of a parallel `LLM` run: rank r of a CUDA engine on cuda:r, CPU ranks on the CPU; a device that
cannot host the ranks fails at construction with the sizes named (no rank process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llm_support import make_llm

from deepinfer_engine.worker import rank_device


def test_rank_device() -> None:
    assert rank_device("cpu", 3) == torch.device("cpu")
    assert rank_device("cuda", 0) == torch.device("cuda", 0)
    assert rank_device("cuda", 1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"'cpu' or 'cuda'.*got 'cuda:1'"):
        rank_device("cuda:1", 0)


def test_an_indexed_cuda_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"device='cuda:1': a data-/expert-parallel engine runs on 'cpu' or 'cuda'"):
        make_llm(tmp_path, device="cuda:1", data_parallel_size=2, expert_parallel_size=2)


def test_more_ranks_than_visible_gpus_is_refused(tmp_path: Path) -> None:
    visible = torch.cuda.device_count()
    ranks = max(2, visible + 1)
    with pytest.raises(ValueError, match=rf"needs {ranks} ranks, one GPU each, but only {visible} CUDA device"):
        make_llm(tmp_path, device="cuda", data_parallel_size=ranks)
