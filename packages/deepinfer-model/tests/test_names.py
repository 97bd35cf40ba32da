"""The checkpoint-name table: hand-worked examples, and whole catalogues mapping onto the model's parameters exactly."""

from __future__ import annotations

import pytest
import torch

from deepinfer_model.config import ModelConfig, load_preset
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.weight_loading import expected_shards
from deepinfer_model.loading.catalogue import build_catalogue
from deepinfer_model.loading.hf_names import (
    ShardId,
    is_rejected_name,
    is_skipped_name,
    is_tied_duplicate,
    map_hf_name,
    strip_model_prefix,
)

CASES: dict[str, tuple[str, ShardId] | None] = {
    "embed.weight": ("embed.weight", None),
    "head.weight": ("head.weight", None),
    "hc_head_base": ("hc_head_base", None),
    "layers.3.hc_attn_base": ("layers.3.hc_attn_base", None),
    "layers.0.attn_norm.weight": ("layers.0.attn_norm.weight", None),
    "layers.1.attn.attn_sink": ("layers.1.attn.attn_sink", None),
    "layers.1.attn.wq_a.scale": ("layers.1.attn.wq_a.scale", None),
    "layers.1.attn.compressor.wgate.weight": ("layers.1.attn.compressor.wgate.weight", None),
    "layers.1.attn.indexer.weights_proj.weight": ("layers.1.attn.indexer.weights_proj.weight", None),
    "layers.2.ffn.gate.bias_vl": ("layers.2.ffn.gate.bias_vl", None),
    "layers.2.ffn.shared_experts.w1.weight": ("layers.2.ffn.shared_experts.w13.weight", 0),
    "layers.2.ffn.shared_experts.w3.scale": ("layers.2.ffn.shared_experts.w13.scale", 1),
    "layers.2.ffn.shared_experts.w2.weight": ("layers.2.ffn.shared_experts.w2.weight", None),
    "layers.2.ffn.experts.7.w1.weight": ("layers.2.ffn.experts.w13.weight", (7, 0)),
    "layers.2.ffn.experts.7.w3.scale": ("layers.2.ffn.experts.w13.scale", (7, 1)),
    "layers.2.ffn.experts.0.w2.weight": ("layers.2.ffn.experts.w2.weight", (0, 0)),
    "layers.12.ffn.experts.255.w2.scale": ("layers.12.ffn.experts.w2.scale", (255, 0)),
    "layers.0.engram.embed.scale": ("layers.0.engram.embed.scale", None),
    "mtp.0.ffn.experts.3.w3.weight": ("mtp.0.ffn.experts.w13.weight", (3, 1)),
    "mtp.0.ffn.shared_experts.w1.scale": ("mtp.0.ffn.shared_experts.w13.scale", 0),
    "mtp.0.main_proj.weight": ("mtp.0.main_proj.weight", None),
    "mtp.2.markov_head.head.weight": ("mtp.2.markov_head.head.weight", None),
    "mtp.2.hc_head_fn": ("mtp.2.hc_head_fn", None),
    "mtp.0.embed.weight": None,
    "mtp.1.head.weight": None,
    "vision.blocks.3.attn.wqkv.weight": None,
    "aligner.proj.weight": None,
    "image_newline": None,
    "image_start": None,
    "layers.4.some.unknown.weight": ("layers.4.some.unknown.weight", None),
}


@pytest.mark.parametrize("hf_name", sorted(CASES))
def test_mapping_table(hf_name: str) -> None:
    assert map_hf_name(hf_name) == CASES[hf_name]
    assert map_hf_name(f"model.{hf_name}") == CASES[hf_name]


def test_prefix_tied_skipped_and_rejected() -> None:
    assert strip_model_prefix("model.layers.0.attn.wkv.weight") == "layers.0.attn.wkv.weight"
    assert strip_model_prefix("layers.0.attn.wkv.weight") == "layers.0.attn.wkv.weight"
    assert strip_model_prefix("model.model.norm.weight") == "model.norm.weight"  # only one prefix is dropped
    assert is_tied_duplicate("model.mtp.1.head.weight") and not is_tied_duplicate("embed.weight")
    assert not is_tied_duplicate("mtp.0.markov_head.embed.weight")
    assert is_skipped_name("model.vision.norm.weight") and not is_skipped_name("layers.0.engram.embed.weight")
    assert is_rejected_name("layers.0.hc_attn_norm.weight") and is_rejected_name("model.hc_head_norm.weight")
    with pytest.raises(ValueError, match=r"hc_ffn_norm\.weight.*folded"):
        map_hf_name("mtp.0.hc_ffn_norm.weight")


def _shard_rows(param_name: str, shape: torch.Size, shard: ShardId) -> tuple[int, ...]:
    """Shape of the slice of a parameter of ``shape`` that ``shard`` fills."""
    parts = 2 if param_name.endswith(("w13.weight", "w13.scale")) else 1
    if isinstance(shard, tuple):
        shape = shape[1:]
    if shard is None:
        return tuple(shape)
    return (shape[0] // parts, *shape[1:])


def assert_catalogue_maps_exactly(config: ModelConfig) -> None:
    """Every text tensor of the catalogue lands on one distinct (parameter, shard) of the right shape, and every
    (parameter, shard) of the model is hit."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    params = dict(model.named_parameters())
    hit: dict[str, set[ShardId]] = {name: set() for name in params}
    for entry in build_catalogue(config):
        target = map_hf_name(entry.name)
        if target is None:
            assert entry.name.startswith(("vision.", "aligner.", "image_")), entry.name
            continue
        name, shard = target
        assert name in params, entry.name
        assert shard not in hit[name], entry.name
        hit[name].add(shard)
        assert _shard_rows(name, params[name].shape, shard) == entry.shape, entry.name
    assert hit == expected_shards(model)


def test_tiny_catalogue_maps_onto_the_parameters_exactly() -> None:
    assert_catalogue_maps_exactly(load_preset("tiny"))


def test_released_catalogue_maps_onto_the_parameters_exactly() -> None:
    assert_catalogue_maps_exactly(load_preset("v41-flash"))
