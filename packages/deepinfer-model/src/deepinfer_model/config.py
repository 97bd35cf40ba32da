"""Frozen, validated model configuration built from a Hugging Face ``config.json``.

This module owns ``ModelConfig``, the whole ``config.json`` of DeepSeek-V4.1-Flash (docs/design/model.md,
"Configuration rules"): its top-level rules, reading and writing it, and the shipped presets; it re-exports the
section types. ``TextConfig`` (``text_config``, with the derived values the rest of the package reads and its rules)
is ``text_config``; the small sections are ``config_sections``. Key reading lives in ``_config_parse``; every type
checks its own fail-fast rules at construction.

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

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from deepinfer_model import _config_parse
from deepinfer_model._config_errors import config_error, require_equal
from deepinfer_model.config_sections import VIT_WIDTH, QuantizationConfig, RopeScalingConfig, VisionConfig
from deepinfer_model.layer_spec import LayerKind, LayerSpec
from deepinfer_model.text_config import TextConfig

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

ARCHITECTURE = "DeepseekV41ForCausalLM"
MODEL_TYPE = "deepseek_v41"
TOKENIZER_POLICIES = ("release", "native")


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
        _validate(self)

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
        return _config_to_dict(self)


def _validate(c: ModelConfig) -> None:
    """Run the top-level rules (architecture, tokenizer policy, special ids); raise ValueError on the first."""
    if c.architectures != (ARCHITECTURE,):
        raise config_error("architectures", list(c.architectures), f"must be [{ARCHITECTURE!r}]")
    require_equal("model_type", c.model_type, MODEL_TYPE)
    require_equal("dtype", c.dtype, "bfloat16")
    if c.tokenizer_compatibility not in TOKENIZER_POLICIES:
        raise config_error("tokenizer_compatibility", c.tokenizer_compatibility, f"must be one of {TOKENIZER_POLICIES}")
    vocab = c.text.vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(c, key)
        if not 0 <= value < vocab:
            raise config_error(key, value, f"must be a token id in [0, {vocab})")
    if c.image_token_id is not None and not 0 < c.image_token_id < vocab:
        raise config_error("image_token_id", c.image_token_id, f"must be a positive in-vocabulary id in [1, {vocab})")
    if c.vision is not None and c.image_token_id is None:
        raise ValueError("config key 'image_token_id' is missing (required when vision_config is present)")


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """Inverse of ``parse_model_config``: a ``config.json`` object with HF key names.

    Keys that are not applicable (candidate keys without a candidate source, Engram keys without Engram layers,
    absent ``rope_scaling``, absent ``image_token_id``) are left out, as a released file would.
    """
    text: dict[str, Any] = {}
    for f in dataclasses.fields(config.text):
        value = getattr(config.text, f.name)
        if value is None and f.name not in ("swiglu_limit", "candidate_source_layer_id"):
            continue
        if f.name == "rope_scaling":
            value = {"type": "yarn", **dataclasses.asdict(value)}
        text[f.name] = _jsonable(value)
    out: dict[str, Any] = {
        "architectures": list(config.architectures),
        "model_type": config.model_type,
        "dtype": config.dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if config.image_token_id is not None:
        out["image_token_id"] = config.image_token_id
    out["tokenizer_compatibility"] = config.tokenizer_compatibility
    out["quantization_config"] = {k: _jsonable(v) for k, v in dataclasses.asdict(config.quantization).items()}
    out["text_config"] = text
    if config.vision is not None:
        out["vision_config"] = dataclasses.asdict(config.vision)
    return out


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
