"""Grammar-constrained sampling with random logits and a real byte-level BPE vocabulary.

Every completed output must decode, parse and satisfy its JSON schema / regex / EBNF grammar. The schema checker
(``json_schema_check.py``) implements exactly the JSON Schema keywords the test schemas use (jsonschema is not a
dependency).

Known xgrammar 0.2.9 looseness, accepted by the checker:
- a string with ``minLength``/``maxLength`` compiles to ``[^"\\\r\n]{m,n}``, which admits raw control characters
  (0x00-0x1f other than CR/LF) that strict JSON forbids, so outputs are parsed with ``json.loads(..., strict=False)``;
- ``ipv4`` octets may be zero-padded (``032``).
"""

from __future__ import annotations

import json
import random
import re
import uuid

import pytest
import torch
import xgrammar as xgr
from json_schema_check import validate_json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer_sampling.speculative import verify_rejection
from deepinfer_sampling.structured import (
    RequestGrammarMatcher,
    StepMaskRequest,
    allocate_token_bitmask,
    apply_token_bitmask_,
    build_tokenizer_info,
    compile_structured_grammar,
    fill_step_bitmask,
)

EOS = "<eos>"
PADDED_VOCAB = 512  # LM-head width above the tokenizer size: padding columns must never be emitted
MAX_STEPS = 2000
SAMPLES_PER_GRAMMAR = 5
NUM_DRAFTS = 3
MAX_SPECULATIVE_STEPS = 150


def _corpus(rng: random.Random) -> list[str]:
    words = ["alpha", "beta", "name", "id", "value", "items", "true", "false", "null", "red", "green", "2024-05-17"]
    docs = []
    for _ in range(1500):
        doc = {
            rng.choice(words): rng.choice([rng.randint(-999, 9999), rng.random() * 100, rng.choice(words), None]),
            "list": [rng.randint(0, 99) for _ in range(rng.randint(0, 4))],
            "nested": {"k": rng.choice(words), "flag": rng.random() < 0.5},
        }
        docs.append(json.dumps(doc))
        docs.append(
            f"{rng.choice(words)}@{rng.choice(words)}.com 10.0.{rng.randint(0, 255)}.1 "
            f"{uuid.UUID(int=rng.getrandbits(128))}"
        )
        docs.append(f"({rng.randint(1, 99)}+{rng.randint(1, 9)})*{rng.randint(1, 9)} #{rng.getrandbits(24):06x}")
    return docs


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(0)), trainer)
    return tok


@pytest.fixture(scope="session")
def compiler(tokenizer: Tokenizer) -> xgr.GrammarCompiler:
    vocab = tokenizer.get_vocab()
    encoded = [""] * len(vocab)
    for token, token_id in vocab.items():
        encoded[token_id] = token
    info = build_tokenizer_info(encoded, "byte_level", PADDED_VOCAB, [vocab[EOS]])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _sample(grammar: xgr.CompiledGrammar, tokenizer: Tokenizer, seed: int) -> str | None:
    """Sample with random logits under the grammar's mask; the decoded text, or None if not finished in time."""
    eos = tokenizer.token_to_id(EOS)
    matcher = RequestGrammarMatcher(grammar, max_rollback_tokens=0)
    bitmask = allocate_token_bitmask(1, PADDED_VOCAB)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, PADDED_VOCAB, generator=generator) * 2.0
        apply_token_bitmask_(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        assert token < tokenizer.get_vocab_size(), f"padding column {token} was emitted"
        assert matcher.accept_token(token), f"sampled token {token} outside the mask was rejected"
        if matcher.is_terminated:
            assert token == eos
            return tokenizer.decode(tokens, skip_special_tokens=False)
        tokens.append(token)
    return None


_ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "zip"],
}

