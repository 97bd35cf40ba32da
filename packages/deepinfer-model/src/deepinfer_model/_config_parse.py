"""Typed reading of ``config.json`` objects into constructor keyword arguments (``ModelConfig.to_dict`` writes them
back).

Owns the "required / optional with default / required if" rules of every ``config.json`` key: which keys must be
present, their JSON types and their defaults. Semantic rules (constants, ranges, sharing maps) live with the
dataclasses (``config``, ``text_config``, ``config_sections``), which check them at construction. Every error names
the full key path (``text_config.hidden_size``), the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass
class ParsedConfig:
    """Keyword arguments for ``ModelConfig`` (``top``) and its three sections."""

    top: dict[str, Any]
    text: dict[str, Any]
    quantization: dict[str, Any]
    vision: dict[str, Any] | None


class _Section:
    """Reads typed values from one JSON object, naming keys by their full path in errors."""

    def __init__(self, data: Mapping[str, Any], prefix: str) -> None:
        self._data = data
        self._prefix = prefix

    def key(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def present(self, name: str) -> bool:
        return name in self._data

    def _raw(self, name: str, default: object) -> object:
        if name in self._data:
            return self._data[name]
        if default is _MISSING:
            raise ValueError(f"config key '{self.key(name)}' is missing (required)")
        return default

    def _bad(self, name: str, value: object, expected: str) -> ValueError:
        return ValueError(f"config key '{self.key(name)}' = {value!r} has the wrong type: expected {expected}")

    def integer(self, name: str, default: object = _MISSING) -> Any:
        value = self._raw(name, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, value, "an integer")
        return value

    def optional_integer(self, name: str) -> int | None:
        """A key that must be present but may be null."""
        value = self._raw(name, _MISSING)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, value, "an integer or null")
        return value

    def number(self, name: str, default: object = _MISSING, nullable: bool = False) -> Any:
        value = self._raw(name, default)
        if value is default and default is not _MISSING:
            return value
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(name, value, "a number" + (" or null" if nullable else ""))
        return float(value)

    def boolean(self, name: str, default: object = _MISSING) -> Any:
        value = self._raw(name, default)
        if not isinstance(value, bool):
            raise self._bad(name, value, "true or false")
        return value

    def string(self, name: str, default: object = _MISSING) -> Any:
        value = self._raw(name, default)
        if not isinstance(value, str):
            raise self._bad(name, value, "a string")
        return value

    def int_list(self, name: str, default: object = _MISSING) -> Any:
        value = self._raw(name, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self._bad(name, value, "a list of integers")
        return tuple(value)

    def str_list(self, name: str) -> tuple[str, ...]:
        value = self._raw(name, _MISSING)
        if not isinstance(value, list) or any(not isinstance(v, str) for v in value):
            raise self._bad(name, value, "a list of strings")
        return tuple(value)

    def section(self, name: str, optional: bool = False) -> _Section | None:
        value = self._raw(name, None if optional else _MISSING)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            raise self._bad(name, value, "a JSON object")
        return _Section(value, f"{self.key(name)}.")


def _parse_quantization(q: _Section) -> dict[str, Any]:
    block = q.int_list("weight_block_size")
    return {
        "quant_method": q.string("quant_method"),
        "expert_dtype": q.string("expert_dtype"),
        "activation_scheme": q.string("activation_scheme"),
        "weight_block_size": block,
        "scale_fmt": q.string("scale_fmt"),
    }


def _parse_rope_scaling(t: _Section) -> dict[str, Any] | None:
    if not t.present("rope_scaling"):
        return None
    raw = t._raw("rope_scaling", _MISSING)
    if raw is None or raw == {}:
        return None
    r = t.section("rope_scaling")
    assert r is not None
    return {
        "factor": r.number("factor"),
        "original_max_position_embeddings": r.integer("original_max_position_embeddings"),
        "beta_fast": r.number("beta_fast"),
        "beta_slow": r.number("beta_slow"),
    }


def _parse_text(t: _Section) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "num_key_value_heads",
        "num_attention_heads",
        "head_dim",
        "qk_rope_head_dim",
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
        "n_shared_experts",
        "moe_intermediate_size",
        "dspark_block_size",
        "dspark_markov_rank",
        "dspark_noise_token_id",
        "dspark_n_routed_experts",
        "dspark_num_experts_per_tok",
    ):
        out[name] = t.integer(name)
    for name in ("rms_norm_eps", "attention_dropout", "rope_theta", "compress_rope_theta", "hc_eps"):
        out[name] = t.number(name)
    out["routed_scaling_factor"] = t.number("routed_scaling_factor")
    out["swiglu_limit"] = t.number("swiglu_limit", nullable=True)
    for name in ("hidden_act", "scoring_func", "topk_method"):
        out[name] = t.string(name)
    for name in ("attention_bias", "tie_word_embeddings", "norm_topk_prob"):
        out[name] = t.boolean(name)
    out["num_nextn_predict_layers"] = t.integer("num_nextn_predict_layers", 0)
    out["use_fp4_sparse_kv"] = t.boolean("use_fp4_sparse_kv", True)
    out["hc_shifted"] = t.boolean("hc_shifted", True)
    out["dspark_target_attn_input"] = t.boolean("dspark_target_attn_input", True)
    out["rope_scaling"] = _parse_rope_scaling(t)
    out["compress_ratios"] = t.int_list("compress_ratios")
    out["index_source_layer_ids"] = t.int_list("index_source_layer_ids")
    out["kv_source_layer_ids"] = t.int_list("kv_source_layer_ids")
    out["index_k_source_layer_ids"] = t.int_list("index_k_source_layer_ids", out["kv_source_layer_ids"])
    out["dspark_target_layer_ids"] = t.int_list("dspark_target_layer_ids")
    candidate = t.optional_integer("candidate_source_layer_id")
    out["candidate_source_layer_id"] = candidate
    if candidate is not None:
        out["candidate_topk_blocks"] = t.integer("candidate_topk_blocks")
        out["candidate_block_size"] = t.integer("candidate_block_size")
    engram_ids = t.int_list("engram_layer_ids", ())
    out["engram_layer_ids"] = engram_ids
    if engram_ids:
        for name in (
            "engram_max_ngram_size",
            "engram_vocab_size",
            "engram_n_heads",
            "engram_head_dim",
            "engram_pad_token_id",
            "engram_compressed_vocab_size",
        ):
            out[name] = t.integer(name)
    return out


def _parse_vision(v: _Section) -> dict[str, Any]:
    return {
        "hidden_size": v.integer("hidden_size"),
        "downsample_ratio": v.integer("downsample_ratio"),
        "patch_size": v.integer("patch_size"),
        "max_image_tokens": v.integer("max_image_tokens"),
        "min_pixels": v.integer("min_pixels"),
        "max_wh_ratio": v.number("max_wh_ratio", nullable=True),
    }


def parse_model_config(data: Mapping[str, Any]) -> ParsedConfig:
    """Read every key the loader uses from a ``config.json`` object.

    Raises:
        ValueError: a required key is missing or has the wrong JSON type.
    """
    root = _Section(data, "")
    text = root.section("text_config")
    quant = root.section("quantization_config")
    vision = root.section("vision_config", optional=True)
    assert text is not None and quant is not None
    top: dict[str, Any] = {
        "architectures": root.str_list("architectures"),
        "model_type": root.string("model_type"),
        "dtype": root.string("dtype"),
        "bos_token_id": root.integer("bos_token_id"),
        "eos_token_id": root.integer("eos_token_id"),
        "pad_token_id": root.integer("pad_token_id"),
        "image_token_id": root.integer("image_token_id", None),
        "tokenizer_compatibility": root.string("tokenizer_compatibility", "release"),
    }
    return ParsedConfig(
        top=top,
        text=_parse_text(text),
        quantization=_parse_quantization(quant),
        vision=None if vision is None else _parse_vision(vision),
    )
