"""A small byte-level BPE tokenizer for synthetic checkpoints, trained on the corpus shipped with this package.

The vocabulary has exactly ``vocab_size`` entries and follows the release tokenizer policy
(docs/design/model.md, "Tokenizer policy"):

    id                          token
    --------------------------  ---------------------------------------------------------------
    bos_token_id (0)            <｜begin▁of▁sentence｜>
    eos_token_id (1)            <｜end▁of▁sentence｜>
    pad_token_id (2)            <｜▁pad▁｜>            (Engram requires id 2)
    dspark_noise_token_id       <｜dspark▁noise｜>     (if it does not coincide with the ids above)
    image_token_id              <image>                 (if the config sets one)
    the trained range           256 byte tokens, then BPE merges learned from ``corpus.txt``
    every other id              <｜reserved▁{id}｜>    (special; pads the vocabulary to vocab_size)

Special tokens at ids ``0, 1, 2, …`` (consecutive from 0) come first; the trained range follows them and stops at the
next fixed id. Encoding prepends BOS (so the empty string encodes to ``[bos]``, as the release policy demands).
Training is deterministic: the same config always gives the same ``tokenizer.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from deepinfer_model.config import ModelConfig

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
NOISE_TOKEN = "<｜dspark▁noise｜>"
IMAGE_TOKEN = "<image>"
_BYTE_ALPHABET = 256


def corpus_text() -> str:
    """The training text shipped as package data."""
    return resources.files("deepinfer_model.checkpoint").joinpath("corpus.txt").read_text(encoding="utf-8")


def fixed_tokens(config: ModelConfig) -> dict[int, str]:
    """Token ids the configuration pins to named special tokens."""
    fixed = {config.bos_token_id: BOS_TOKEN, config.eos_token_id: EOS_TOKEN, config.pad_token_id: PAD_TOKEN}
    if len(fixed) != 3:
        raise ValueError(
            f"bos_token_id, eos_token_id and pad_token_id must differ to build a tokenizer, got "
            f"{config.bos_token_id}, {config.eos_token_id}, {config.pad_token_id}"
        )
    fixed.setdefault(config.text.dspark_noise_token_id, NOISE_TOKEN)
    if config.image_token_id is not None:
        if config.image_token_id in fixed:
            raise ValueError(f"image_token_id {config.image_token_id} collides with another special token id")
        fixed[config.image_token_id] = IMAGE_TOKEN
    return fixed


def build_tokenizer(
    config: ModelConfig, corpus: Iterable[str] | None = None, *, split_digits: bool = False
) -> Tokenizer:
    """Train the tokenizer of a synthetic checkpoint for ``config`` (vocabulary size = ``text_config.vocab_size``).

    Args:
        config: the model configuration (vocabulary size and special ids).
        corpus: training text, one string per line or document; None for the corpus shipped with this package.
        split_digits: pre-split every digit into its own token (so numbers are spelt digit by digit, which a model
            that learns arithmetic needs).

    Raises:
        ValueError: the fixed ids leave no room for the 256 byte tokens, or the special ids collide.
    """
    vocab_size = config.text.vocab_size
    fixed = fixed_tokens(config)
    leading: list[str] = []
    while len(leading) in fixed:
        leading.append(fixed[len(leading)])
    limit = min([vocab_size, *(i for i in fixed if i >= len(leading))])
    if limit - len(leading) < _BYTE_ALPHABET:
        raise ValueError(
            f"token ids {sorted(fixed)} leave {limit - len(leading)} ids before the first non-leading special "
            f"token; a byte-level BPE needs at least {_BYTE_ALPHABET} (vocab_size {vocab_size})"
        )
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=limit,
        min_frequency=2,
        special_tokens=leading,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus if corpus is not None else corpus_text().splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    trained = tokenizer.get_vocab_size()
    tail = [fixed.get(i, f"<｜reserved▁{i}｜>") for i in range(trained, vocab_size)]
    tokenizer.add_special_tokens(tail)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, config.bos_token_id)],
    )
    for token_id, token in fixed.items():
        if tokenizer.token_to_id(token) != token_id:
            raise AssertionError(f"tokenizer placed {token!r} at {tokenizer.token_to_id(token)}, expected {token_id}")
    assert tokenizer.get_vocab_size() == vocab_size
    return tokenizer


def tokenizer_config(config: ModelConfig) -> dict[str, Any]:
    """The ``tokenizer_config.json`` object matching ``build_tokenizer`` (docs/design/model.md, "Tokenizer policy")."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": config.text.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }


def tokenizer_json(config: ModelConfig, tokenizer: Tokenizer | None = None) -> str:
    """``tokenizer.json`` text of ``tokenizer`` (default ``build_tokenizer(config)``), pretty-printed, deterministic."""
    chosen = tokenizer if tokenizer is not None else build_tokenizer(config)
    return json.dumps(json.loads(chosen.to_str()), ensure_ascii=False, indent=2) + "\n"