JSON_SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"address": _ADDRESS}, "required": ["address"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer"}]},
    {"type": "number", "minimum": -2.5, "maximum": 10.25},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7},
    {"type": "integer", "minimum": -120, "maximum": -3},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "date-time"},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}, "c": {"type": "boolean"}},
        "required": ["a"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}}, "required": ["ok", "none"]},
    {"type": "object", "properties": {"version": {"const": "v1"}, "n": {"const": 3}}, "required": ["version", "n"]},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "y"]}},
            "required": ["id", "tag"],
        },
        "maxItems": 3,
    },
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, "maxItems": 3},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"enum": [1, 2.5, "three", True, None]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 5}}, "required": ["maybe"]},
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    {
        "type": "object",
        "properties": {
            "l1": {
                "type": "object",
                "properties": {
                    "l2": {
                        "type": "object",
                        "properties": {
                            "l3": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}
                        },
                        "required": ["l3"],
                    }
                },
                "required": ["l2"],
            }
        },
        "required": ["l1"],
    },
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
                "required": ["kind", "r"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                "required": ["kind", "side"],
            },
        ]
    },
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 5},
    {
        "type": "object",
        "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9} for key in "abcdefgh"},
        "required": list("abcdefgh"),
    },
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}, {"type": "boolean"}]},
    {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 50}, "maxProperties": 3},
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}, "ip": {"type": "string", "format": "ipv4"}},
        "required": ["when", "ip"],
    },
    {
        "type": "object",
        "properties": {"city": {"enum": ["Z\u00fcrich", "\u6771\u4eac", "S\u00e3o Paulo"]}},
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3}
        },
        "required": ["scores"],
    },
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog)s?",
    r"[A-Z][a-z]{2,5} [0-9]+",
    r"#[0-9a-f]{6}",
    r"[a-z]+@[a-z]+\.(com|org)",
]

EBNF_GRAMMARS = {
    'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= factor ("*" factor)*\nfactor ::= [0-9] | "(" expr ")"': (
        lambda text: isinstance(eval(text, {"__builtins__": {}}), int) and re.fullmatch(r"[0-9+*()]+", text)
    ),
    'root ::= "yes" | "no"': lambda text: text in ("yes", "no"),
    'root ::= "[" item ("," item)* "]"\nitem ::= [a-z] [a-z]?': lambda text: re.fullmatch(
        r"\[[a-z]{1,2}(,[a-z]{1,2})*\]", text
    ),
}


def _completed(grammar: xgr.CompiledGrammar, tokenizer: Tokenizer, base_seed: int) -> list[str]:
    outputs = [_sample(grammar, tokenizer, base_seed + i) for i in range(SAMPLES_PER_GRAMMAR)]
    completed = [text for text in outputs if text is not None]
    assert completed, f"none of {SAMPLES_PER_GRAMMAR} random-logit samples finished within {MAX_STEPS} tokens"
    return completed


def test_at_least_thirty_schemas():
    assert len(JSON_SCHEMAS) >= 30


@pytest.mark.parametrize("index", range(len(JSON_SCHEMAS)))
def test_json_schema_outputsvalidate_json(index, compiler, tokenizer):
    schema = JSON_SCHEMAS[index]
    grammar = compile_structured_grammar(compiler, "json_schema", json.dumps(schema))
    for text in _completed(grammar, tokenizer, 1000 * index):
        value = json.loads(text, strict=False)
        validate_json(value, schema, schema.get("$defs", {}))


def test_json_with_an_empty_schema_is_any_json_object(compiler, tokenizer):
    grammar = compile_structured_grammar(compiler, "json", "")
    values = [json.loads(text, strict=False) for text in _completed(grammar, tokenizer, 7)]
    assert all(isinstance(value, dict) for value in values)
    assert xgr.GrammarMatcher(grammar).accept_string('{"a": [1, "x"], "b": null}')
    assert not xgr.GrammarMatcher(grammar).accept_string("[1, 2]")


def test_json_with_a_schema_is_the_json_schema_alias(compiler, tokenizer):
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    grammar = compile_structured_grammar(compiler, "json", schema)
    for text in _completed(grammar, tokenizer, 11):
        value = json.loads(text, strict=False)
        assert set(value) == {"n"} and isinstance(value["n"], int)


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match(pattern, compiler, tokenizer):
    grammar = compile_structured_grammar(compiler, "regex", pattern)
    for text in _completed(grammar, tokenizer, 11):
        assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("grammar_text", list(EBNF_GRAMMARS))
def test_ebnf_outputs_parse(grammar_text, compiler, tokenizer):
    grammar = compile_structured_grammar(compiler, "ebnf", grammar_text)
    for text in _completed(grammar, tokenizer, 13):
        assert EBNF_GRAMMARS[grammar_text](text), (grammar_text, text)


def test_validator_rejects_violations():
    """The hand-written checker must fail on outputs that break the schema, or the tests above prove nothing."""
    with pytest.raises(AssertionError):
        validate_json({"name": "x"}, JSON_SCHEMAS[0], {})
    with pytest.raises(AssertionError):
        validate_json(11, JSON_SCHEMAS[5], {})
    with pytest.raises(AssertionError):
        validate_json({"a": 1, "zzz": 2}, JSON_SCHEMAS[13], {})
    with pytest.raises(AssertionError):
        validate_json("2024-13-30", JSON_SCHEMAS[8], {})


