"""The small sections of ``config.json``: ``quantization_config``, ``rope_scaling`` and ``vision_config``.

Each validates its own keys at construction; ``deepinfer_model.config`` re-exports them with ``TextConfig`` and
``ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_model._config_errors import config_error

__all__ = ["VIT_WIDTH", "QuantizationConfig", "RopeScalingConfig", "VisionConfig"]

VIT_WIDTH = 1024  # fixed width of the vision tower (docs/design/model.md, "Vision tensors")


@dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
    """``quantization_config``: every key must have exactly the value below (docs/design/numerics.md, "Weight formats").

    The values describe the stored formats; no other format is supported.
    """

    quant_method: str = "fp8"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"

    def __post_init__(self) -> None:
        expected = QuantizationConfig.__dataclass_fields__
        for name, spec in expected.items():
            value = getattr(self, name)
            if value != spec.default:
                raise config_error(f"quantization_config.{name}", value, f"must be {spec.default!r}")


@dataclass(frozen=True, kw_only=True)
class RopeScalingConfig:
    """YaRN parameters of ``text_config.rope_scaling`` (docs/design/model.md, "RoPE and YaRN"); ``type``/``rope_type``
    is ignored."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise config_error("text_config.rope_scaling.factor", self.factor, "must be > 0")
        if self.original_max_position_embeddings <= 0:
            raise config_error(
                "text_config.rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                "must be a positive int",
            )


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """``vision_config`` keys the loader reads (docs/design/model.md, "Vision tensors"); the ViT itself is
    fixed."""

    hidden_size: int
    downsample_ratio: int
    patch_size: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None

    def __post_init__(self) -> None:
        if self.hidden_size != VIT_WIDTH:
            raise config_error(
                "vision_config.hidden_size", self.hidden_size, f"must be {VIT_WIDTH} (the fixed ViT width)"
            )
        for key in ("downsample_ratio", "patch_size", "max_image_tokens", "min_pixels"):
            value = getattr(self, key)
            if value <= 0:
                raise config_error(f"vision_config.{key}", value, "must be a positive int")
        if self.max_wh_ratio is not None and not self.max_wh_ratio >= 1:
            raise config_error("vision_config.max_wh_ratio", self.max_wh_ratio, "must be null or a number >= 1")
