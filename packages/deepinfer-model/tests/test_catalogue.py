"""Tensor catalogue (docs/design/model.md, "Checkpoint layout"): release totals, worked-configuration counts and spot
checks of names, shapes and dtypes."""

from __future__ import annotations

import json

from _spec20 import spec20_dict

from deepinfer_model.config import ModelConfig, load_preset, preset_json
from deepinfer_model.loading.catalogue import CatalogueEntry, build_catalogue, summarize


def by_name(entries: tuple[CatalogueEntry, ...]) -> dict[str, CatalogueEntry]:
    table = {e.name: e for e in entries}
    assert len(table) == len(entries), "duplicate names"
    return table


def release_config() -> ModelConfig:
    """The released config.json, shipped as the ``v41-flash`` preset."""
    return load_preset("v41-flash")


def test_release_totals_match_the_released_index() -> None:
    summary = summarize(build_catalogue(release_config()))
    assert summary.num_tensors == 96_085
    assert summary.num_bytes == 510_286_023_000
    assert summary.tensors_by_dtype == {"BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47_589, "I8": 47_232}
    assert summary.bytes_by_dtype == {
        "BF16": 3_952_883_712,
        "F32": 169_229_128,
        "F8_E4M3": 204_015_223_296,
        "F8_E8M0": 23_563_015_184,
        "I8": 278_585_671_680,
    }
    assert summary.parameters_by_format["mxfp4"] == 557_171_343_360
    assert summary.parameters_by_format["fp8_row"] == 196_613_849_600


def test_release_spot_checks() -> None:
    table = by_name(build_catalogue(release_config()))

    def check(name: str, shape: tuple[int, ...], dtype: str) -> None:
        assert (table[name].shape, table[name].dtype) == (shape, dtype), name

    check("layers.0.hc_attn_fn", (24, 20480), "F32")
    check("layers.0.attn.wq_b.weight", (32768, 1280), "F8_E4M3")
    check("layers.0.attn.wq_b.scale", (1024, 40), "F8_E8M0")
    check("layers.5.attn.wo_a.weight", (8192, 4096), "F8_E4M3")
    check("layers.39.ffn.experts.383.w1.weight", (2304, 2560), "I8")
    check("layers.39.ffn.experts.383.w2.scale", (5120, 72), "F8_E8M0")
    check("layers.2.attn.compressor.wgate.weight", (512, 5120), "BF16")
    check("layers.20.attn.compressor.wkv.weight", (512, 5120), "BF16")
    check("layers.24.attn.indexer.wq_b.weight", (4096, 1280), "F8_E4M3")
    check("layers.20.attn.indexer.wk.weight", (128, 512), "BF16")
    check("layers.1.engram.embed.weight", (384_006_168, 256), "F8_E4M3")
    check("layers.14.engram.embed.scale", (384_016_682, 8), "F8_E8M0")
    check("layers.14.engram.wkv.weight", (25600, 6144), "F8_E4M3")
    check("mtp.0.main_proj.weight", (5120, 15360), "F8_E4M3")
    check("mtp.2.markov_head.embed.weight", (129280, 256), "BF16")
    check("mtp.2.confidence_head.proj.weight", (1, 5376), "BF16")
    check("mtp.1.ffn.gate.weight", (128, 5120), "BF16")
    check("aligner.w1.weight", (5120, 9216), "BF16")
    # Absent by the sharing rules (docs/design/model.md, "Layer roles") and the DSpark block rules
    # (docs/design/model.md, "DSpark blocks").
    for absent in (
        "layers.3.attn.compressor.wkv.weight",
        "layers.20.attn.compressor.wgate.weight",
        "layers.24.attn.indexer.wk.weight",
        "layers.25.attn.indexer.wq_b.weight",
        "layers.0.attn.indexer.wq_b.weight",
        "mtp.1.main_proj.weight",
        "mtp.0.norm.weight",
        "mtp.0.embed.weight",
        "hc_head_fn",
        "layers.0.ffn.experts.384.w1.weight",
        "mtp.0.ffn.experts.128.w1.weight",
    ):
        assert absent not in table, absent


def test_spec20_has_836_tensors() -> None:
    entries = build_catalogue(ModelConfig.from_dict(spec20_dict()))
    assert len(entries) == 836
    table = by_name(entries)
    assert sum(n.startswith(("vision.", "aligner.")) for n in table) == 263
    assert sum(".ffn.experts." in n for n in table) == 312
    assert sum(n.startswith("mtp.0.") and ".ffn.experts." not in n for n in table) == 37
    backbone = [n for n in table if n.startswith("layers.") and ".ffn.experts." not in n]
    assert len(backbone) == 218
    # Worked-configuration tensors, spot checks.
    assert table["layers.0.engram.embed.weight"].shape == (4062, 128)
    assert table["layers.2.engram.embed.scale"].shape == (4152, 4)
    assert table["layers.2.engram.wkv.scale"].shape == (40, 16)
    assert table["layers.3.attn.wo_a.scale"].shape == (4, 16)
    assert table["mtp.0.ffn.gate.bias_vl"].shape == (4,)
    assert table["mtp.0.ffn.experts.3.w2.weight"].shape == (256, 64)
    assert table["mtp.0.confidence_head.proj.weight"].shape == (1, 288)
    assert table["mtp.0.main_proj.scale"].shape == (8, 16)
    assert "layers.2.attn.indexer.wk.weight" not in table and "layers.2.attn.indexer.wq_b.weight" in table
    assert "layers.3.attn.compressor.wgate.weight" not in table
    assert "layers.5.attn.indexer.wq_b.weight" not in table


def test_tiny_preset_catalogue_roles() -> None:
    table = by_name(build_catalogue(load_preset("tiny")))
    assert not any(n.startswith(("vision.", "aligner.")) for n in table)
    assert "layers.5.attn.indexer.wq_b.weight" in table and "layers.5.attn.indexer.wk.weight" not in table
    assert "layers.6.attn.indexer.wq_b.weight" not in table
    assert "layers.4.attn.compressor.wgate.weight" not in table and "layers.4.attn.compressor.wkv.weight" in table
    assert table["mtp.0.main_proj.weight"].shape == (256, 512)


def test_non_shifted_adds_hc_head() -> None:
    data = json.loads(preset_json("tiny"))
    data["text_config"]["hc_shifted"] = False
    table = by_name(build_catalogue(ModelConfig.from_dict(data)))
    assert table["hc_head_fn"].shape == (4, 1024)
    assert table["mtp.0.hc_head_base"].shape == (4,)
    assert table["hc_head_scale"].shape == (1,)


def test_optional_families_follow_the_config() -> None:
    data = json.loads(preset_json("tiny"))
    text = data["text_config"]
    text.update(
        n_shared_experts=0, engram_layer_ids=[], num_nextn_predict_layers=2, compress_ratios=[0, 2, 2, 0, 1, 1, 1, 0, 0]
    )
    table = by_name(build_catalogue(ModelConfig.from_dict(data)))
    assert not any("shared_experts" in n or ".engram." in n for n in table)
    assert "mtp.0.main_proj.weight" in table and "mtp.1.main_proj.weight" not in table
    assert "mtp.1.markov_head.head.weight" in table and "mtp.0.markov_head.head.weight" not in table
    assert "mtp.0.norm.weight" not in table and "mtp.1.main_norm.weight" not in table
    data = json.loads(preset_json("tiny"))
    data["text_config"]["num_nextn_predict_layers"] = 0
    data["text_config"]["compress_ratios"] = [0, 2, 2, 0, 1, 1, 1]
    assert not any(n.startswith("mtp.") for n in by_name(build_catalogue(ModelConfig.from_dict(data))))
