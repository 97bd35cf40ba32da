"""Fail-fast semantic validation of a parsed configuration (docs/design/model.md, "Configuration rules", "Layer roles").

Each check raises ``ValueError`` naming the key, its value and what is allowed. Checks run in dependency order so
that the sharing-map checks only see well-formed id lists. GPU-kernel layout constraints of the release (``H % 128``,
``D = 512``, ``n_h ∈ {64, 128}``, the candidate MQA-path constraints ...) are deliberately not enforced; only the
constraints the stored formats themselves need are (multiples of 32 for every FP8/MXFP4 group,
docs/design/numerics.md, "Number formats").
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer_model.config import ModelConfig, TextConfig

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
TOKENIZER_POLICIES = ("release", "native")
_FORMAT_GROUP = 32  # FP8 activation groups and MXFP4 / Engram scale groups (docs/design/numerics.md, "Number formats")
_ROPE_HEAD_DIM = 64  # asserted by the reference indexer (docs/design/model.md, "Configuration rules")


def _fail(key: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def _require_equal(key: str, value: object, expected: object) -> None:
    if value != expected or type(value) is not type(expected):
        raise _fail(key, value, f"must be {expected!r}")


def _check_constants(t: TextConfig) -> None:
    _require_equal("text_config.hidden_act", t.hidden_act, "silu")
    _require_equal("text_config.attention_bias", t.attention_bias, False)
    if t.attention_dropout != 0.0:
        raise _fail("text_config.attention_dropout", t.attention_dropout, "must be 0.0")
    _require_equal("text_config.num_key_value_heads", t.num_key_value_heads, 1)
    _require_equal("text_config.scoring_func", t.scoring_func, "sqrtsoftplus")
    _require_equal("text_config.topk_method", t.topk_method, "noaux_tc")
    _require_equal("text_config.norm_topk_prob", t.norm_topk_prob, True)


def _check_dimensions(t: TextConfig) -> None:
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "sliding_window",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "hc_mult",
        "hc_sinkhorn_iters",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "dspark_block_size",
        "dspark_n_routed_experts",
        "dspark_num_experts_per_tok",
    ):
        value = getattr(t, key)
        if value <= 0:
            raise _fail(f"text_config.{key}", value, "must be a positive integer")
    for key in ("n_shared_experts", "num_nextn_predict_layers", "dspark_markov_rank"):
        value = getattr(t, key)
        if value < 0:
            raise _fail(f"text_config.{key}", value, "must be >= 0")
    for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        value = getattr(t, key)
        if not math.isfinite(value) or value < 0 or (key.endswith("theta") and value == 0):
            raise _fail(f"text_config.{key}", value, "must be a finite number >= 0 (> 0 for RoPE bases)")
    if t.swiglu_limit is not None and not t.swiglu_limit > 0:
        raise _fail("text_config.swiglu_limit", t.swiglu_limit, "must be null or a number > 0")
    if t.qk_rope_head_dim != _ROPE_HEAD_DIM:
        raise _fail("text_config.qk_rope_head_dim", t.qk_rope_head_dim, f"must be {_ROPE_HEAD_DIM}")
    if t.head_dim <= t.qk_rope_head_dim:
        raise _fail("text_config.head_dim", t.head_dim, f"must exceed qk_rope_head_dim ({t.qk_rope_head_dim})")
    if t.num_attention_heads % t.o_groups != 0:
        raise _fail("text_config.o_groups", t.o_groups, f"must divide num_attention_heads ({t.num_attention_heads})")
    for key in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "head_dim", "o_lora_rank"):
        value = getattr(t, key)
        if value % _FORMAT_GROUP != 0:
            raise _fail(f"text_config.{key}", value, f"must be a multiple of {_FORMAT_GROUP} (FP8/MXFP4 groups)")
    if t.num_experts_per_tok > t.n_routed_experts:
        raise _fail(
            "text_config.num_experts_per_tok",
            t.num_experts_per_tok,
            f"must be <= n_routed_experts ({t.n_routed_experts})",
        )
    if t.dspark_num_experts_per_tok > t.dspark_n_routed_experts:
        raise _fail(
            "text_config.dspark_num_experts_per_tok",
            t.dspark_num_experts_per_tok,
            f"must be <= dspark_n_routed_experts ({t.dspark_n_routed_experts})",
        )


def _check_compress_ratios(t: TextConfig) -> None:
    expected = t.num_hidden_layers + t.num_nextn_predict_layers
    if len(t.compress_ratios) != expected:
        raise _fail(
            "text_config.compress_ratios",
            list(t.compress_ratios),
            f"must have num_hidden_layers + num_nextn_predict_layers = {expected} entries, "
            f"has {len(t.compress_ratios)}",
        )
    for layer, ratio in enumerate(t.compress_ratios[: t.num_hidden_layers]):
        if ratio not in (0, 1, 2):
            raise _fail(f"text_config.compress_ratios[{layer}]", ratio, "backbone layer ratios must be 0, 1 or 2")
    if 1 not in t.compress_ratios:
        raise _fail("text_config.compress_ratios", list(t.compress_ratios), "must contain a 1 (the YOCO boundary)")


def _check_layer_ids(key: str, ids: tuple[int, ...], num_layers: int, non_empty: bool, ordered: bool) -> None:
    if non_empty and not ids:
        raise _fail(key, list(ids), "must be a non-empty list")
    for layer in ids:
        if not 0 <= layer < num_layers:
            raise _fail(key, list(ids), f"every id must be a backbone layer in [0, {num_layers})")
    if ordered and any(a >= b for a, b in itertools.pairwise(ids)):
        raise _fail(key, list(ids), "ids must be strictly increasing")
    if len(set(ids)) != len(ids):
        raise _fail(key, list(ids), "ids must be unique")


def _check_sharing(t: TextConfig) -> None:
    num_layers = t.num_hidden_layers
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids"):
        _check_layer_ids(f"text_config.{key}", getattr(t, key), num_layers, non_empty=True, ordered=True)
    kv, index, index_k = t.layer_kv_map, t.layer_index_module_map, t.layer_index_k_map
    boundary = t.n_prefill_layer
    if boundary < num_layers and kv[boundary] != boundary:
        raise _fail(
            "text_config.kv_source_layer_ids",
            list(t.kv_source_layer_ids),
            f"the KV map may not cross the YOCO boundary: layer {boundary} (first ratio 1) must be a KV source",
        )
    ratios = t.compress_ratios
    maps = (
        ("kv_source_layer_ids", t.layer_kv_map),
        ("index_source_layer_ids", t.layer_index_module_map),
        ("index_k_source_layer_ids", t.layer_index_k_map),
    )
    for key, mapping in maps:
        for layer in range(num_layers):
            source = mapping[layer]
            if source == layer:
                continue
            if ratios[layer] == 0:
                raise _fail(
                    f"text_config.{key}",
                    list(getattr(t, key)),
                    f"makes SWA-only layer {layer} a consumer of layer {source}; list it as a source",
                )
            if ratios[source] != ratios[layer]:
                raise _fail(
                    f"text_config.{key}",
                    list(getattr(t, key)),
                    f"layer {layer} (ratio {ratios[layer]}) would share with layer {source} (ratio {ratios[source]});"
                    " a consumer must have its source's compress ratio",
                )
    for layer in range(num_layers):
        if index_k[index[layer]] != index_k[layer]:
            raise _fail(
                "text_config.index_source_layer_ids",
                list(t.index_source_layer_ids),
                f"layer {layer}: index segments must refine index-K segments "
                f"(index-K of index source {index[layer]} is {index_k[index[layer]]}, of the layer {index_k[layer]})",
            )
        if kv[index_k[layer]] != kv[layer]:
            raise _fail(
                "text_config.index_k_source_layer_ids",
                list(t.index_k_source_layer_ids),
                f"layer {layer}: index-K segments must refine KV segments "
                f"(KV source of index-K source {index_k[layer]} is {kv[index_k[layer]]}, of the layer {kv[layer]})",
            )


def _check_candidates(t: TextConfig) -> None:
    source = t.candidate_source_layer_id
    if source is None:
        return
    key = "text_config.candidate_source_layer_id"
    if not 0 <= source < t.num_hidden_layers:
        raise _fail(key, source, f"must be null or a backbone layer in [0, {t.num_hidden_layers})")
    if t.layer_index_module_map[source] != source or t.compress_ratios[source] == 0:
        raise _fail(key, source, "must be a compressed layer that is an index source")
    blocks, size = t.candidate_topk_blocks, t.candidate_block_size
    assert blocks is not None and size is not None
    if blocks <= 0 or blocks % 8 != 0:
        raise _fail("text_config.candidate_topk_blocks", blocks, "must be a positive multiple of 8")
    if size not in (8, 16):
        # The reference release's candidate-block kernel only takes these sizes.
        raise _fail("text_config.candidate_block_size", size, "must be 8 or 16")
    if blocks * size < t.index_topk:
        raise _fail(
            "text_config.candidate_topk_blocks",
            blocks,
            f"candidate_topk_blocks * candidate_block_size ({blocks * size}) must be >= index_topk ({t.index_topk})",
        )
    for layer in range(source, t.num_hidden_layers):
        if t.compress_ratios[layer] != t.compress_ratios[source]:
            raise _fail(
                key,
                source,
                f"every layer from the candidate source on must have its compress ratio "
                f"{t.compress_ratios[source]}; layer {layer} has {t.compress_ratios[layer]}",
            )


def _check_engram(t: TextConfig) -> None:
    if not t.engram_layer_ids:
        return
    _check_layer_ids("text_config.engram_layer_ids", t.engram_layer_ids, t.num_hidden_layers, True, ordered=False)
    assert t.engram_max_ngram_size is not None and t.engram_vocab_size is not None
    assert t.engram_n_heads is not None and t.engram_head_dim is not None
    if t.engram_max_ngram_size < 2:
        raise _fail("text_config.engram_max_ngram_size", t.engram_max_ngram_size, "must be >= 2")
    for key in ("engram_vocab_size", "engram_n_heads", "engram_head_dim"):
        if getattr(t, key) <= 0:
            raise _fail(f"text_config.{key}", getattr(t, key), "must be a positive integer")
    if t.engram_head_dim % _FORMAT_GROUP != 0:
        raise _fail(
            "text_config.engram_head_dim", t.engram_head_dim, f"must be a multiple of {_FORMAT_GROUP} (row scales)"
        )
    if not t.engram_compressed_vocab_size:
        raise _fail(
            "text_config.engram_compressed_vocab_size",
            t.engram_compressed_vocab_size,
            "must be truthy when Engram is enabled (tokenizer compression is mandatory)",
        )
    if t.hc_mult <= 1:
        raise _fail("text_config.hc_mult", t.hc_mult, "must be > 1 when Engram is enabled")


def _check_dspark(t: TextConfig) -> None:
    _check_layer_ids(
        "text_config.dspark_target_layer_ids", t.dspark_target_layer_ids, t.num_hidden_layers, False, ordered=False
    )
    if t.num_nextn_predict_layers == 0:
        return
    if not t.dspark_target_layer_ids:
        raise _fail("text_config.dspark_target_layer_ids", [], "must be non-empty when num_nextn_predict_layers > 0")
    if not t.dspark_target_attn_input:
        raise _fail("text_config.dspark_target_attn_input", False, "must be true when DSpark targets are used")
    if t.dspark_markov_rank <= 0:
        raise _fail("text_config.dspark_markov_rank", t.dspark_markov_rank, "must be > 0 when DSpark blocks exist")
    if not 0 <= t.dspark_noise_token_id < t.vocab_size:
        raise _fail(
            "text_config.dspark_noise_token_id", t.dspark_noise_token_id, f"must be a token id in [0, {t.vocab_size})"
        )


def validate_text_config(t: TextConfig) -> None:
    """Run every ``text_config`` rule; raises ValueError on the first violation."""
    _check_constants(t)
    _check_dimensions(t)
    _check_compress_ratios(t)
    _check_sharing(t)
    _check_candidates(t)
    _check_engram(t)
    _check_dspark(t)


def validate_model_config(c: ModelConfig) -> None:
    """Run the top-level rules (architecture, tokenizer policy, special ids); raise ValueError on the first."""
    if c.architectures != (ARCHITECTURE,):
        raise _fail("architectures", list(c.architectures), f"must be [{ARCHITECTURE!r}]")
    _require_equal("model_type", c.model_type, MODEL_TYPE)
    _require_equal("dtype", c.dtype, "bfloat16")
    if c.tokenizer_compatibility not in TOKENIZER_POLICIES:
        raise _fail("tokenizer_compatibility", c.tokenizer_compatibility, f"must be one of {TOKENIZER_POLICIES}")
    vocab = c.text.vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(c, key)
        if not 0 <= value < vocab:
            raise _fail(key, value, f"must be a token id in [0, {vocab})")
    if c.image_token_id is not None and not 0 < c.image_token_id < vocab:
        raise _fail("image_token_id", c.image_token_id, f"must be a positive in-vocabulary id in [1, {vocab})")
    if c.vision is not None and c.image_token_id is None:
        raise ValueError("config key 'image_token_id' is missing (required when vision_config is present)")