def _speculative_generate(grammar: xgr.CompiledGrammar, tokenizer: Tokenizer, seed: int) -> tuple[str | None, int]:
    """Decode with drafts: a drafter that is grammar-aware 70 % of the time proposes NUM_DRAFTS tokens, the target
    (random logits under the step's bitmask) verifies them, and the committed tokens are fed back to the matcher.
    Returns the decoded text (None if unfinished) and the number of accepted drafts."""
    eos = tokenizer.token_to_id(EOS)
    matcher = RequestGrammarMatcher(grammar, max_rollback_tokens=NUM_DRAFTS + 2)
    generator = torch.Generator().manual_seed(seed)
    scratch = allocate_token_bitmask(1, PADDED_VOCAB)
    # The careless part of the drafter: uniform over the tokenizer's tokens (not the LM head's padding columns).
    uniform = torch.zeros(PADDED_VOCAB)
    uniform[: tokenizer.get_vocab_size()] = 1.0 / tokenizer.get_vocab_size()
    committed: list[int] = []
    output: list[int] = []
    num_accepted_total = 0
    for _ in range(MAX_SPECULATIVE_STEPS):
        # Drafter: walk the grammar tentatively so most drafts are valid, then undo the walk.
        drafts, draft_probs, walked = [], [], 0
        for _ in range(NUM_DRAFTS):
            matcher.fill_bitmask(scratch, 0)
            guided = torch.randn(1, PADDED_VOCAB, generator=generator) * 2.0
            apply_token_bitmask_(guided, scratch)
            probs = 0.7 * torch.softmax(guided[0], dim=-1) + 0.3 * uniform
            draft = int(torch.multinomial(probs, 1, generator=generator))
            drafts.append(draft)
            draft_probs.append(probs)
            if walked == len(drafts) - 1 and matcher.accept_token(draft):
                walked += 1
        matcher.rollback(walked)
        # Masks: feed last step's committed tokens, then one row per draft position.
        bitmask = allocate_token_bitmask(NUM_DRAFTS + 1, PADDED_VOCAB)
        failures = fill_step_bitmask(bitmask, [StepMaskRequest("r", matcher, 0, committed, drafts)])
        assert failures == {}, failures
        logits = torch.randn(NUM_DRAFTS + 1, PADDED_VOCAB, generator=generator) * 2.0
        apply_token_bitmask_(logits, bitmask)
        out = verify_rejection(
            torch.log_softmax(logits, dim=-1),
            torch.tensor([*drafts, -1]),
            torch.stack([*draft_probs, uniform]),
            torch.tensor([NUM_DRAFTS]),
            torch.full((NUM_DRAFTS + 1,), seed, dtype=torch.int64),
            len(output) + torch.arange(NUM_DRAFTS + 1),
        )
        emitted = [t for t in out.output_token_ids.tolist() if t >= 0]
        num_accepted_total += int(out.num_accepted_draft_tokens)
        if eos in emitted:  # stop conditions truncate at the stop token
            emitted = emitted[: emitted.index(eos) + 1]
        committed = emitted
        output += emitted
        if output[-1] == eos:
            fill_step_bitmask(
                allocate_token_bitmask(1, PADDED_VOCAB), [StepMaskRequest("r", matcher, 0, committed, [])]
            )
            assert matcher.is_terminated
            return tokenizer.decode(output[:-1], skip_special_tokens=False), num_accepted_total
    return None, num_accepted_total


@pytest.mark.parametrize("index", [1, 2, 16, 24, 26])
def test_speculative_decoding_under_a_grammar(index, compiler, tokenizer):
    """Rejected drafts are rolled back, the recovered token is drawn from the masked target, and the committed
    tokens always satisfy the grammar (fill_step_bitmask would report a failure otherwise)."""
    schema = JSON_SCHEMAS[index]
    grammar = compile_structured_grammar(compiler, "json_schema", json.dumps(schema))
    finished, accepted = 0, 0
    for seed in range(2):
        text, num_accepted = _speculative_generate(grammar, tokenizer, 100 * index + seed)
        accepted += num_accepted
        if text is not None:
            finished += 1
            validate_json(json.loads(text, strict=False), schema, schema.get("$defs", {}))
    assert finished > 0
    assert accepted > 0, "no draft was ever accepted; the test would not exercise acceptance"
