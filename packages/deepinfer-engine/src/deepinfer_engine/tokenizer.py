"""The engine's tokenizer: `tokenizer.json` loading, encoding, decoding, xgrammar vocabulary, incremental text.

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a checkpoint directory. Encoding follows the release policy
(docs/design/scheduler.md, "Prompts and tokenization"): BOS is prepended when `tokenizer_config.json` asks for it
(`add_bos_token`, default true) and the tokenizer's own post-processor did not already add it. Decoding drops special
tokens (EOS is not shown in text).

`IncrementalDetokenizer` turns a growing list of token ids into text without re-decoding everything each token: it
keeps two offsets into the ids,

    ids:    [ ........ | prefix_offset ....... | read_offset ........ new ids ]
                         decoded as context      text already emitted

and emits the text that decoding `ids[prefix_offset:]` adds beyond `ids[prefix_offset:read_offset]`, holding back
text that ends in an incomplete UTF-8 sequence (U+FFFD) until the next token completes it. Stop strings are searched
in the emitted text only where a new match can begin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer as HFTokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6  # ids decoded before the read offset so merges across token boundaries decode correctly


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """A checkpoint tokenizer.

    Args:
        directory: directory holding `tokenizer.json` (and optionally `tokenizer_config.json`).

    Raises:
        FileNotFoundError: `tokenizer.json` is missing (the message names the directory).
        ValueError: the file cannot be parsed.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in tokenizer directory {str(self.directory)!r}")
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception subclass on malformed files
            raise ValueError(f"cannot load {path}: {exc}") from exc
        settings: dict[str, Any] = {}
        settings_path = self.directory / TOKENIZER_CONFIG_FILE
        if settings_path.is_file():
            settings = json.loads(settings_path.read_text(encoding="utf-8"))
        self._raw = json.loads(self._tokenizer.to_str())
        self.bos_token_id = self._id_of(_token_text(settings.get("bos_token")))
        self.eos_token_id = self._id_of(_token_text(settings.get("eos_token")))
        self.add_bos_token = bool(settings.get("add_bos_token", True)) and self.bos_token_id is not None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Tokens including added ones."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, BOS first when the policy asks for it."""
        ids: list[int] = self._tokenizer.encode(text).ids
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens dropped."""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))

    def encoded_vocab(self) -> list[str]:
        """Every token's stored spelling in id order (what xgrammar's `TokenizerInfo` reads)."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        spelled = [""] * self.vocab_size
        for token, token_id in vocab.items():
            if 0 <= token_id < len(spelled):
                spelled[token_id] = token
        return spelled

    @property
    def vocab_type(self) -> Literal["raw", "byte_fallback", "byte_level"]:
        """How `encoded_vocab` maps to bytes: "byte_level" (GPT-2 style), "byte_fallback" or "raw"."""
        text = json.dumps(self._raw.get("decoder"))
        if "ByteLevel" in text:
            return "byte_level"
        if "ByteFallback" in text:
            return "byte_fallback"
        return "raw"


class IncrementalDetokenizer:
    """Text of one request's generated tokens, extended one token at a time (see the module docstring).

    Args:
        tokenizer: the engine tokenizer.
        stop: stop strings to look for; the text is cut right before the first one found.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self.stop_string: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far."""
        return len(self._ids)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, or None.

        After a stop string is found, `text` ends right before it and later tokens are ignored.
        """
        if self.stop_string is not None:
            return None
        self._ids.append(token_id)
        context = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) or len(full) < len(context):
            return None  # an incomplete UTF-8 sequence: wait for the token that completes it
        new_text = full[len(context) :]
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        search_from = max(len(self.text) - self._max_stop_len + 1, 0)
        self.text += new_text
        if not self._stop:
            return None
        found = [(index, s) for s in self._stop if (index := self.text.find(s, search_from)) >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index]
        self.stop_string = stop
        return stop

    def final_text(self) -> str:
        """The whole text once no token follows: `text` plus any held-back incomplete tail (decoded as U+FFFD), or
        `text` alone when a stop string ended it."""
        if self.stop_string is not None or self._read_offset == len(self._ids):
            return self.text
        context = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        return self.text + self._tokenizer.decode(self._ids[self._prefix_offset :])[len(context) :]
