"""Config parsing, derived values and every validation rule (one case per rule)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _spec20 import spec20_dict

from deepinfer_model.config import LayerKind, ModelConfig, load_preset, preset_json, preset_names

SPEC_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "spec"
RELEASE_CONFIG = SPEC_DIR / "v41-flash-config.json"


def tiny_dict() -> dict[str, Any]:
    return json.loads(preset_json("tiny"))


def test_presets_listed() -> None:
    assert {"tiny", "v41-flash"} <= set(preset_names())
    with pytest.raises(ValueError, match=r"unknown preset 'nope'.*tiny"):
        load_preset("nope")


def test_release_config_parses_with_defaults() -> None:
    config = load_preset("v41-flash")
    t = config.text
    assert config.vision is not None and config.vision.downsample_ratio == 3
    assert config.tokenizer_compatibility == "release"
    assert t.index_k_source_layer_ids == (2, 8, 14, 20)
    assert t.hc_shifted and t.use_fp4_sparse_kv and t.dspark_target_attn_input
    assert t.kv_lora_rank == 448 and t.hc_mix_size == 24 and t.hc_norm_group_size == 20480
    assert t.n_prefill_layer == 20 and t.yoco_enabled
    assert t.rope_theta == 10000.0 and isinstance(t.rope_theta, float)
    assert t.rope_scaling is not None and t.rope_scaling.factor == 16.0
    kv = list(range(43))
    for layer in range(2, 40):
        kv[layer] = max(s for s in (2, 8, 14, 20) if s <= layer)
    assert list(t.layer_kv_map) == kv == list(t.layer_index_k_map)
    assert t.layer_index_module_map[27] == 24 and t.layer_index_module_map[39] == 36
    assert dict(t.layer_candidate_source_map) == {layer: 20 for layer in range(20, 40)}
    assert [t.engram_num_rows(layer) for layer in (1, 14)] == [384006168, 384016682]
    assert t.engram_table_sizes[0][:3] == (16000057, 16000079, 16000081)
    assert t.engram_table_sizes[1][-1] == 16000889
    assert t.engram_input_width == 6144


def test_release_file_matches_shipped_preset() -> None:
    if not RELEASE_CONFIG.exists():
        pytest.skip(f"shared spec directory not present at {SPEC_DIR}")
    assert RELEASE_CONFIG.read_text() == preset_json("v41-flash")
    assert ModelConfig.from_json(RELEASE_CONFIG) == load_preset("v41-flash")


def test_spec20_derived_values() -> None:
    t = ModelConfig.from_dict(spec20_dict()).text
    assert t.kv_lora_rank == 64 and t.n_prefill_layer == 3
    assert list(t.layer_kv_map) == [0, 1, 1, 3, 4, 5, 6]
    assert list(t.layer_index_module_map) == [0, 1, 2, 3, 4, 5, 6]
    assert list(t.layer_index_k_map) == [0, 1, 1, 3, 4, 5, 6]
    assert t.engram_table_sizes == ((1009, 1013, 1019, 1021), (1031, 1033, 1039, 1049))
    assert [t.engram_num_rows(0), t.engram_num_rows(2)] == [4062, 4152]
    kinds = [spec.kind for spec in t.layers]
    swa, c1, c2 = LayerKind.SWA, LayerKind.C1, LayerKind.C2
    assert kinds == [swa, c2, c2, c1, c2, swa, LayerKind.DSPARK]
    assert [layer.layer_id for layer in t.layers if layer.is_yoco_consumer] == [3, 4, 5]
    owners = [(s.owns_compressor, s.owns_compressor_gate, s.owns_indexer, s.owns_index_k) for s in t.layers[:6]]
    assert owners == [
        (False, False, False, False),
        (True, True, True, True),
        (False, False, True, False),
        (True, False, True, True),
        (True, True, True, True),
        (False, False, False, False),
    ]
    # RoPE: base 10000 for layers 0, 5 and mtp.0; YaRN 160000 for 1-4.
    assert [(s.rope_theta, s.uses_yarn) for s in t.layers] == [(10000.0, False)] + [(160000.0, True)] * 4 + [
        (10000.0, False)
    ] * 2


def test_tiny_preset_covers_every_role() -> None:
    config = load_preset("tiny")
    t = config.text
    assert config.vision is None
    specs = t.layers[: t.num_hidden_layers]
    assert {s.kind for s in specs} == {LayerKind.SWA, LayerKind.C1, LayerKind.C2}
    compressed = [s for s in specs if s.is_compressed]
    for attr in ("kv_source", "index_source", "index_k_source", "candidate_source"):
        roles = {getattr(s, attr) == s.layer_id for s in compressed if getattr(s, attr) is not None}
        assert roles == {True, False}, attr
    assert t.yoco_enabled and any(s.is_yoco_consumer for s in specs) and not all(s.is_yoco_consumer for s in specs)
    assert t.engram_enabled and t.n_routed_experts >= 8 and t.num_nextn_predict_layers >= 1
    assert t.layers[-1].kind is LayerKind.DSPARK


def test_round_trip_and_text_only() -> None:
    for data in (tiny_dict(), spec20_dict(), json.loads(preset_json("v41-flash"))):
        config = ModelConfig.from_dict(data)
        assert ModelConfig.from_dict(config.to_dict()) == config
    data = spec20_dict()
    del data["vision_config"]
    assert ModelConfig.from_dict(data).vision is None


def test_from_json_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read config file"):
        ModelConfig.from_json(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(bad)


def _text(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        data["text_config"].update(changes)

    return apply


def _drop_text(key: str) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        del data["text_config"][key]

    return apply


def _top(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        data.update(changes)

    return apply


def _quant(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        data["quantization_config"].update(changes)

    return apply


def _vision(**changes: Any) -> Callable[[dict[str, Any]], None]:
    def apply(data: dict[str, Any]) -> None:
        data["vision_config"] = {**spec20_dict()["vision_config"], **changes}

    return apply


# (mutation of the tiny preset, key path expected in the message, fragment of the "allowed" text)
BAD_CONFIGS: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    # rule 1: constants
    "architectures": (_top(architectures=["Other"]), "architectures", "DeepseekV41ForCausalLM"),
    "architectures_two": (
        _top(architectures=["DeepseekV41ForCausalLM", "X"]),
        "architectures",
        "DeepseekV41ForCausalLM",
    ),
    "model_type": (_top(model_type="deepseek_v3"), "model_type", "deepseek_v41"),
    "dtype": (_top(dtype="float16"), "dtype", "bfloat16"),
    "hidden_act": (_text(hidden_act="gelu"), "text_config.hidden_act", "silu"),
    "attention_bias": (_text(attention_bias=True), "text_config.attention_bias", "False"),
    "attention_dropout": (_text(attention_dropout=0.1), "text_config.attention_dropout", "0.0"),
    "num_key_value_heads": (_text(num_key_value_heads=2), "text_config.num_key_value_heads", "1"),
    "quant_method": (_quant(quant_method="int8"), "quantization_config.quant_method", "fp8"),
    "expert_dtype": (_quant(expert_dtype="fp8"), "quantization_config.expert_dtype", "fp4"),
    "activation_scheme": (_quant(activation_scheme="static"), "quantization_config.activation_scheme", "dynamic"),
    "weight_block_size": (_quant(weight_block_size=[128, 128]), "quantization_config.weight_block_size", "32"),
    "scale_fmt": (_quant(scale_fmt="fp32"), "quantization_config.scale_fmt", "ue8m0"),
    # rule 2: compress_ratios
    "ratios_length": (_text(compress_ratios=[0, 2, 2, 0, 1, 1, 1]), "text_config.compress_ratios", "8 entries"),
    "ratio_value": (_text(compress_ratios=[0, 4, 2, 0, 1, 1, 1, 0]), "text_config.compress_ratios[1]", "0, 1 or 2"),
    "ratios_no_one": (
        _text(compress_ratios=[0, 2, 2, 0, 2, 2, 2, 0], candidate_source_layer_id=None),
        "text_config.compress_ratios",
        "must contain a 1",
    ),
    # rule 3: sharing maps and candidates
    "kv_sources_empty": (_text(kv_source_layer_ids=[]), "text_config.kv_source_layer_ids", "non-empty"),
    "index_sources_empty": (_text(index_source_layer_ids=[]), "text_config.index_source_layer_ids", "non-empty"),
    "sources_unsorted": (_text(index_source_layer_ids=[2, 1, 3, 4, 5]), "index_source_layer_ids", "increasing"),
    "sources_out_of_range": (_text(kv_source_layer_ids=[1, 3, 4, 9]), "kv_source_layer_ids", "[0, 7)"),
    "swa_consumer": (
        _text(kv_source_layer_ids=[1, 4], index_k_source_layer_ids=[1, 4], index_source_layer_ids=[1, 2, 4, 5]),
        "text_config.kv_source_layer_ids",
        "SWA-only layer 3",
    ),
    "ratio_mismatch": (
        _text(compress_ratios=[0, 1, 2, 0, 1, 1, 1, 0]),
        "text_config.kv_source_layer_ids",
        "compress ratio",
    ),
    "yoco_crossing": (
        _text(compress_ratios=[0, 2, 2, 0, 2, 1, 1, 0], candidate_source_layer_id=None),
        "text_config.kv_source_layer_ids",
        "YOCO boundary",
    ),
    "index_k_not_refining_kv": (
        _text(kv_source_layer_ids=[1, 2, 3, 4], index_k_source_layer_ids=[1, 3, 4]),
        "text_config.index_k_source_layer_ids",
        "refine KV",
    ),
    "index_not_refining_index_k": (
        _text(
            kv_source_layer_ids=[1, 2, 3, 4], index_k_source_layer_ids=[1, 2, 3, 4], index_source_layer_ids=[1, 3, 4]
        ),
        "text_config.index_source_layer_ids",
        "refine index-K",
    ),
    "candidate_not_index_source": (
        _text(candidate_source_layer_id=6),
        "text_config.candidate_source_layer_id",
        "index source",
    ),
    "candidate_blocks_multiple": (_text(candidate_topk_blocks=12), "candidate_topk_blocks", "multiple of 8"),
    "candidate_block_size": (_text(candidate_block_size=4), "candidate_block_size", "8 or 16"),
    "candidate_too_few_rows": (
        _text(candidate_topk_blocks=8, candidate_block_size=8, index_topk=72),
        "candidate_topk_blocks",
        ">= index_topk",
    ),
    "candidate_tail_ratio": (
        _text(candidate_source_layer_id=1),
        "text_config.candidate_source_layer_id",
        "compress ratio",
    ),
    "candidate_keys_missing": (_drop_text("candidate_block_size"), "text_config.candidate_block_size", "missing"),
    # rule 4: MoE
    "scoring_func": (_text(scoring_func="softmax"), "text_config.scoring_func", "sqrtsoftplus"),
    "topk_method": (_text(topk_method="greedy"), "text_config.topk_method", "noaux_tc"),
    "norm_topk_prob": (_text(norm_topk_prob=False), "text_config.norm_topk_prob", "True"),
    "topk_above_experts": (_text(num_experts_per_tok=9), "text_config.num_experts_per_tok", "<= n_routed_experts"),
    "dspark_topk_above_experts": (
        _text(dspark_num_experts_per_tok=5),
        "text_config.dspark_num_experts_per_tok",
        "<= dspark_n_routed_experts",
    ),
    # rule 5: Engram
    "engram_ngram": (_text(engram_max_ngram_size=1), "text_config.engram_max_ngram_size", ">= 2"),
    "engram_compressed_vocab": (
        _text(engram_compressed_vocab_size=0),
        "text_config.engram_compressed_vocab_size",
        "truthy",
    ),
    "engram_hc_mult": (_text(hc_mult=1), "text_config.hc_mult", "> 1"),
    "engram_key_missing": (_drop_text("engram_n_heads"), "text_config.engram_n_heads", "missing"),
    "engram_layer_range": (_text(engram_layer_ids=[0, 7]), "text_config.engram_layer_ids", "[0, 7)"),
    # rule 6: DSpark
    "dspark_attn_input": (_text(dspark_target_attn_input=False), "text_config.dspark_target_attn_input", "true"),
    "dspark_markov_rank": (_text(dspark_markov_rank=0), "text_config.dspark_markov_rank", "> 0"),
    "dspark_targets_empty": (_text(dspark_target_layer_ids=[]), "text_config.dspark_target_layer_ids", "non-empty"),
    "dspark_key_missing": (_drop_text("dspark_noise_token_id"), "text_config.dspark_noise_token_id", "missing"),
    # rule 7: tokenizer policy / processor
    "tokenizer_compatibility": (_top(tokenizer_compatibility="legacy"), "tokenizer_compatibility", "release"),
    "vision_width": (_vision(hidden_size=1152), "vision_config.hidden_size", "1024"),
    "vision_downsample": (_vision(downsample_ratio=0), "vision_config.downsample_ratio", "positive"),
    "vision_wh_ratio": (_vision(max_wh_ratio=0.5), "vision_config.max_wh_ratio", ">= 1"),
    "vision_needs_image_token": (
        lambda d: (_vision()(d), d.pop("image_token_id")),
        "image_token_id",
        "required when vision_config",
    ),
    # dimensions, types and formats
    "missing_required": (_drop_text("hidden_size"), "text_config.hidden_size", "missing"),
    "wrong_type": (_text(hidden_size="256"), "text_config.hidden_size", "an integer"),
    "bool_for_int": (_text(num_hidden_layers=True), "text_config.num_hidden_layers", "an integer"),
    "rope_head_dim": (_text(qk_rope_head_dim=32), "text_config.qk_rope_head_dim", "64"),
    "o_groups_divide": (_text(o_groups=3), "text_config.o_groups", "divide"),
    "hidden_multiple_32": (_text(hidden_size=250), "text_config.hidden_size", "multiple of 32"),
    "rope_scaling_key": (
        _text(rope_scaling={"type": "yarn", "factor": 4.0}),
        "text_config.rope_scaling.original_max_position_embeddings",
        "missing",
    ),
    "token_id_range": (_top(pad_token_id=5000), "pad_token_id", "[0, 1024)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_rejected(case: str) -> None:
    mutate, key, allowed = BAD_CONFIGS[case]
    data = copy.deepcopy(tiny_dict())
    mutate(data)
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict(data)
    message = str(info.value)
    assert f"'{key}'" in message or key in message, message
    assert allowed in message, message
