"""Peak host memory while loading stays within 1.3x the checkpoint size (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from deepinfer_model.checkpoint.tokenizer import tokenizer_config, tokenizer_json
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.loading.catalogue import build_catalogue
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, write_shard

PROBE = textwrap.dedent(
    """
    import sys
    import tokenizers  # imported up front so that only the load itself is measured
    from deepinfer_model.loading.load import load_checkpoint_dir

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = status("VmRSS")
    loaded = load_checkpoint_dir(sys.argv[1])
    print(before, status("VmHWM"), loaded.num_bytes)
    """
)


def large_config() -> ModelConfig:
    """The tiny preset with 64 wider experts: about 100 MB, dominated by MXFP4 expert bytes."""
    data: dict[str, Any] = json.loads(preset_json("tiny"))
    data["text_config"].update(n_routed_experts=64, moe_intermediate_size=512)
    return ModelConfig.from_dict(data)


def write_random_bytes_checkpoint(config: ModelConfig, out: Path) -> int:
    """A structurally valid checkpoint whose tensors hold random bytes (the loader never interprets values)."""
    out.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for entry in build_catalogue(config):
        raw = torch.randint(0, 256, (entry.num_bytes,), dtype=torch.uint8, generator=gen)
        tensors[entry.name] = raw.view(SAFETENSORS_TO_TORCH[entry.dtype]).view(entry.shape)
    total = write_shard(out / "model.safetensors", tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    (out / "tokenizer.json").write_text(tokenizer_json(config))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config)))
    return total


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_within_1_3x_of_checkpoint(tmp_path: Path) -> None:
    size = write_random_bytes_checkpoint(large_config(), tmp_path / "ckpt")
    assert size > 80_000_000
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "ckpt")], capture_output=True, text=True, check=True, timeout=120
    )
    before, peak, loaded = (int(v) for v in result.stdout.split())
    assert loaded == size  # every stored byte is kept exactly once
    assert peak - before <= 1.3 * size, f"load grew resident memory by {(peak - before) / size:.2f}x the checkpoint"
