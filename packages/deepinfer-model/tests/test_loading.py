"""Checkpoint loading: directory validation, strict coverage (one test per failure), prefix rules, resolution."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.config import load_preset
from deepinfer_model.loading.catalogue import build_catalogue
from deepinfer_model.loading.checkpoint_dir import INDEX_FILE, resolve_model_dir
from deepinfer_model.loading.errors import CheckpointError, CoverageError
from deepinfer_model.loading.load import load_checkpoint, load_checkpoint_dir
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, read_header, read_tensor_into, write_shard

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset written in three shards (the Engram tables force unit boundaries)."""
    return write_checkpoint(load_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=3, max_shard_bytes=5_000_000)


def copy_of(tiny_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, target)
    return target


def read_all(directory: Path) -> dict[str, Tensors]:
    """Every shard's tensors (in file order), read with the package's byte-range reader."""
    index = json.loads((directory / INDEX_FILE).read_text())
    out: dict[str, Tensors] = {}
    for shard in sorted(set(index["weight_map"].values())):
        header = read_header(directory / shard)
        out[shard] = {}
        with (directory / shard).open("rb") as f:
            for name, record in sorted(header.tensors.items(), key=lambda item: item[1].offset):
                tensor = torch.empty(record.shape, dtype=SAFETENSORS_TO_TORCH[record.dtype])
                read_tensor_into(f, directory / shard, name, record, tensor)
                out[shard][name] = tensor
    return out


