"""Compilation service, cache, matcher trigger/bound/rollback behaviour and bitmask fill/apply.

Uses a small hand-written raw vocabulary so token ids are readable; the schema tests use a trained BPE vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import xgrammar as xgr

from deepinfer_sampling.structured import (
    CompiledGrammarCache,
    GrammarCompilationService,
    MatcherMode,
    RequestGrammarMatcher,
    StepMaskRequest,
    StructuredOutputConfig,
    allocate_token_bitmask,
    apply_token_bitmask_,
    build_tokenizer_info,
    compile_structured_grammar,
    fill_step_bitmask,
    unpack_token_bitmask,
)

VOCAB = ["<eos>", "a", "b", "c", "0", "1", "2", "{", "}", '"', ":", ",", "<t1>", "<t2>", "<bound>", "ab", "x", "y"]
VOCAB_SIZE = 40  # padded LM head, not a multiple of 32
TOK = {token: i for i, token in enumerate(VOCAB)}
EOS, T1, T2, BOUND = TOK["<eos>"], TOK["<t1>"], TOK["<t2>"], TOK["<bound>"]
SLOW_REGEX = "(" + "|".join(f"w{i}x{i * 7}y" for i in range(3000)) + ")"


@dataclass(frozen=True)
class Spec:
    """A structured-output spec as the service reads it; holds invalid values too, unlike params' validated one."""

    schema_type: str
    schema: object
    trigger_token_ids: object = ()
    bound_token_id: object = None


@pytest.fixture(scope="module")
def info() -> xgr.TokenizerInfo:
    return build_tokenizer_info(VOCAB, "raw", VOCAB_SIZE, [EOS])


@pytest.fixture(scope="module")
def compiler(info) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _allowed(matcher: RequestGrammarMatcher) -> set[int]:
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    return set(torch.nonzero(unpack_token_bitmask(bitmask, VOCAB_SIZE)[0]).flatten().tolist())


def _poll_all(service: GrammarCompilationService, count: int) -> dict:
    results = {}
    while len(results) < count:
        batch = service.poll(wait_s=10.0)
        assert batch, "service returned nothing within 10 s"
        results.update({r.request_id: r for r in batch})
    return results


def _matcher(compiler, schema_type: str, text: str, **kwargs) -> RequestGrammarMatcher:
    kwargs.setdefault("max_rollback_tokens", 8)
    return RequestGrammarMatcher(compile_structured_grammar(compiler, schema_type, text), **kwargs)


# ---- vocabulary -------------------------------------------------------------------------------------------------


def test_build_tokenizer_info_rejects_bad_input():
    with pytest.raises(ValueError, match="vocab_type"):
        build_tokenizer_info(VOCAB, "bpe", VOCAB_SIZE, [EOS])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer_info(VOCAB, "raw", 4, [EOS])
    with pytest.raises(ValueError, match="stop_token_ids"):
        build_tokenizer_info(VOCAB, "raw", VOCAB_SIZE, [VOCAB_SIZE])
    with pytest.raises(TypeError, match="encoded_vocab"):
        build_tokenizer_info(["a", b"b"], "raw", VOCAB_SIZE, [0])


# ---- compilation service ------------------------------------------------------------------------------------------


def test_service_builds_matchers_and_isolates_failures(info):
    service = GrammarCompilationService(info, StructuredOutputConfig(num_compile_threads=2))
    specs = {
        "good-json": Spec("json_schema", json.dumps({"enum": ["ab", "c"]})),
        "bad-json-text": Spec("json_schema", "{not json"),
        "bad-json-type": Spec("json", '{"type": "objec"}'),
        "bad-regex": Spec("regex", "a(b"),
        "bad-ebnf": Spec("ebnf", "root ::= undefined_rule"),
        "bad-type": Spec("yaml", "a: b"),
        "bad-schema-value": Spec("regex", 5),
        "negative-trigger": Spec("regex", "a", trigger_token_ids=[T1, -1]),
        "trigger-not-list": Spec("regex", "a", trigger_token_ids=T1),
        "bound-without-trigger": Spec("regex", "a", bound_token_id=BOUND),
        "bound-list": Spec("regex", "a", trigger_token_ids=[T1], bound_token_id=[BOUND]),
        "good-regex": Spec("regex", "[ab]+c"),
        "good-ebnf": Spec("ebnf", 'root ::= "x" "y"*'),
    }
    for request_id, spec in specs.items():
        service.submit(request_id, spec)
    results = _poll_all(service, len(specs))
    assert service.num_pending == 0
    expected_kind = {
        "bad-json-text": "compile_error",
        "bad-json-type": "compile_error",
        "bad-regex": "compile_error",
        "bad-ebnf": "compile_error",
        "bad-type": "invalid_spec",
        "bad-schema-value": "invalid_spec",
        "negative-trigger": "invalid_spec",
        "trigger-not-list": "invalid_spec",
        "bound-without-trigger": "invalid_spec",
        "bound-list": "invalid_spec",
    }
    for request_id, result in results.items():
        if request_id in expected_kind:
            assert result.matcher is None and result.error is not None
            assert result.error.kind == expected_kind[request_id], (request_id, result.error)
            assert result.error.message
        else:
            assert result.error is None and result.matcher is not None, (request_id, result.error)
    assert "objec" in results["bad-json-type"].error.message
    # The good matchers work.
    assert _allowed(results["good-json"].matcher) == {TOK['"']}
    regex = results["good-regex"].matcher
    assert all(regex.accept_token(TOK[t]) for t in ["ab", "a", "c"]) and regex.accept_token(EOS)
    assert regex.is_terminated
    assert _allowed(results["good-ebnf"].matcher) == {TOK["x"]}
    service.shutdown()


