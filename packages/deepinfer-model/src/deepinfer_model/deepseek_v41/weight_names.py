"""Checkpoint name → parameter mapping of ``DeepseekV41ForCausalLM`` (model-core §4.3, in HF names).

The module tree mirrors the HF names, so most tensors map to the parameter of the same name. The exceptions:

    HF name (after an optional ``model.`` prefix)   parameter                                  shard id
    ----------------------------------------------  -----------------------------------------  --------
    <block>.ffn.shared_experts.w1.{weight,scale}    <block>.ffn.shared_experts.w13.{...}       0
    <block>.ffn.shared_experts.w3.{weight,scale}    <block>.ffn.shared_experts.w13.{...}       1
    <block>.ffn.experts.{e}.w1.{weight,scale}       <block>.ffn.experts.w13.{...}              (e, 0)
    <block>.ffn.experts.{e}.w3.{weight,scale}       <block>.ffn.experts.w13.{...}              (e, 1)
    <block>.ffn.experts.{e}.w2.{weight,scale}       <block>.ffn.experts.w2.{...}               (e, 0)
    vision.*, aligner.*, image_start/end/newline    skipped: not part of the text model
    mtp.{i}.embed.weight, mtp.{i}.head.weight       skipped: tied copies (the loader's ``is_tied_duplicate``)

Separate mHC norm tensors are rejected through the loader's ``is_rejected_name`` (§4.4).
"""

from __future__ import annotations

import re
from typing import Any

from deepinfer_model.loading.hf_names import is_rejected_name, is_tied_duplicate, strip_model_prefix

__all__ = ["map_hf_name"]

_EXPERT = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<expert>\d+)\.(?P<proj>w[123])\.(?P<kind>weight|scale)$")
_SHARED = re.compile(r"^(?P<prefix>.*\.ffn\.shared_experts)\.(?P<proj>w[13])\.(?P<kind>weight|scale)$")
_SKIPPED_PREFIXES = ("vision.", "aligner.")
_SKIPPED_NAMES = frozenset({"image_start", "image_end", "image_newline"})


def map_hf_name(hf_name: str) -> tuple[str, Any] | None:
    """Map one checkpoint tensor name to ``(parameter name, shard id)``; None for tensors the text model skips.

    Raises:
        ValueError: a separate mHC norm tensor (must be folded into ``hc_*_fn``).
    """
    name = strip_model_prefix(hf_name)
    if is_rejected_name(name):
        raise ValueError(f"checkpoint tensor {hf_name!r}: mHC norm weights must be folded into the hc_*_fn matrices")
    if name.startswith(_SKIPPED_PREFIXES) or name in _SKIPPED_NAMES or is_tied_duplicate(name):
        return None
    match = _EXPERT.match(name)
    if match:
        expert, proj = int(match["expert"]), match["proj"]
        target = "w2" if proj == "w2" else "w13"
        return f"{match['prefix']}.{target}.{match['kind']}", (expert, 1 if proj == "w3" else 0)
    match = _SHARED.match(name)
    if match:
        return f"{match['prefix']}.w13.{match['kind']}", 0 if match["proj"] == "w1" else 1
    return name, None
