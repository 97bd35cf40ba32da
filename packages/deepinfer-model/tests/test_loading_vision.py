"""Vision tensors: validated from the headers, read only on request, rejected for a text-only config.

The 263 vision tensors (about 0.85 GB) live in a sparse shard whose data section is a hole, so the fast tests never
touch their bytes; reading them is the slow test.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from _spec20 import SPEC20_VISION_CONFIG

from deepinfer_model.checkpoint.tokenizer import tokenizer_config, tokenizer_json
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.loading.catalogue import CatalogueEntry, build_catalogue
from deepinfer_model.loading.errors import CoverageError
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, write_shard

VISION_SHARD = "model-vision.safetensors"
TEXT_SHARD = "model-text.safetensors"


def vision_config() -> ModelConfig:
    data: dict[str, Any] = json.loads(preset_json("tiny"))
    data["vision_config"] = dict(SPEC20_VISION_CONFIG)
    return ModelConfig.from_dict(data)


def write_sparse_shard(path: Path, entries: list[CatalogueEntry], shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid safetensors file whose data section is a hole (reads back as zeros, uses no disk)."""
    header: dict[str, Any] = {}
    offset = 0
    for entry in entries:
        shape = shapes.get(entry.name, entry.shape)
        size = 2 * int(torch.Size(shape).numel())  # every vision tensor is BF16
        header[entry.name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        f.truncate(8 + len(encoded) + offset)


def write_checkpoint_with_vision(
    out: Path, config: ModelConfig, vision_shapes: dict[str, tuple[int, ...]] | None = None
) -> None:
    out.mkdir()
    entries = build_catalogue(vision_config())
    text = [e for e in entries if not e.name.startswith(("vision.", "aligner."))]
    vision = [e for e in entries if e.name.startswith(("vision.", "aligner."))]
    gen = torch.Generator().manual_seed(0)
    tensors = {
        e.name: torch.randint(0, 256, (e.num_bytes,), dtype=torch.uint8, generator=gen)
        .view(SAFETENSORS_TO_TORCH[e.dtype])
        .view(e.shape)
        for e in text
    }
    write_shard(out / TEXT_SHARD, tensors)
    write_sparse_shard(out / VISION_SHARD, vision, vision_shapes or {})
    weight_map = {**dict.fromkeys(tensors, TEXT_SHARD), **{e.name: VISION_SHARD for e in vision}}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    (out / "tokenizer.json").write_text(tokenizer_json(config))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config)))


def test_vision_validated_but_not_read(tmp_path: Path) -> None:
    write_checkpoint_with_vision(tmp_path / "ckpt", vision_config())
    loaded = load_checkpoint_dir(tmp_path / "ckpt")
    assert loaded.vision == {}
    assert not any(name.startswith(("vision.", "aligner.")) for name in loaded.tensors)


def test_vision_wrong_shape_is_reported(tmp_path: Path) -> None:
    shapes = {"aligner.w1.weight": (256, 1024)}
    write_checkpoint_with_vision(tmp_path / "ckpt", vision_config(), shapes)
    with pytest.raises(CoverageError) as info:
        load_checkpoint_dir(tmp_path / "ckpt")
    assert info.value.wrong_shape == ["aligner.w1.weight: stored [256, 1024] expected [256, 4096]"]


def test_text_only_config_rejects_vision_tensors(tmp_path: Path) -> None:
    text_only = ModelConfig.from_dict(json.loads(preset_json("tiny")))
    write_checkpoint_with_vision(tmp_path / "ckpt", text_only)
    with pytest.raises(CoverageError) as info:
        load_checkpoint_dir(tmp_path / "ckpt")
    assert len(info.value.unexpected) == 263 and "vision.norm.weight" in info.value.unexpected


@pytest.mark.slow
def test_vision_read_on_request(tmp_path: Path) -> None:
    write_checkpoint_with_vision(tmp_path / "ckpt", vision_config())
    loaded = load_checkpoint_dir(tmp_path / "ckpt", load_vision=True)
    assert len(loaded.vision) == 263
    assert loaded.vision["vision.blocks.31.mlp.w1.weight"].shape == (5632, 1024)
    assert not loaded.vision["aligner.w2.bias"].any()