def test_each_poll_returns_finished_builds_in_submission_order(info):
    service = GrammarCompilationService(info, StructuredOutputConfig(num_compile_threads=4))
    ids = [f"r{i}" for i in range(8)]
    for i, request_id in enumerate(ids):
        service.submit(request_id, Spec("regex", f"a{{{i + 1}}}"))
    seen = []
    while len(seen) < len(ids):
        batch = [ids.index(r.request_id) for r in service.poll(wait_s=10.0)]
        assert batch == sorted(batch)
        seen += batch
    assert sorted(seen) == list(range(len(ids)))
    service.shutdown()


def test_compile_timeout_fails_only_that_request(info):
    service = GrammarCompilationService(info, StructuredOutputConfig(compile_timeout_s=1e-3, num_compile_threads=2))
    service.submit("slow", Spec("regex", SLOW_REGEX))
    results = _poll_all(service, 1)
    assert results["slow"].error is not None and results["slow"].error.kind == "timeout"
    assert "compile_timeout_s" in results["slow"].error.message
    service.shutdown()
    patient = GrammarCompilationService(info, StructuredOutputConfig(compile_timeout_s=60.0))
    patient.submit("slow", Spec("regex", SLOW_REGEX))
    patient.submit("fast", Spec("regex", "ab"))
    results = _poll_all(patient, 2)
    assert results["slow"].matcher is not None and results["fast"].matcher is not None
    patient.shutdown()


def test_service_reuses_cached_grammars(info):
    service = GrammarCompilationService(info, StructuredOutputConfig())
    service.submit("a", Spec("json_schema", '{"type": "integer"}'))
    _poll_all(service, 1)
    service.submit("b", Spec("json", '{"type": "integer"}'))  # the alias shares the entry
    service.submit("c", Spec("regex", "abc"))
    _poll_all(service, 2)
    assert len(service.cache) == 2
    assert ("json_schema", '{"type": "integer"}') in service.cache
    service.shutdown()


def test_cache_evicts_least_recently_used_by_bytes(compiler):
    grammars = [compile_structured_grammar(compiler, "regex", f"(ab|c){{{n}}}x") for n in (1, 2, 3)]
    sizes = [g.memory_size_bytes for g in grammars]
    keys = [("regex", f"g{i}") for i in range(3)]
    cache = CompiledGrammarCache(limit_bytes=sizes[0] + sizes[1] + sizes[2] - 1)
    cache.put(keys[0], grammars[0])
    cache.put(keys[1], grammars[1])
    assert cache.get(keys[0]) is grammars[0]  # now keys[1] is least recently used
    cache.put(keys[2], grammars[2])
    assert keys[1] not in cache and keys[0] in cache and keys[2] in cache
    assert cache.num_bytes == sizes[0] + sizes[2] <= sizes[0] + sizes[1] + sizes[2] - 1
    too_small = CompiledGrammarCache(limit_bytes=min(sizes) - 1)
    too_small.put(keys[0], grammars[0])
    assert len(too_small) == 0 and too_small.num_bytes == 0
    unbounded = CompiledGrammarCache(limit_bytes=None)
    for key, grammar in zip(keys, grammars, strict=True):
        unbounded.put(key, grammar)
    assert len(unbounded) == 3 and unbounded.num_bytes == sum(sizes)
    with pytest.raises(ValueError, match="limit_bytes"):
        CompiledGrammarCache(limit_bytes=-1)


def test_config_validation():
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputConfig(compile_timeout_s=0)
    with pytest.raises(ValueError, match="num_compile_threads"):
        StructuredOutputConfig(num_compile_threads=0)
    with pytest.raises(ValueError, match="cache_limit_bytes"):
        StructuredOutputConfig(cache_limit_bytes=-5)


