"""The ``v41-flash-scaled`` preset: the released V4.1-Flash widths on 8 backbone layers + 1 DSpark block.

Checked without writing any weights: the preset passes the config checks; every width matches the released
``v41-flash`` config; every layer role of the released config (SWA, Engram, each compress ratio, KV / index / index-K /
candidate sources and consumers, YOCO sides, DSpark) occurs; its tensor catalogue has exactly the released tensor
families with the released shapes (Engram table rows aside); and the strict loader accepts that catalogue into the
model built on the meta device.
"""

from __future__ import annotations

import re

import torch

from deepinfer_model.config import LayerSpec, load_preset
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.loading.catalogue import CatalogueEntry, build_catalogue, summarize
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH

_WIDTHS = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "candidate_topk_blocks",
    "candidate_block_size",
    "hc_mult",
    "engram_max_ngram_size",
    "engram_n_heads",
    "engram_head_dim",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
    "rms_norm_eps",
    "swiglu_limit",
    "routed_scaling_factor",
)


def _role(layer: LayerSpec) -> tuple[object, ...]:
    """What kind of layer this is, independent of its id and of whether it has an Engram."""
    lid = layer.layer_id
    return (
        layer.kind,
        layer.compress_ratio,
        None if not layer.is_compressed else layer.kv_source == lid,
        None if not layer.is_compressed else layer.index_source == lid,
        None if not layer.is_compressed else layer.index_k_source == lid,
        None if layer.candidate_source is None else layer.candidate_source == lid,
        layer.is_yoco_consumer,
        layer.uses_yarn,
    )


def _family(name: str) -> str:
    return re.sub(r"\b(layers|mtp|experts)\.\d+\.", r"\1.*.", name)


def _families(entries: tuple[CatalogueEntry, ...]) -> dict[str, set[tuple[str, tuple[int, ...]]]]:
    families: dict[str, set[tuple[str, tuple[int, ...]]]] = {}
    for entry in entries:
        if entry.name.startswith(("vision.", "aligner.", "image_")):
            continue
        families.setdefault(_family(entry.name), set()).add((entry.dtype, tuple(entry.shape)))
    return families


def test_widths_are_the_released_ones() -> None:
    scaled, released = load_preset("v41-flash-scaled"), load_preset("v41-flash")
    for key in _WIDTHS:
        assert getattr(scaled.text, key) == getattr(released.text, key), key
    assert scaled.text.num_hidden_layers == 8 and scaled.text.num_nextn_predict_layers == 1
    assert scaled.text.yoco_enabled and len(scaled.text.dspark_target_layer_ids) == 3
    for layer in scaled.text.engram_layer_ids:
        assert 0 < scaled.text.engram_num_rows(layer) < released.text.engram_num_rows(released.text.engram_layer_ids[0])


def test_every_released_layer_role_occurs() -> None:
    # Roles compared without their Engram, then the roles that carry an Engram (an SWA layer and a C2 source in both).
    # The released config also has C2 sources without one; the preset's only C2 source carries one.
    scaled, released = load_preset("v41-flash-scaled"), load_preset("v41-flash")
    assert {_role(layer) for layer in released.text.layers} == {_role(layer) for layer in scaled.text.layers}
    released_engram = {_role(layer) for layer in released.text.layers if layer.has_engram}
    assert released_engram == {_role(layer) for layer in scaled.text.layers if layer.has_engram}


def test_catalogue_has_the_released_tensor_families_and_shapes() -> None:
    scaled = _families(build_catalogue(load_preset("v41-flash-scaled")))
    released = _families(build_catalogue(load_preset("v41-flash")))
    assert scaled.keys() == released.keys()
    for family, shapes in released.items():
        if family.startswith("layers.*.engram.embed."):
            # Shrunk rows, same row layout.
            assert {(dtype, shape[1:]) for dtype, shape in scaled[family]} == {(d, s[1:]) for d, s in shapes}
        else:
            assert scaled[family] == shapes, family


def test_strict_loader_accepts_the_catalogue_on_the_meta_device() -> None:
    config = load_preset("v41-flash-scaled")
    entries = build_catalogue(config)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config, ComputeMode.EXACT)
    model.load_weights(
        (entry.name, torch.empty(entry.shape, dtype=SAFETENSORS_TO_TORCH[entry.dtype], device="meta"))
        for entry in entries
    )
    summary = summarize(entries)
    assert 60e9 < summary.num_bytes < 70e9  # about 65 GB: 8 layers x 384 MXFP4 experts dominate
    assert sum(summary.parameters_by_format.values()) > 1e11
