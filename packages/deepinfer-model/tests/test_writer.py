"""Checkpoint writer: bit-exact writer → loader round trip for every format, format validity, determinism, init."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from deepinfer_kernels import dequantize_fp8_block, dequantize_mxfp4, ue8m0_to_float
from deepinfer_model.checkpoint.tokenizer import BOS_TOKEN, EOS_TOKEN, IMAGE_TOKEN, NOISE_TOKEN, PAD_TOKEN
from deepinfer_model.checkpoint.writer import tensor_pair, write_checkpoint
from deepinfer_model.config import ModelConfig, load_preset, preset_json
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.loading.load import load_checkpoint_dir


def micro_config() -> ModelConfig:
    """A two-layer model (SWA + C1, Engram, one DSpark block) that writes in well under a second."""
    data: dict[str, Any] = json.loads(preset_json("tiny"))
    data["text_config"].update(
        hidden_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=128,
        q_lora_rank=64,
        o_lora_rank=32,
        o_groups=1,
        compress_ratios=[0, 1, 0],
        kv_source_layer_ids=[1],
        index_k_source_layer_ids=[1],
        index_source_layer_ids=[1],
        candidate_source_layer_id=None,
        index_n_heads=2,
        index_head_dim=64,
        n_routed_experts=2,
        num_experts_per_tok=1,
        engram_layer_ids=[0],
        engram_max_ngram_size=2,
        engram_vocab_size=100,
        engram_n_heads=1,
        engram_head_dim=32,
        dspark_target_layer_ids=[1],
        dspark_n_routed_experts=2,
        dspark_num_experts_per_tok=1,
        dspark_markov_rank=8,
    )
    return ModelConfig.from_dict(data)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(load_preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=11, max_shard_bytes=4_000_000)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def test_round_trip_is_bit_exact_for_every_format(tiny_dir: Path) -> None:
    config = load_preset("tiny")
    loaded = load_checkpoint_dir(tiny_dir).tensors
    entries = build_catalogue(config)
    checked: set[TensorFormat] = set()
    for entry in entries:
        if entry.format is TensorFormat.SCALE:
            continue
        for name, expected in tensor_pair(entry, config, seed=11):
            dest = loaded[name]
            assert dest.dtype == expected.dtype, name
            assert torch.equal(raw_bytes(dest), raw_bytes(expected)), name
        checked.add(entry.format)
    assert checked == {f for f in TensorFormat if f is not TensorFormat.SCALE}


def test_shards_read_back_with_the_safetensors_library(tiny_dir: Path) -> None:
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    entries = {e.name: e for e in build_catalogue(load_preset("tiny"))}
    assert set(weight_map) == set(entries)
    total = 0
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(tiny_dir / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                assert weight_map[name] == shard
                assert tuple(tensor.shape) == entries[name].shape
                total += tensor.numel() * tensor.element_size()
    assert total == index["metadata"]["total_size"] == sum(e.num_bytes for e in entries.values())
    assert weight_map["layers.2.engram.embed.weight"] == weight_map["layers.2.engram.embed.scale"]
    assert len(set(weight_map.values())) > 1


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    config = micro_config()
    first = write_checkpoint(config, tmp_path / "a", seed=5, max_shard_bytes=200_000)
    second = write_checkpoint(config, tmp_path / "b", seed=5, max_shard_bytes=200_000)
    other = write_checkpoint(config, tmp_path / "c", seed=6, max_shard_bytes=200_000)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and len(names) > 5
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    shard = next(n for n in names if n.endswith(".safetensors"))
    assert (first / shard).read_bytes() != (other / shard).read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    loaded = load_checkpoint_dir(first)
    assert loaded.config == config


def test_initialisation_keeps_values_order_one() -> None:
    config = load_preset("tiny")
    entries = {e.name: e for e in build_catalogue(config)}
    (_, q), (_, s) = tensor_pair(entries["layers.1.attn.wq_b.weight"], config, seed=0)
    weight = dequantize_fp8_block(q, s)
    assert abs(weight.std().item() - 128**-0.5) < 0.1 * 128**-0.5
    (_, packed), (_, scale) = tensor_pair(entries["layers.1.ffn.experts.3.w2.weight"], config, seed=0)
    expert = dequantize_mxfp4(packed, scale)
    assert expert.shape == (256, 128) and abs(expert.std().item() - 128**-0.5) < 0.15 * 128**-0.5
    (_, rows), (_, row_scale) = tensor_pair(entries["layers.0.engram.embed.weight"], config, seed=0)
    table = rows.float() * ue8m0_to_float(row_scale).repeat_interleave(32, dim=1)
    assert abs(table.std().item() - 1.0) < 0.05
    [(_, base)] = tensor_pair(entries["layers.5.hc_ffn_base"], config, seed=0)
    m = config.text.hc_mult
    assert base[:m].tolist() == [-3.0, 3.0, -3.0, -3.0]  # +3 at 5 mod 4 (docs/design/model.md, "Initial mHC values")
    assert base[m : 2 * m].tolist() == [0.0] * m
    comb = base[2 * m :].view(m, m)
    assert torch.equal(comb, torch.where(torch.eye(m, dtype=torch.bool), 3.0, -3.0))
    [(_, scale3)] = tensor_pair(entries["mtp.0.hc_attn_scale"], config, seed=0)
    assert scale3.tolist() == pytest.approx([0.01] * 3)
    [(_, norm)] = tensor_pair(entries["layers.2.attn.kv_norm.weight"], config, seed=0)
    assert norm.dtype == torch.bfloat16 and abs(norm.float().mean().item() - 1.0) < 0.05
    [(_, fn)] = tensor_pair(entries["layers.0.hc_attn_fn"], config, seed=0)
    assert fn.dtype == torch.float32 and fn.abs().max().item() < 0.1


def test_tokenizer_matches_the_policy(tiny_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 1024
    fixed = {BOS_TOKEN: 0, EOS_TOKEN: 1, PAD_TOKEN: 2, NOISE_TOKEN: 3, IMAGE_TOKEN: 1023}
    assert {token: tokenizer.token_to_id(token) for token in fixed} == fixed
    assert tokenizer.encode("").ids == [0]
    text = "def add(a, b):\n    return a + b  # The quick brown fox."
    encoded = tokenizer.encode(text)
    assert encoded.ids[0] == 0 and max(encoded.ids) < 1024
    assert tokenizer.decode(encoded.ids) == text
    assert len(encoded.ids) < 0.7 * len(text)  # merges were learned
    settings = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert settings["add_bos_token"] is True and settings["add_eos_token"] is False
    assert settings["pad_token"] == PAD_TOKEN


def test_round_trip_without_optional_families(tmp_path: Path) -> None:
    """No shared expert, no Engram, non-shifted mHC (HC head tensors), two DSpark blocks."""
    data = micro_config().to_dict()
    data["text_config"].update(n_shared_experts=0, engram_layer_ids=[], hc_shifted=False, num_nextn_predict_layers=2)
    data["text_config"]["compress_ratios"] = [0, 1, 0, 0]
    config = ModelConfig.from_dict(data)
    loaded = load_checkpoint_dir(write_checkpoint(config, tmp_path / "ckpt", seed=2)).tensors
    entries = {e.name: e for e in build_catalogue(config)}
    assert set(loaded) == set(entries)
    for entry in entries.values():
        if entry.format is not TensorFormat.SCALE:
            for name, expected in tensor_pair(entry, config, seed=2):
                assert torch.equal(raw_bytes(loaded[name]), raw_bytes(expected)), name
    assert loaded["hc_head_base"].tolist() == [-3.0, -3.0, 3.0, -3.0]  # +3 at L mod m = 2 ("Initial mHC values")
    assert loaded["mtp.1.hc_head_base"].tolist() == [3.0, -3.0, -3.0, -3.0]  # runtime id 3, + 1