# ---- trigger and bound --------------------------------------------------------------------------------------------


def test_trigger_engages_grammar_after_full_sequence(compiler):
    matcher = _matcher(compiler, "regex", "ab", trigger_token_ids=(T1, T2))
    everything = set(range(VOCAB_SIZE))
    assert matcher.mode == MatcherMode.FREE and _allowed(matcher) == everything
    for token in [TOK["c"], T1, TOK["x"], T2, T1]:  # T2 without T1 right before does not complete it
        assert matcher.accept_token(token) and matcher.mode == MatcherMode.FREE
    assert matcher.accept_token(T2)
    assert matcher.mode == MatcherMode.GRAMMAR and matcher.is_constrained
    # Trigger tokens were not fed to the grammar: it is still at its start.
    assert _allowed(matcher) == {TOK["a"], TOK["ab"]}
    assert matcher.accept_token(TOK["ab"]) and _allowed(matcher) == {EOS}


def test_trigger_matching_handles_overlaps(compiler):
    a, b = TOK["a"], TOK["b"]
    matcher = _matcher(compiler, "regex", "c", trigger_token_ids=(a, a, b))
    for token in [a, a, a]:
        assert matcher.accept_token(token) and matcher.mode == MatcherMode.FREE
    assert matcher.accept_token(b) and matcher.mode == MatcherMode.GRAMMAR


def test_bound_forces_remaining_trigger_tokens(compiler):
    matcher = _matcher(compiler, "regex", "x+", trigger_token_ids=(T1, T2), bound_token_id=BOUND)
    assert matcher.accept_token(TOK["a"]) and matcher.accept_token(BOUND)
    assert matcher.mode == MatcherMode.FORCING
    assert _allowed(matcher) == {T1}
    assert not matcher.accept_token(TOK["x"]) and matcher.mode == MatcherMode.FORCING  # rejected, state unchanged
    assert matcher.accept_token(T1) and _allowed(matcher) == {T2}
    assert matcher.accept_token(T2) and matcher.mode == MatcherMode.GRAMMAR
    assert _allowed(matcher) == {TOK["x"]}


def test_bound_after_partial_trigger_forces_only_the_rest(compiler):
    matcher = _matcher(compiler, "regex", "x", trigger_token_ids=(T1, T2, T1), bound_token_id=T1)
    assert matcher.accept_token(T1)  # the bound is also trigger[0]: progress 1, then forcing
    assert matcher.mode == MatcherMode.FORCING and _allowed(matcher) == {T2}


def test_bound_token_zero_and_bit_31_forcing(compiler):
    # Forcing a token whose bit is the int32 sign bit (id 31) must produce exactly that token.
    matcher = _matcher(compiler, "regex", "x", trigger_token_ids=(31,), bound_token_id=0)
    assert matcher.accept_token(0) and matcher.mode == MatcherMode.FORCING
    assert _allowed(matcher) == {31}


def test_after_stop_token_everything_is_allowed(compiler):
    matcher = _matcher(compiler, "regex", "x")
    assert matcher.accept_token(TOK["x"]) and matcher.accept_token(EOS)
    assert matcher.is_terminated and not matcher.is_constrained
    assert _allowed(matcher) == set(range(VOCAB_SIZE))
    assert matcher.accept_token(TOK["a"]) and matcher.accept_token(EOS)


# ---- rollback -----------------------------------------------------------------------------------------------------


def test_rollback_restores_every_mode(compiler):
    matcher = _matcher(compiler, "regex", "ab", trigger_token_ids=(T1,), bound_token_id=BOUND)
    steps = [TOK["c"], BOUND, T1, TOK["a"], TOK["b"], EOS, TOK["x"]]
    snapshots = []
    for token in steps:
        snapshots.append((matcher.mode, _allowed(matcher)))
        assert matcher.accept_token(token)
    assert matcher.is_terminated
    for undo in range(1, len(steps) + 1):
        matcher.rollback(1)
        assert (matcher.mode, _allowed(matcher)) == snapshots[-undo], f"after undoing {undo} tokens"
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(1)


def test_rollback_is_bounded(compiler):
    matcher = _matcher(compiler, "regex", "a*", max_rollback_tokens=3)
    for _ in range(5):
        assert matcher.accept_token(TOK["a"])
    assert matcher.num_rollback_tokens == 3
    with pytest.raises(ValueError, match="between 0 and 3"):
        matcher.rollback(4)
    matcher.rollback(3)


