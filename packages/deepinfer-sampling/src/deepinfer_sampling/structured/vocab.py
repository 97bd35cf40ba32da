"""Vocabulary description handed to xgrammar.

Sampling never loads a tokenizer. The caller (the engine, which owns the tokenizer) passes the encoded vocabulary —
the token strings or bytes in id order exactly as the tokenizer stores them — together with how they are encoded, the
model's vocabulary size (the LM-head width, which may exceed the tokenizer's size because of padding) and the stop
token ids. This module turns that into an ``xgrammar.TokenizerInfo``.

Glossary:
    encoded vocabulary: ``encoded_vocab[i]`` is the tokenizer's own spelling of token ``i``; for a byte-level BPE this
        is the GPT-2 byte-to-unicode form (``"Ġ"`` for a space), for a raw vocabulary it is the decoded text.
    vocab type: how the encoded vocabulary maps to bytes: ``"raw"``, ``"byte_fallback"`` (SentencePiece ``<0x0A>``
        tokens) or ``"byte_level"`` (GPT-2 byte-to-unicode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import xgrammar as xgr

VocabType = Literal["raw", "byte_fallback", "byte_level"]

_VOCAB_TYPES: dict[str, xgr.VocabType] = {
    "raw": xgr.VocabType.RAW,
    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
    "byte_level": xgr.VocabType.BYTE_LEVEL,
}


def build_tokenizer_info(
    encoded_vocab: Sequence[str | bytes],
    vocab_type: VocabType,
    vocab_size: int,
    stop_token_ids: Sequence[int],
    *,
    add_prefix_space: bool = False,
) -> xgr.TokenizerInfo:
    """Build the xgrammar view of a vocabulary.

    Args:
        encoded_vocab: token spellings in id order; ``len(encoded_vocab) <= vocab_size``. Ids in
            ``[len(encoded_vocab), vocab_size)`` are padding columns of the LM head and can never be emitted under a
            grammar.
        vocab_type: ``"raw"``, ``"byte_fallback"`` or ``"byte_level"``.
        vocab_size: number of logit columns of the model (bitmasks are ``ceil(vocab_size / 32)`` words wide).
        stop_token_ids: ids that end generation (EOS); a grammar accepts one of them once it is complete.
        add_prefix_space: whether the tokenizer prepends a space to the first word (SentencePiece style).

    Returns:
        The ``xgrammar.TokenizerInfo`` to build a ``GrammarCompilationService`` with.

    Raises:
        ValueError: on an unknown vocab type, a vocabulary larger than ``vocab_size``, an empty vocabulary, or a stop id
            outside ``[0, vocab_size)``.
        TypeError: when the entries are not all ``str`` or all ``bytes``.
    """
    if vocab_type not in _VOCAB_TYPES:
        raise ValueError(f"vocab_type={vocab_type!r} is not one of {sorted(_VOCAB_TYPES)}")
    if not encoded_vocab:
        raise ValueError("encoded_vocab is empty; pass the tokenizer's token spellings in id order")
    if len(encoded_vocab) > vocab_size:
        raise ValueError(
            f"encoded_vocab has {len(encoded_vocab)} entries but vocab_size={vocab_size}; vocab_size must be the "
            "LM-head width, at least the tokenizer size"
        )
    first_type = type(encoded_vocab[0])
    for token_id, token in enumerate(encoded_vocab):
        if type(token) is not first_type or not isinstance(token, str | bytes):
            raise TypeError(
                f"encoded_vocab[{token_id}] has type {type(token).__name__}; expected all entries str or all bytes "
                f"(entry 0 is {first_type.__name__})"
            )
    vocab: list[str] | list[bytes] = [t for t in encoded_vocab if isinstance(t, str)] or [
        t for t in encoded_vocab if isinstance(t, bytes)
    ]
    bad_stops = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad_stops:
        raise ValueError(f"stop_token_ids {bad_stops} are outside [0, {vocab_size})")
    return xgr.TokenizerInfo(
        vocab,
        _VOCAB_TYPES[vocab_type],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=add_prefix_space,
    )
