"""Checks of the tokenizer files against the configuration (docs/design/model.md, "Tokenizer policy").

Policy ``release`` (the default): BOS ``<｜begin▁of▁sentence｜>`` = 0, EOS ``<｜end▁of▁sentence｜>`` = 1,
``<｜▁pad▁｜>`` = 2; ``tokenizer_config.json`` has ``add_eos_token`` false, a boolean ``add_bos_token`` and a PAD that
is EOS or ``<｜▁pad▁｜>`` (where those keys are present); the 21 multimodal placeholders
``<|place_holder_mm_span_0000|>`` … ``_0020|>`` are, or when registered after the vocabulary would be, ids
129280 … 129300. Policy ``native``: the tokenizer is used as configured. With Engram on, ``<｜▁pad▁｜>`` must be 2 under
either policy. The engine applies the release repairs (forcing BOS on, registering the placeholders); this module only
rejects files the repairs could not make valid.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.errors import CheckpointError

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
PLACEHOLDER_FIRST_ID = 129280
PLACEHOLDERS = tuple(f"<|place_holder_mm_span_{k:04d}|>" for k in range(21))


def _token_text(value: Any) -> Any:
    """``tokenizer_config.json`` stores special tokens as strings or as ``{"content": ...}`` objects."""
    return value.get("content") if isinstance(value, dict) else value


def _check_settings(path: Path) -> None:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    if settings.get("add_eos_token", False) is not False:
        raise CheckpointError(f"{path}: add_eos_token = {settings['add_eos_token']!r}; the release policy needs false")
    if "add_bos_token" in settings and not isinstance(settings["add_bos_token"], bool):
        raise CheckpointError(f"{path}: add_bos_token = {settings['add_bos_token']!r}; must be true or false")
    pad = _token_text(settings.get("pad_token"))
    if pad is not None and pad not in (EOS_TOKEN, PAD_TOKEN):
        raise CheckpointError(f"{path}: pad_token = {pad!r}; the release policy needs {EOS_TOKEN!r} or {PAD_TOKEN!r}")


def check_tokenizer_files(tokenizer_path: Path, settings_path: Path, config: ModelConfig) -> None:
    """Raise ``CheckpointError`` (naming the file) if the tokenizer breaks the configured policy or Engram's rule."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # the tokenizers library raises a bare Exception subclass on malformed files
        raise CheckpointError(f"cannot load {tokenizer_path}: {exc}") from exc
    release = config.tokenizer_compatibility == "release"
    required: dict[str, int] = {PAD_TOKEN: 2} if config.text.engram_enabled else {}
    if release:
        required.update({BOS_TOKEN: 0, EOS_TOKEN: 1, PAD_TOKEN: 2})
    for token, expected in required.items():
        actual = tokenizer.token_to_id(token)
        if actual != expected:
            why = "the release tokenizer policy" if release else "Engram"
            raise CheckpointError(f"{tokenizer_path}: token {token!r} has id {actual}; {why} requires id {expected}")
    if not release:
        return
    _check_settings(settings_path)
    next_id = tokenizer.get_vocab_size(with_added_tokens=True)
    for k, token in enumerate(PLACEHOLDERS):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            token_id, next_id = next_id, next_id + 1
        if token_id != PLACEHOLDER_FIRST_ID + k:
            raise CheckpointError(
                f"{tokenizer_path}: multimodal placeholder {token!r} would get id {token_id}; the release policy "
                f"needs ids {PLACEHOLDER_FIRST_ID}…{PLACEHOLDER_FIRST_ID + 20} (use tokenizer_compatibility 'native' "
                "for a different vocabulary)"
            )
