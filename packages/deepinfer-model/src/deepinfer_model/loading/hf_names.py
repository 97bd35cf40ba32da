"""The one checkpoint-name map: HF tensor name → (parameter of ``DeepseekV41ForCausalLM``, shard id)
(docs/design/model.md, "Tensor names").

The layered model's module tree mirrors the HF names (the reference release's own internal names are not used
anywhere here). The loader (``loading.load``) keys every tensor by its HF name, and
``DeepseekV41ForCausalLM.load_weights`` routes each one through ``map_hf_name`` to a parameter's ``weight_loader``
with the shard id below. Every rule of the table:

    HF name                                       parameter                                     shard id
    --------------------------------------------  --------------------------------------------  ---------
    model.<name>                                  as for <name> (one leading ``model.`` is dropped)
    <block>.ffn.shared_experts.w1.{weight,scale}  <block>.ffn.shared_experts.w13.{weight,scale}  0
    <block>.ffn.shared_experts.w3.{weight,scale}  <block>.ffn.shared_experts.w13.{weight,scale}  1
    <block>.ffn.experts.{e}.w1.{weight,scale}     <block>.ffn.experts.w13.{weight,scale}         (e, 0)
    <block>.ffn.experts.{e}.w3.{weight,scale}     <block>.ffn.experts.w13.{weight,scale}         (e, 1)
    <block>.ffn.experts.{e}.w2.{weight,scale}     <block>.ffn.experts.w2.{weight,scale}          (e, 0)
    mtp.{i}.embed.weight, mtp.{i}.head.weight     skipped (None): tied copies of embed/head
    vision.*, aligner.*                           skipped (None): vision tower and projector
    image_start, image_end, image_newline         skipped (None): image-layout embeddings
    *.hc_attn_norm.weight, *.hc_ffn_norm.weight,  rejected (ValueError): separate mHC norm weights must be
    *.hc_head_norm.weight                         folded into the matching ``*_fn`` matrix
    anything else                                 the same name                                 None

``<block>`` is ``layers.{l}`` (backbone block l) or ``mtp.{i}`` (DSpark block i). The merged ``w13`` parameters hold the
rows ``[w1; w3]`` (docs/design/model.md, "Tensor names"): shard 0 fills the first half of the rows, shard 1 the second;
routed experts are stacked along a leading expert dimension, so expert ``e``'s shard ``s`` fills ``w13[e]``'s half
``s``. A name the table passes through unchanged but the model does not have is reported by the strict coverage check of
``deepseek_v41.weight_loading``. Worked examples:

    model.layers.3.attn.wq_a.scale        → ("layers.3.attn.wq_a.scale", None)
    layers.2.ffn.shared_experts.w3.weight → ("layers.2.ffn.shared_experts.w13.weight", 1)
    mtp.0.ffn.experts.7.w1.scale          → ("mtp.0.ffn.experts.w13.scale", (7, 0))
    mtp.0.head.weight                     → None
"""

from __future__ import annotations

import re
from typing import TypeAlias

__all__ = [
    "MODEL_PREFIX",
    "ShardId",
    "is_rejected_name",
    "is_skipped_name",
    "is_tied_duplicate",
    "map_hf_name",
    "strip_model_prefix",
]

MODEL_PREFIX = "model."

ShardId: TypeAlias = int | tuple[int, int] | None
"""None for a whole parameter, ``s`` for row half ``s`` of a merged ``w13``, ``(e, s)`` for expert ``e``'s half."""

_REJECTED_NORMS = ("hc_attn_norm.weight", "hc_ffn_norm.weight", "hc_head_norm.weight")
_TIED_DSPARK = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_SKIPPED_PREFIXES = ("vision.", "aligner.")
_SKIPPED_NAMES = frozenset({"image_start", "image_end", "image_newline"})
_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<kind>weight|scale)$")
_SHARED = re.compile(r"^(?P<prefix>.*\.ffn\.shared_experts)\.(?P<proj>w[13])\.(?P<kind>weight|scale)$")
_MERGED_PART = {"w1": 0, "w3": 1}


def strip_model_prefix(hf_name: str) -> str:
    """Drop one leading ``model.`` (docs/design/model.md, "Tensor names"); names without it are returned unchanged.

    Callers must reject an index that holds a name both with and without the prefix (``checkpoint_dir`` does).
    """
    return hf_name[len(MODEL_PREFIX) :] if hf_name.startswith(MODEL_PREFIX) else hf_name


def is_rejected_name(hf_name: str) -> bool:
    """True for separate mHC norm tensors, which a checkpoint must fold into ``*_fn``
    (docs/design/model.md, "Checkpoint layout", "Mix logits")."""
    return strip_model_prefix(hf_name).endswith(_REJECTED_NORMS)


def is_tied_duplicate(hf_name: str) -> bool:
    """True for ``mtp.{i}.embed.weight`` / ``mtp.{i}.head.weight``: stored copies of tied tensors
    (docs/design/model.md, "Tensor names")."""
    return _TIED_DSPARK.match(strip_model_prefix(hf_name)) is not None


def is_skipped_name(hf_name: str) -> bool:
    """True for checkpoint tensors the text model does not load: vision tower, projector, image-layout embeddings."""
    name = strip_model_prefix(hf_name)
    return name.startswith(_SKIPPED_PREFIXES) or name in _SKIPPED_NAMES


def map_hf_name(hf_name: str) -> tuple[str, ShardId] | None:
    """Map one checkpoint tensor name (with or without ``model.``) to ``(parameter name, shard id)``.

    Returns:
        The destination per the module table, or None for a tensor the text model skips (tied DSpark copies,
        vision/aligner tensors, image-layout embeddings).

    Raises:
        ValueError: a separate mHC norm tensor, which the format forbids (docs/design/model.md, "Checkpoint layout").
    """
    name = strip_model_prefix(hf_name)
    if is_rejected_name(name):
        raise ValueError(
            f"checkpoint tensor {hf_name!r} is a separate mHC norm weight; the format requires it to be folded into "
            "the matching *_fn matrix"
        )
    if is_skipped_name(name) or is_tied_duplicate(name):
        return None
    match = _EXPERT.match(name)
    if match is not None:
        expert, proj = int(match["expert"]), match["proj"]
        if proj == "w2":
            return f"{match['prefix']}.w2.{match['kind']}", (expert, 0)
        return f"{match['prefix']}.w13.{match['kind']}", (expert, _MERGED_PART[proj])
    match = _SHARED.match(name)
    if match is not None:
        return f"{match['prefix']}.w13.{match['kind']}", _MERGED_PART[match["proj"]]
    return name, None
