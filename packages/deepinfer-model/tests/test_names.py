"""Hand-worked checks of the HF → internal name mapping (model-core §4.2–§4.8)."""

from __future__ import annotations

import pytest

from deepinfer_model.config import load_preset
from deepinfer_model.loading.catalogue import build_catalogue
from deepinfer_model.loading.hf_names import (
    InternalTarget,
    hf_to_internal,
    is_rejected_name,
    is_tied_duplicate,
    strip_model_prefix,
)

CASES = {
    "embed.weight": InternalTarget("embed.weight"),
    "model.head.weight": InternalTarget("head.weight"),
    "image_newline": InternalTarget("image_newline"),
    "layers.3.hc_attn_base": InternalTarget("layers.3.hc_attn"),
    "layers.3.hc_ffn_fn": InternalTarget("layers.3.hc_ffn_fn"),
    "layers.3.hc_ffn_scale": InternalTarget("layers.3.hc_ffn_scale"),
    "layers.0.attn_norm.weight": InternalTarget("layers.0.norm1.weight"),
    "layers.0.ffn_norm.weight": InternalTarget("layers.0.norm2.weight"),
    "layers.1.attn.attn_sink": InternalTarget("layers.1.self_attn.attn_sink_params"),
    "layers.1.attn.wq_a.weight": InternalTarget("layers.1.self_attn.Wq.A.weight"),
    "layers.1.attn.wq_a.scale": InternalTarget("layers.1.self_attn.Wq.A.scale"),
    "layers.1.attn.q_norm.weight": InternalTarget("layers.1.self_attn.Wq.norm.weight"),
    "layers.1.attn.wq_b.weight": InternalTarget("layers.1.self_attn.Wq.B.weight"),
    "layers.1.attn.wkv.scale": InternalTarget("layers.1.self_attn.Wkv.A.scale"),
    "layers.1.attn.kv_norm.weight": InternalTarget("layers.1.self_attn.Wkv.norm.weight"),
    "layers.1.attn.wo_a.weight": InternalTarget("layers.1.self_attn.Wv.weight"),
    "layers.1.attn.wo_b.scale": InternalTarget("layers.1.self_attn.out_proj.scale"),
    "layers.1.attn.compressor.wkv.weight": InternalTarget("layers.1.self_attn.PackedWkv.A.weight"),
    "layers.1.attn.compressor.wgate.weight": InternalTarget("layers.1.self_attn.PackedWkv.Gate.weight"),
    "layers.1.attn.compressor.norm.weight": InternalTarget("layers.1.self_attn.PackedWkv.norm.weight"),
    "layers.1.attn.indexer.wq_b.scale": InternalTarget("layers.1.self_attn.index_attn.q_B.scale"),
    "layers.1.attn.indexer.wk.weight": InternalTarget("layers.1.self_attn.index_attn.k_proj.weight"),
    "layers.1.attn.indexer.k_norm.weight": InternalTarget("layers.1.self_attn.index_attn.k_norm.weight"),
    "layers.1.attn.indexer.weights_proj.weight": InternalTarget("layers.1.self_attn.index_attn.weights_proj.weight"),
    "layers.2.ffn.gate.weight": InternalTarget("layers.2.experts.gate.Wgate.weight"),
    "layers.2.ffn.gate.bias": InternalTarget("layers.2.experts.gate.e_score_correction_bias"),
    "layers.2.ffn.gate.bias_vl": InternalTarget("layers.2.experts.gate.e_score_correction_bias_vl"),
    "layers.2.ffn.shared_experts.w1.weight": InternalTarget(
        "layers.2.experts.shared_experts.0.linear1.weight", None, 0, 2
    ),
    "layers.2.ffn.shared_experts.w3.scale": InternalTarget(
        "layers.2.experts.shared_experts.0.linear1.scale", None, 1, 2
    ),
    "layers.2.ffn.shared_experts.w2.weight": InternalTarget("layers.2.experts.shared_experts.0.linear2.weight"),
    "layers.2.ffn.experts.7.w1.weight": InternalTarget("layers.2.experts.linear1.weight", 7, 0, 2),
    "layers.2.ffn.experts.7.w3.scale": InternalTarget("layers.2.experts.linear1.scale", 7, 1, 2),
    "layers.2.ffn.experts.0.w2.weight": InternalTarget("layers.2.experts.linear2.weight", 0),
    "layers.0.engram.q_weight": InternalTarget("layers.0.engram_embedding.weight_hidden"),
    "layers.0.engram.k_weight": InternalTarget("layers.0.engram_embedding.weight_embed"),
    "layers.0.engram.embed.weight": InternalTarget("layers.0.engram_embedding.embedding.embedding"),
    "layers.0.engram.embed.scale": InternalTarget("layers.0.engram_embedding.embedding.scale"),
    "layers.0.engram.wkv.scale": InternalTarget("layers.0.engram_embedding.fused_kv_projection.scale"),
    "mtp.0.attn.wq_a.weight": InternalTarget("mtp.0.block.self_attn.Wq.A.weight"),
    "mtp.0.hc_attn_base": InternalTarget("mtp.0.block.hc_attn"),
    "mtp.0.ffn.experts.3.w2.scale": InternalTarget("mtp.0.block.experts.linear2.scale", 3),
    "mtp.0.main_proj.weight": InternalTarget("mtp.0.projection.weight"),
    "mtp.0.main_proj.scale": InternalTarget("mtp.0.projection.scale"),
    "mtp.0.main_norm.weight": InternalTarget("mtp.0.project_norm.weight"),
    "mtp.2.norm.weight": InternalTarget("mtp.2.shared_head.norm.weight"),
    "mtp.2.markov_head.embed.weight": InternalTarget("mtp.2.shared_head.markov_w1.weight"),
    "mtp.2.markov_head.head.weight": InternalTarget("mtp.2.shared_head.markov_w2.weight"),
    "mtp.2.confidence_head.proj.weight": InternalTarget("mtp.2.confidence_head.proj.weight"),
    "mtp.2.hc_head_fn": InternalTarget("mtp.2.hc_head_layer_fn"),
    "mtp.2.hc_head_base": InternalTarget("mtp.2.hc_head_layer"),
    "vision.blocks.3.attn.wqkv.weight": InternalTarget("vision.blocks.3.attn.wqkv.weight"),
    "layers.4.some.unknown.weight": InternalTarget("layers.4.some.unknown.weight"),
}


