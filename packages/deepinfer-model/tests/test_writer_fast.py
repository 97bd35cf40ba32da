"""The writer's fast path for real-width checkpoints: MXFP4 experts drawn in stored form, shards written by several
threads. The files keep the released format (the strict loader reads them), do not depend on the number of workers,
and the experts keep the default draw's scale of values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from deepinfer_kernels import dequantize_mxfp4
from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.cli import main
from deepinfer_model.config import load_preset
from deepinfer_model.loading.load import load_checkpoint_dir


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_fast_checkpoint_loads_and_keeps_the_weight_scale(tmp_path: Path) -> None:
    config = load_preset("tiny")
    one = write_checkpoint(config, tmp_path / "one", seed=3, max_shard_bytes=2_000_000, fast_experts=True)
    three = write_checkpoint(
        config, tmp_path / "three", seed=3, max_shard_bytes=2_000_000, fast_experts=True, num_workers=3
    )
    assert len(list(one.glob("*.safetensors"))) > 3
    assert _files(one) == _files(three)
    fast = load_checkpoint_dir(one).tensors
    default = load_checkpoint_dir(write_checkpoint(config, tmp_path / "default", seed=3)).tensors
    assert fast.keys() == default.keys()
    for name in ("layers.0.ffn.experts.3.w1.weight", "layers.5.ffn.experts.0.w2.weight"):
        stem = name[: -len(".weight")]
        assert fast[name].dtype == torch.int8 and fast[f"{stem}.scale"].dtype == torch.float8_e8m0fnu
        assert fast[name].shape == default[name].shape
        assert not torch.equal(fast[name], default[name])
        assert fast[f"{stem}.scale"].view(torch.uint8).unique().numel() == 1
        fast_std = float(dequantize_mxfp4(fast[name], fast[f"{stem}.scale"]).std())
        in_features = fast[name].shape[1] * 2
        # The power-of-two scale lands within a factor sqrt(2) of the target in^-0.5.
        assert abs(math.log2(fast_std * in_features**0.5)) <= 0.5 + 0.05
    for name in ("embed.weight", "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"):
        assert torch.equal(fast[name], default[name])


def test_num_workers_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_workers must be a positive int, got 0"):
        write_checkpoint(load_preset("tiny"), tmp_path, num_workers=0)


def test_cli_fast_experts_prints_size_and_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    argv = ["write-checkpoint", "--config", "tiny", "--out", str(out), "--fast-experts", "--workers", "2"]
    assert main(argv) == 0
    assert "12,153,272 bytes (seed 0); 0.01 GB, 12,946,056 parameters" in capsys.readouterr().out
    assert main(["inspect", "--model", str(out)]) == 0
