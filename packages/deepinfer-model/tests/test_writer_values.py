"""Checkpoint writer with given FP32 values (a trained model): every weight is stored exactly as the random path
stores its draw, the given tokenizer is shipped, and a values map that misses or adds a weight is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_writer import micro_config
from tokenizers import Tokenizer

from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import logical_value, stored_pair, tensor_pair, write_checkpoint
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.loading.load import load_checkpoint_dir


def _values(seed: int) -> dict[str, torch.Tensor]:
    config = micro_config()
    return {
        e.name: logical_value(e, config, seed) for e in build_catalogue(config) if e.format is not TensorFormat.SCALE
    }


def test_given_values_round_trip_like_the_random_path(tmp_path: Path) -> None:
    config = micro_config()
    values = _values(seed=4)
    given = write_checkpoint(config, tmp_path / "given", values=values, max_shard_bytes=300_000)
    random = write_checkpoint(config, tmp_path / "random", seed=4, max_shard_bytes=300_000)
    assert (given / "model.safetensors.index.json").read_bytes() == (
        random / "model.safetensors.index.json"
    ).read_bytes()
    for shard in sorted(random.glob("*.safetensors")):
        assert (given / shard.name).read_bytes() == shard.read_bytes()
    loaded = load_checkpoint_dir(given).tensors
    for entry in build_catalogue(config):
        if entry.format is not TensorFormat.SCALE:
            for name, tensor in stored_pair(entry, values[entry.name]):
                assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
            assert stored_pair(entry, values[entry.name])[0][1].dtype == tensor_pair(entry, config, 4)[0][1].dtype


def test_given_tokenizer_is_shipped(tmp_path: Path) -> None:
    config = micro_config()
    tokenizer = build_tokenizer(config, ["12+7=19\n", "count 3 to 7:3 4 5 6 7\n"] * 50, split_digits=True)
    directory = write_checkpoint(config, tmp_path, values=_values(seed=1), tokenizer=tokenizer)
    shipped = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert json.loads(shipped.to_str()) == json.loads(tokenizer.to_str())
    assert shipped.encode("345+12=", add_special_tokens=False).tokens == ["3", "4", "5", "+", "1", "2", "="]


def test_values_must_name_every_weight(tmp_path: Path) -> None:
    values = _values(seed=2)
    values.pop("embed.weight")
    values["not.a.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['embed.weight'\], unknown \['not.a.weight'\]"):
        write_checkpoint(micro_config(), tmp_path, values=values)


def test_a_value_of_the_wrong_shape_is_refused() -> None:
    entry = next(e for e in build_catalogue(micro_config()) if e.format is TensorFormat.FP8_BLOCK)
    with pytest.raises(ValueError, match="expected"):
        stored_pair(entry, torch.zeros(3, 3))