@pytest.mark.parametrize("hf_name", sorted(CASES))
def test_mapping_table(hf_name: str) -> None:
    assert hf_to_internal(hf_name) == CASES[hf_name]
    assert hf_to_internal(f"model.{strip_model_prefix(hf_name)}") == CASES[hf_name]


def test_prefix_and_tied_and_rejected() -> None:
    assert strip_model_prefix("model.layers.0.attn.wkv.weight") == "layers.0.attn.wkv.weight"
    assert strip_model_prefix("layers.0.attn.wkv.weight") == "layers.0.attn.wkv.weight"
    assert hf_to_internal("mtp.0.embed.weight") is None and is_tied_duplicate("model.mtp.1.head.weight")
    assert not is_tied_duplicate("embed.weight")
    assert is_rejected_name("layers.0.hc_attn_norm.weight") and is_rejected_name("model.hc_head_norm.weight")
    with pytest.raises(ValueError, match=r"hc_ffn_norm\.weight.*folded"):
        hf_to_internal("mtp.0.hc_ffn_norm.weight")


def test_catalogue_maps_injectively() -> None:
    """Distinct catalogue tensors never land on the same internal slot."""
    seen: set[tuple[str, int | None, int]] = set()
    for entry in build_catalogue(load_preset("tiny")):
        target = hf_to_internal(entry.name)
        assert target is not None
        key = (target.name, target.expert, target.part)
        assert key not in seen, entry.name
        seen.add(key)
