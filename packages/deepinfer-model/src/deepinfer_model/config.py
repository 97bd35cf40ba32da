"""Frozen, validated model configuration built from a Hugging Face ``config.json``.

This module owns the configuration types of DeepSeek-V4.1-Flash (docs/design/model.md, "Configuration rules") and the
derived values the rest of the package reads: internal sizes without an HF key, the per-layer attention kind, the
cross-layer sharing maps, the YOCO boundary, the Engram table sizes (docs/design/model.md, "Table primes") and the
DSpark sizes. Key reading lives in ``_config_parse``; every fail-fast rule lives in ``_config_checks`` and runs at
construction.

Field names of ``TextConfig``, ``QuantizationConfig`` and ``VisionConfig`` are exactly the HF keys. Keys the loader
does not read (``transformers_version``, ``initializer_range``, ``engram_num_embeddings`` ...) are accepted and dropped.
A configuration without ``vision_config`` is accepted as a text-only model (a documented relaxation of the release).

Glossary:
    runtime layer id: backbone blocks are ``0 … L−1``, DSpark (MTP) blocks ``L … L+N_mtp−1``
        (docs/design/model.md, "Layer stack and runtime layer ids").
    source / consumer: a layer that maps to itself in a sharing map owns the shared object; any other layer reuses
        the object of the layer it maps to (docs/design/model.md, "Layer roles").
    YOCO: "you only cache once"; layers ``n_prefill_layer … L−1`` form the consumer half (docs/design/model.md, "YOCO").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from deepinfer_model import _config_checks, _config_parse, _primes
from deepinfer_model._config_checks import ARCHITECTURE, MODEL_TYPE, TOKENIZER_POLICIES
from deepinfer_model.config_sections import VIT_WIDTH, QuantizationConfig, RopeScalingConfig, VisionConfig
from deepinfer_model.layer_spec import LayerKind, LayerSpec

__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPE",
    "TOKENIZER_POLICIES",
    "VIT_WIDTH",
    "LayerKind",
    "LayerSpec",
    "ModelConfig",
    "QuantizationConfig",
    "RopeScalingConfig",
    "TextConfig",
    "VisionConfig",
    "load_preset",
    "preset_json",
    "preset_names",
]

_RATIO_TO_KIND = {0: LayerKind.SWA, 1: LayerKind.C1, 2: LayerKind.C2}


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """``text_config`` (docs/design/model.md, "Configuration rules"). Field names are the HF keys; defaults are the
    spec's optional defaults.

    ``index_k_source_layer_ids`` defaults to ``kv_source_layer_ids`` (it is filled in by ``from_dict``); the Engram
    keys are None when ``engram_layer_ids`` is empty.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool
    attention_dropout: float
    num_key_value_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    swiglu_limit: float | None
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    compress_ratios: tuple[int, ...]
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    index_source_layer_ids: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_k_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    dspark_block_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_noise_token_id: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    num_nextn_predict_layers: int = 0
    rope_scaling: RopeScalingConfig | None = None
    use_fp4_sparse_kv: bool = True
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    hc_shifted: bool = True
    dspark_target_attn_input: bool = True
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab_size: int | None = None
    engram_pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _config_checks.validate_text_config(self)

    # ---- derived values -----------------------------------------------------------------------------------------

    @property
    def kv_lora_rank(self) -> int:
        """``D − r``: the NoPE part of the shared KV vector."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_norm_group_size(self) -> int:
        """``m·H``: one RMS group over all residual streams."""
        return self.hc_mult * self.hidden_size

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.sliding_window, 0)

    @property
    def hc_mix_size(self) -> int:
        """``(2+m)·m``: rows of every ``hc_*_fn`` / entries of every ``hc_*_base``."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_runtime_layers(self) -> int:
        """``L + N_mtp``: backbone blocks followed by DSpark blocks."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def n_prefill_layer(self) -> int:
        """First index of the whole ``compress_ratios`` list whose value is 1 (the YOCO boundary)."""
        return self.compress_ratios.index(1)

    @property
    def yoco_enabled(self) -> bool:
        return self.n_prefill_layer < self.num_hidden_layers

    @property
    def engram_enabled(self) -> bool:
        return len(self.engram_layer_ids) > 0

    @property
    def shared_intermediate_size(self) -> int:
        """``S·I``: width of the shared-expert block (0 when there is no shared expert)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def dspark_num_targets(self) -> int:
        return len(self.dspark_target_layer_ids)

    # ---- sharing maps (docs/design/model.md, "Layer roles") -------------------------------------------------------

    def _source_map(self, sources: tuple[int, ...]) -> tuple[int, ...]:
        mapping = list(range(self.num_runtime_layers))
        current = sources[0]
        source_set = set(sources)
        for layer in range(sources[0], self.num_hidden_layers):
            if layer in source_set:
                current = layer
            mapping[layer] = current
        return tuple(mapping)

    @cached_property
    def layer_kv_map(self) -> tuple[int, ...]:
        """Runtime layer → layer owning its compressed KV cache (length ``L + N_mtp``)."""
        return self._source_map(self.kv_source_layer_ids)

    @cached_property
    def layer_index_module_map(self) -> tuple[int, ...]:
        """Runtime layer → layer whose indexer produces its top-k (length ``L + N_mtp``)."""
        return self._source_map(self.index_source_layer_ids)

    @cached_property
    def layer_index_k_map(self) -> tuple[int, ...]:
        """Runtime layer → layer owning its index-K cache (length ``L + N_mtp``)."""
        return self._source_map(self.index_k_source_layer_ids)

    @cached_property
    def layer_candidate_source_map(self) -> Mapping[int, int]:
        """Sparse map: layers ``c … L−1`` → candidate source ``c``; empty when no candidate source is set."""
        source = self.candidate_source_layer_id
        if source is None:
            return {}
        return {layer: source for layer in range(source, self.num_hidden_layers)}

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """One ``LayerSpec`` per runtime layer (backbone then DSpark)."""
        engram = set(self.engram_layer_ids)
        specs = []
        for layer in range(self.num_runtime_layers):
            is_backbone = layer < self.num_hidden_layers
            ratio = self.compress_ratios[layer] if is_backbone else 0
            kind = _RATIO_TO_KIND[ratio] if is_backbone else LayerKind.DSPARK
            compressed = kind in (LayerKind.C1, LayerKind.C2)
            specs.append(
                LayerSpec(
                    layer_id=layer,
                    kind=kind,
                    compress_ratio=ratio,
                    kv_source=self.layer_kv_map[layer],
                    index_source=self.layer_index_module_map[layer],
                    index_k_source=self.layer_index_k_map[layer],
                    candidate_source=self.layer_candidate_source_map.get(layer),
                    is_yoco_consumer=is_backbone and self.yoco_enabled and layer >= self.n_prefill_layer,
                    has_engram=layer in engram,
                    rope_theta=self.compress_rope_theta if compressed else self.rope_theta,
                    uses_yarn=compressed and self.rope_scaling is not None,
                )
            )
        return tuple(specs)

    # ---- Engram (docs/design/model.md, "Table primes") ------------------------------------------------------------

    @cached_property
    def engram_table_sizes(self) -> tuple[tuple[int, ...], ...]:
        """Prime sub-table sizes per Engram layer (in ``engram_layer_ids`` order), sub-tables order-major.

        Returns:
            One tuple of ``(N_g − 1)·h_e`` distinct primes ``> V_e − 1`` per Engram layer.
        """
        if not self.engram_enabled:
            return ()
        assert self.engram_max_ngram_size is not None and self.engram_n_heads is not None
        assert self.engram_vocab_size is not None
        used: set[int] = set()
        tables = []
        for _ in self.engram_layer_ids:
            sizes = []
            for _order in range(2, self.engram_max_ngram_size + 1):
                start = self.engram_vocab_size - 1
                for _head in range(self.engram_n_heads):
                    prime = _primes.next_prime(start)
                    while prime in used:
                        prime = _primes.next_prime(prime)
                    used.add(prime)
                    sizes.append(prime)
                    start = prime
            tables.append(tuple(sizes))
        return tuple(tables)

    def engram_num_rows(self, layer: int) -> int:
        """``R_ℓ``: rows of ``layers.{layer}.engram.embed`` (sum of the layer's table sizes)."""
        if layer not in self.engram_layer_ids:
            raise ValueError(f"layer {layer} is not an Engram layer; Engram layers are {list(self.engram_layer_ids)}")
        return sum(self.engram_table_sizes[self.engram_layer_ids.index(layer)])

    @property
    def engram_input_width(self) -> int:
        """``(N_g − 1)·h_e·d_e``: input width of ``engram.wkv`` (0 when Engram is off)."""
        if not self.engram_enabled:
            return 0
        assert self.engram_max_ngram_size is not None and self.engram_n_heads is not None
        assert self.engram_head_dim is not None
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim

    @property
    def softmax_scale(self) -> float:
        """``D^−0.5``, identical for every layer kind."""
        return 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The whole ``config.json`` (docs/design/model.md, "Configuration rules"), validated at construction."""

    text: TextConfig
    quantization: QuantizationConfig
    vision: VisionConfig | None
    architectures: tuple[str, ...] = (ARCHITECTURE,)
    model_type: str = MODEL_TYPE
    dtype: str = "bfloat16"
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int | None = None
    tokenizer_compatibility: str = "release"

    def __post_init__(self) -> None:
        _config_checks.validate_model_config(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Parse and validate a ``config.json`` object; raises ValueError naming the first bad key."""
        parsed = _config_parse.parse_model_config(data)
        rope_scaling = parsed.text.pop("rope_scaling")
        return cls(
            text=TextConfig(
                rope_scaling=None if rope_scaling is None else RopeScalingConfig(**rope_scaling), **parsed.text
            ),
            quantization=QuantizationConfig(**parsed.quantization),
            vision=None if parsed.vision is None else VisionConfig(**parsed.vision),
            **parsed.top,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read, parse and validate a ``config.json`` file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read config file {path}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"config file {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` object of this configuration (HF key names; ``from_dict`` inverts it)."""
        return _config_parse.model_config_to_dict(self)


PRESET_PACKAGE = "deepinfer_model.presets"


def preset_names() -> tuple[str, ...]:
    """Names of the configurations shipped as package data (``deepinfer_model/presets/<name>.json``)."""
    root = resources.files(PRESET_PACKAGE)
    return tuple(sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json")))


def load_preset(name: str) -> ModelConfig:
    """Load a shipped configuration by name (``tiny``, ``v41-flash`` ...).

    Raises:
        ValueError: unknown preset name (the message lists the known names).
    """
    return ModelConfig.from_dict(json.loads(preset_json(name)))


def preset_json(name: str) -> str:
    """The verbatim ``config.json`` text of a shipped preset."""
    names = preset_names()
    if name not in names:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(names)}")
    return resources.files(PRESET_PACKAGE).joinpath(f"{name}.json").read_text(encoding="utf-8")
