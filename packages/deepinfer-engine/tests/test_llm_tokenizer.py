"""The engine tokenizer: BOS policy, xgrammar vocabulary view, and incremental detokenization with stop strings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from llm_support import tiny_dir

from deepinfer_engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(tiny_dir(tmp_path_factory.mktemp("deepinfer-cache")))


def test_encode_prepends_bos_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    assert ids[0] == tokenizer.bos_token_id == 0 and ids.count(0) == 1
    assert tokenizer.encode("") == [0]
    assert tokenizer.decode(ids) == "Hello world"
    assert tokenizer.eos_token_id == 1


def test_vocabulary_view_for_grammars(tokenizer: Tokenizer) -> None:
    vocab = tokenizer.encoded_vocab()
    assert len(vocab) == tokenizer.vocab_size == 1024 and all(vocab)
    assert tokenizer.vocab_type == "byte_level"


def test_incremental_text_equals_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    text = "Gr\u00f6\u00dfe: 42 \u20ac \u2014 na\u00efve caf\u00e9, \u6771\u4eac and ascii words."
    ids = tokenizer.encode(text)[1:]
    for sequence in (ids, [rng.randrange(3, 1000) for _ in range(200)]):
        detokenizer = IncrementalDetokenizer(tokenizer)
        for token_id in sequence:
            assert detokenizer.append(token_id) is None
        assert detokenizer.text == tokenizer.decode(sequence).rstrip("\ufffd")
    assert tokenizer.decode(ids) == text


def test_stop_string_across_token_boundaries(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the weather is nice today")[1:]
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("is ni", "zzz"))
    found = [detokenizer.append(t) for t in ids]
    hits = [f for f in found if f is not None]
    assert hits == ["is ni"]
    assert detokenizer.text == "the weather "
    assert found.index("is ni") < len(ids) - 1  # found before the last token, later tokens are ignored


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in tokenizer directory"):
        Tokenizer(tmp_path)