def rewrite(directory: Path, mutate: Callable[[dict[str, Tensors]], None]) -> None:
    """Apply ``mutate`` to the shard contents, then rewrite shards and the index to match."""
    shards = read_all(directory)
    mutate(shards)
    weight_map = {}
    for shard, tensors in shards.items():
        write_shard(directory / shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def shard_of(shards: dict[str, Tensors], name: str) -> Tensors:
    return next(tensors for tensors in shards.values() if name in tensors)


def test_loads_every_text_tensor_by_hf_name_in_stored_format(tiny_dir: Path) -> None:
    loaded = load_checkpoint_dir(tiny_dir)
    t = loaded.config.text
    assert loaded.vision == {}
    expected = {e.name: e for e in build_catalogue(loaded.config) if not e.name.startswith(("vision.", "aligner."))}
    assert loaded.tensors.keys() == expected.keys()
    for name, entry in expected.items():
        assert (
            loaded.tensors[name].shape == entry.shape
            and loaded.tensors[name].dtype == SAFETENSORS_TO_TORCH[entry.dtype]
        )
    assert loaded.tensors["layers.0.ffn.experts.5.w1.weight"].shape == (128, 128)
    assert loaded.tensors["layers.0.ffn.experts.5.w1.weight"].dtype == torch.int8
    assert loaded.tensors["layers.0.ffn.experts.5.w3.scale"].dtype == torch.float8_e8m0fnu
    assert loaded.tensors["layers.2.engram.embed.weight"].shape == (t.engram_num_rows(2), 128)
    assert loaded.tensors["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert "mtp.0.embed.weight" not in loaded.tensors


def test_load_checkpoint_accepts_a_directory(tiny_dir: Path) -> None:
    assert load_checkpoint(str(tiny_dir)).path == tiny_dir


def test_missing_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    rewrite(ckpt, lambda s: shard_of(s, "layers.4.attn.wkv.scale").pop("layers.4.attn.wkv.scale"))
    with pytest.raises(CoverageError, match=r"1 missing tensors:\n  layers.4.attn.wkv.scale") as info:
        load_checkpoint_dir(ckpt)
    assert info.value.num_problems == 1


def test_unexpected_tensor(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    rewrite(ckpt, lambda s: shard_of(s, "embed.weight").update({"layers.0.attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CoverageError, match=r"1 unexpected tensors:\n  layers.0.attn.extra.weight"):
        load_checkpoint_dir(ckpt)


def test_wrong_dtype(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    name = "layers.2.attn.q_norm.weight"
    rewrite(ckpt, lambda s: shard_of(s, name).update({name: shard_of(s, name)[name].float()}))
    with pytest.raises(CoverageError, match=rf"wrong dtype:\n  {name}: stored F32 expected BF16"):
        load_checkpoint_dir(ckpt)


def test_wrong_shape(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    name = "layers.5.ffn.experts.7.w2.weight"
    rewrite(ckpt, lambda s: shard_of(s, name).update({name: shard_of(s, name)[name][:, :32].contiguous()}))
    with pytest.raises(CoverageError, match=rf"wrong shape:\n  {name}: stored \[256, 32\] expected \[256, 64\]"):
        load_checkpoint_dir(ckpt)


def test_all_problems_reported_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)

    def mutate(shards: dict[str, Tensors]) -> None:
        shard_of(shards, "head.weight").pop("head.weight")
        shard_of(shards, "embed.weight")["layers.9.attn.wq_a.weight"] = torch.zeros(1)
        shard_of(shards, "norm.weight")["norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        shard_of(shards, "layers.0.hc_attn_fn")["layers.0.hc_attn_fn"] = torch.zeros(24, 1024, dtype=torch.bfloat16)
        shard_of(shards, "embed.weight")["layers.0.hc_ffn_norm.weight"] = torch.ones(256, dtype=torch.bfloat16)

    rewrite(ckpt, mutate)
    with pytest.raises(CoverageError) as info:
        load_checkpoint_dir(ckpt)
    error = info.value
    assert error.missing == ["head.weight"]
    assert error.unexpected == ["layers.9.attn.wq_a.weight"]
    assert error.wrong_shape == ["norm.weight: stored [3] expected [256]"]
    assert error.wrong_dtype == ["layers.0.hc_attn_fn: stored BF16 expected F32"]
    assert len(error.other) == 1 and "fold the weight into *_fn" in error.other[0]
    for fragment in ("head.weight", "layers.9.attn.wq_a.weight", "norm.weight", "hc_attn_fn", "hc_ffn_norm"):
        assert fragment in str(error)


def test_missing_shard(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard file .*model-00002-of-00003\.safetensors is missing"):
        load_checkpoint_dir(ckpt)


def test_truncated_shard(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    shard = ckpt / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors is not a readable.*truncated"):
        load_checkpoint_dir(ckpt)


def test_corrupt_shard_header(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    shard = ckpt / "model-00001-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"#garbage"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00003\.safetensors is not a readable.*JSON"):
        load_checkpoint_dir(ckpt)


def test_tensor_listed_but_absent_from_shard(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"]["norm.weight"] = "model-00003-of-00003.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"absent from their shard: norm\.weight \(in model-00003"):
        load_checkpoint_dir(ckpt)


@pytest.mark.parametrize("name", ["config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"])
def test_missing_required_file(tiny_dir: Path, tmp_path: Path, name: str) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=rf"has no {name}"):
        load_checkpoint_dir(ckpt)


def test_bad_config_names_the_file(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["o_groups"] = 3
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json: config key 'text_config\.o_groups' = 3"):
        load_checkpoint_dir(ckpt)


def test_model_prefix_is_accepted_and_ambiguity_rejected(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    rewrite(ckpt, lambda s: [s.update({k: {f"model.{n}": t for n, t in v.items()}}) for k, v in list(s.items())])
    reference = load_checkpoint_dir(tiny_dir).tensors
    prefixed = load_checkpoint_dir(ckpt).tensors
    assert prefixed.keys() == reference.keys()
    assert all(torch.equal(prefixed[k].view(torch.uint8), reference[k].view(torch.uint8)) for k in reference)
    rewrite(ckpt, lambda s: shard_of(s, "model.norm.weight").update({"norm.weight": torch.ones(256)}))
    with pytest.raises(CheckpointError, match=r"both with and without the 'model.' prefix"):
        load_checkpoint_dir(ckpt)


def test_tied_dspark_copies_are_accepted(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    rewrite(ckpt, lambda s: shard_of(s, "embed.weight").update({"mtp.0.embed.weight": s_embed(s)}))
    assert "mtp.0.embed.weight" not in load_checkpoint_dir(ckpt).tensors


def s_embed(shards: dict[str, Tensors]) -> torch.Tensor:
    return shard_of(shards, "embed.weight")["embed.weight"].clone()


def test_engram_table_and_scale_must_share_a_shard(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    name = "layers.0.engram.embed.scale"

    def move(shards: dict[str, Tensors]) -> None:
        source = shard_of(shards, name)
        other = next(t for t in shards.values() if t is not source)
        other[name] = source.pop(name)

    rewrite(ckpt, move)
    with pytest.raises(CoverageError, match=r"must be in the same shard"):
        load_checkpoint_dir(ckpt)


def test_engram_needs_pad_token_at_two(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    text = (ckpt / "tokenizer.json").read_text().replace("<｜▁pad▁｜>", "<｜▁pad2▁｜>")
    (ckpt / "tokenizer.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"has id None; Engram requires id 2"):
        load_checkpoint_dir(ckpt)


def test_resolution(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_dir(tiny_dir) == tiny_dir
    assert resolve_model_dir("someone/some-model", local_model_dir=tiny_dir) == tiny_dir
    with pytest.raises(CheckpointError, match=r"DEEPINFER_HF_MODEL_DIR = .* is not a directory"):
        resolve_model_dir("someone/some-model", local_model_dir=tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"neither an existing directory nor a Hugging Face repo id"):
        resolve_model_dir(tmp_path / "not" / "here")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match=r"Point at a local copy.*DEEPINFER_HF_MODEL_DIR"):
        resolve_model_dir("deepinfer-tests/no-such-model")


def test_release_policy_checks_the_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_of(tiny_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["tokenizer_compatibility"] = "release"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"placeholder '<\|place_holder_mm_span_0000\|>' would get id 1024"):
        load_checkpoint_dir(ckpt)
    settings = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**settings, "add_eos_token": True}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: add_eos_token = True"):
        load_checkpoint_dir(ckpt)