def test_draft_masks_stop_at_first_rejected_draft_and_roll_back(compiler):
    matcher = _matcher(compiler, "regex", "a+b", max_rollback_tokens=6)
    assert matcher.accept_token(TOK["a"])
    before = _allowed(matcher)
    bitmask = torch.zeros(6, -(-VOCAB_SIZE // 32), dtype=torch.int32)
    drafts = [TOK["a"], TOK["b"], TOK["c"], TOK["a"]]  # "c" is invalid after "a a b"
    assert matcher.fill_bitmask_with_drafts(bitmask, 1, drafts) == 2
    allowed = unpack_token_bitmask(bitmask, VOCAB_SIZE)
    rows = [set(torch.nonzero(allowed[r]).flatten().tolist()) for r in range(6)]
    assert rows[0] == set()  # not this request's row: untouched
    assert rows[1] == rows[2] == {TOK["a"], TOK["ab"], TOK["b"]}
    assert rows[3] == {EOS}
    assert rows[4] == rows[5] == set(range(VOCAB_SIZE))  # unreachable rows stay unmasked
    assert _allowed(matcher) == before and matcher.num_rollback_tokens == 1
    with pytest.raises(ValueError, match="max_rollback_tokens"):
        matcher.fill_bitmask_with_drafts(bitmask, 0, [TOK["a"]] * 7)


def test_rejected_draft_then_commit_of_the_verified_tokens(compiler):
    """After verification rejects a draft, the committed tokens (accepted drafts + recovered token) are fed."""
    matcher = _matcher(compiler, "json_schema", json.dumps({"enum": ["ab", "c"]}), max_rollback_tokens=4)
    bitmask = allocate_token_bitmask(4, VOCAB_SIZE)
    drafts = [TOK['"'], TOK["a"], TOK["b"]]
    assert matcher.fill_bitmask_with_drafts(bitmask, 0, drafts) == 3
    # Verification accepted one draft ('"') and recovered "ab" on the next row (row 1 allowed it).
    assert unpack_token_bitmask(bitmask, VOCAB_SIZE)[1, TOK["ab"]]
    failures = fill_step_bitmask(
        allocate_token_bitmask(1, VOCAB_SIZE),
        [StepMaskRequest("r", matcher, 0, committed_token_ids=[TOK['"'], TOK["ab"]], draft_token_ids=[])],
    )
    assert failures == {}
    assert _allowed(matcher) == {TOK['"']}


# ---- step bitmask and apply ---------------------------------------------------------------------------------------


def test_fill_step_bitmask_aborts_only_the_failing_request(compiler):
    good = _matcher(compiler, "regex", "ab")
    bad = _matcher(compiler, "regex", "x+")
    bitmask = allocate_token_bitmask(4, VOCAB_SIZE)
    requests = [
        StepMaskRequest("bad", bad, 0, committed_token_ids=[TOK["a"]], draft_token_ids=[TOK["x"]]),
        StepMaskRequest("good", good, 2, committed_token_ids=[TOK["a"]], draft_token_ids=[TOK["b"]]),
    ]
    failures = fill_step_bitmask(bitmask, requests)
    assert set(failures) == {"bad"} and failures["bad"].kind == "runtime_error"
    assert "rejected committed token" in failures["bad"].message
    allowed = unpack_token_bitmask(bitmask, VOCAB_SIZE)
    assert allowed[0].all() and allowed[1].all()
    assert set(torch.nonzero(allowed[2]).flatten().tolist()) == {TOK["b"]}
    assert set(torch.nonzero(allowed[3]).flatten().tolist()) == {EOS}


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 257])
def test_apply_token_bitmask_matches_per_token_reference(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=generator)
    bitmask[1] = -1
    bitmask[2] = 0
    logits = torch.randn(5, vocab_size, generator=generator)
    expected = logits.clone()
    for row in range(5):
        for token in range(vocab_size):
            if not (int(bitmask[row, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[2]).all() and torch.isfinite(logits[1]).all()


def test_apply_token_bitmask_rejects_bad_shapes():
    with pytest.raises(ValueError, match="same row count"):
        apply_token_bitmask_(torch.zeros(2, 40), allocate_token_bitmask(3, 40))
    with pytest.raises(ValueError, match="too few"):
        apply_token_bitmask_(torch.zeros(2, 80), allocate_token_bitmask(2, 40))


def test_service_accepts_the_params_spec(info):
    from deepinfer_sampling import SamplingParams

    params = SamplingParams(
        so_args={"schema_type": "regex", "schema": "x+", "trigger_token_ids": [T1], "bound_token_id": BOUND}
    )
    service = GrammarCompilationService(info, StructuredOutputConfig())
    service.submit("r", params.so_args)
    matcher = _poll_all(service, 1)["r"].matcher
    assert matcher is not None and matcher.mode == MatcherMode.FREE
    assert matcher.accept_token(BOUND) and _allowed(matcher) == {T1}
    service.shutdown()
