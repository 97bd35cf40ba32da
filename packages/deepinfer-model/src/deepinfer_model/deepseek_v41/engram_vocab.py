"""Compressed Engram vocabulary (docs/design/model.md, "Compressed vocabulary"), built once from the checkpoint's
``tokenizer.json``.

Every tokenizer id is decoded on its own and keyed by its normalized text (NFKC → NFD → accents stripped →
lowercase → whitespace runs collapsed to one space → trimmed, a lone space kept); ids with equal keys share one
compressed id, assigned in order of first appearance. Ids whose text is an incomplete UTF-8 piece (U+FFFD) are keyed
by their raw vocabulary string.
"""

from __future__ import annotations

import re
import unicodedata

import torch
from tokenizers import Tokenizer

from deepinfer_model.deepseek_v41.engram import EngramVocab

__all__ = ["PAD_TOKEN", "engram_vocab_from_tokenizer", "normalize_engram_key"]

PAD_TOKEN = "<｜▁pad▁｜>"
_REQUIRED_PAD_ID = 2
_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")


def normalize_engram_key(text: str) -> str:
    """The ``normalize`` of one decoded token (an empty result is the caller's to replace)."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(char for char in text if unicodedata.category(char) != "Mn").lower()
    text = _WHITESPACE_RUN.sub(" ", text)
    return " " if text == " " else text.strip()


def engram_vocab_from_tokenizer(tokenizer: Tokenizer, pad_token_id: int = _REQUIRED_PAD_ID) -> EngramVocab:
    """Build the compressed vocabulary.

    Args:
        tokenizer: the checkpoint tokenizer (``Tokenizer.from_file("tokenizer.json")``).
        pad_token_id: tokenizer id of the Engram pad (the runtime's ``DEEPINFER_ENGRAM_PAD_TOKEN``, default 2).

    Raises:
        ValueError: the tokenizer does not map ``<｜▁pad▁｜>`` to id 2, or ``pad_token_id`` is out of range.
    """
    pad = tokenizer.token_to_id(PAD_TOKEN)
    if pad != _REQUIRED_PAD_ID:
        raise ValueError(f"Engram needs the tokenizer to map {PAD_TOKEN!r} to id {_REQUIRED_PAD_ID}, got {pad}")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 0 <= pad_token_id < size:
        raise ValueError(f"Engram pad token id {pad_token_id} is outside the tokenizer vocabulary [0, {size})")
    first_seen: dict[str, int] = {}
    ids = []
    for token_id in range(size):
        ids.append(first_seen.setdefault(_token_key(tokenizer, token_id), len(first_seen)))
    return EngramVocab(torch.tensor(ids, dtype=torch.int64), len(first_seen), ids[pad_token_id])


def _token_key(tokenizer: Tokenizer, token_id: int) -> str:
    """Key of one token: its normalized text, or its raw vocabulary string when decoding yields U+FFFD."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        return tokenizer.id_to_token(token_id) or text
    return normalize_engram_key(text) or text
