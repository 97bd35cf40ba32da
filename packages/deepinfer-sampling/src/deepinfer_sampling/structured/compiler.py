"""Grammar compilation service: background compile threads, timeout, byte-limited cache, failure results.

Flow (docs/design/sampling.md, "Grammar compilation"): the engine calls ``submit`` when a request with ``so_args``
arrives and does not schedule it yet; every step it calls ``poll``, which hands back a ``GrammarBuildResult`` for each
finished build — either a ready ``RequestGrammarMatcher`` or a ``StructuredOutputError`` — ordered by submission (a slow
build never holds back later ones that are done). A build fails (never raises into the engine) on an unsupported schema
type, an invalid trigger/bound, an xgrammar compile error, or when it takes longer than ``compile_timeout_s`` from
submission; the engine then finishes only that request with ``FINISHED_SO_FAILED``. A timed-out compile keeps running in
its thread (threads cannot be interrupted; ``shutdown`` waits for it); its grammar still lands in the cache. Pinning the
compile threads to CPU cores is the engine's business.

Schema types (``StructuredOutputSpec.schema_type`` in ``params.py``):
    ``json_schema``: JSON Schema text, compiled in xgrammar strict mode (no properties or items beyond those the
        schema names, unless it says ``additionalProperties``). ``{"type": "object"}`` admits any JSON object.
    ``json``: the reference's name for ``json_schema`` (docs/design/sampling.md, "Grammar arguments"); identical.
    ``regex``: a regular expression the whole output must match.
    ``ebnf``: an xgrammar EBNF grammar with a ``root`` rule.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import xgrammar as xgr

from deepinfer_sampling.structured.cache import CompiledGrammarCache
from deepinfer_sampling.structured.matcher import RequestGrammarMatcher

SCHEMA_TYPES = ("json_schema", "json", "regex", "ebnf")
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
StructuredOutputErrorKind = Literal["invalid_spec", "compile_error", "timeout", "runtime_error"]


class StructuredOutputSpecLike(Protocol):
    """What the service reads from a request's structured-output spec (``so_args``)."""

    @property
    def schema_type(self) -> str: ...

    @property
    def schema(self) -> str: ...

    @property
    def trigger_token_ids(self) -> Sequence[int] | None: ...

    @property
    def bound_token_id(self) -> int | None: ...


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Settings of the compilation service.

    Attributes:
        num_compile_threads: background threads compiling grammars.
        xgrammar_max_threads: threads one xgrammar compile may use internally.
        compile_timeout_s: seconds from submission after which a build fails with ``timeout``.
        cache_limit_bytes: byte limit of the compiled-grammar cache; ``None`` unbounded, ``0`` no caching.
        max_rollback_tokens: tokens a matcher can roll back; at least ``nextn + 2``.
    """

    num_compile_threads: int = 4
    xgrammar_max_threads: int = 2
    compile_timeout_s: float = 20.0
    cache_limit_bytes: int | None = 10 * 1024**3
    max_rollback_tokens: int = 7

    def __post_init__(self) -> None:
        if self.num_compile_threads < 1:
            raise ValueError(f"num_compile_threads={self.num_compile_threads} must be >= 1")
        if self.xgrammar_max_threads < 1:
            raise ValueError(f"xgrammar_max_threads={self.xgrammar_max_threads} must be >= 1")
        if not self.compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s={self.compile_timeout_s} must be > 0")
        if self.cache_limit_bytes is not None and self.cache_limit_bytes < 0:
            raise ValueError(f"cache_limit_bytes={self.cache_limit_bytes} must be >= 0 or None (unbounded)")
        if self.max_rollback_tokens < 0:
            raise ValueError(f"max_rollback_tokens={self.max_rollback_tokens} must be >= 0")


@dataclass(frozen=True)
class StructuredOutputError:
    """Why a request's structured output failed; the engine finishes the request with ``FINISHED_SO_FAILED``.

    Attributes:
        kind: ``invalid_spec``, ``compile_error``, ``timeout`` or ``runtime_error``.
        message: human-readable detail naming the offending value.
    """

    kind: StructuredOutputErrorKind
    message: str


@dataclass(frozen=True)
class GrammarBuildResult:
    """Outcome of one submitted build: exactly one of ``matcher`` and ``error`` is set."""

    request_id: str
    matcher: RequestGrammarMatcher | None
    error: StructuredOutputError | None


def compile_structured_grammar(
    compiler: xgr.GrammarCompiler, schema_type: str, grammar_text: str
) -> xgr.CompiledGrammar:
    """Compile one grammar, without caching.

    Args:
        compiler: xgrammar compiler bound to the model vocabulary.
        schema_type: one of ``SCHEMA_TYPES``.
        grammar_text: the JSON Schema, regex or EBNF text.

    Raises:
        ValueError: on an unknown schema type.
        RuntimeError: when xgrammar cannot parse or convert the grammar.
    """
    if schema_type == "json" and not grammar_text.strip():
        # Any JSON object, with any properties.
        return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, strict_mode=False)
    if schema_type in ("json_schema", "json"):
        return compiler.compile_json_schema(grammar_text, strict_mode=True)
    if schema_type == "regex":
        return compiler.compile_regex(grammar_text)
    if schema_type == "ebnf":
        return compiler.compile_grammar(grammar_text)
    raise ValueError(f"schema_type={schema_type!r} is not one of {SCHEMA_TYPES}")


def validate_trigger_and_bound(trigger_token_ids: object, bound_token_id: object) -> str | None:
    """Return why a trigger/bound pair is invalid, or ``None`` when valid
    (docs/design/sampling.md, "Grammar arguments")."""
    if trigger_token_ids is not None:
        if not isinstance(trigger_token_ids, list | tuple):
            return f"trigger_token_ids={trigger_token_ids!r} must be a list of non-negative ints"
        bad = [t for t in trigger_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            return f"trigger_token_ids contains {bad!r}; entries must be non-negative ints"
    if bound_token_id is not None:
        if isinstance(bound_token_id, bool) or not isinstance(bound_token_id, int) or bound_token_id < 0:
            return f"bound_token_id={bound_token_id!r} must be a single non-negative int"
        if not trigger_token_ids:
            return f"bound_token_id={bound_token_id} requires non-empty trigger_token_ids"
    return None


@dataclass
class _PendingBuild:
    request_id: str
    submitted_at: float
    future: concurrent.futures.Future[tuple[RequestGrammarMatcher, float]] | None
    error: StructuredOutputError | None


class GrammarCompilationService:
    """Compiles request grammars on background threads and hands back matchers or failures.

    The thread pool starts on the first ``submit``. One xgrammar compiler (its own cache disabled) is shared by the
    threads; caching is done by a ``CompiledGrammarCache`` keyed by (schema type, schema text).

    Args:
        tokenizer_info: vocabulary description from ``build_tokenizer_info``.
        config: service settings.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, config: StructuredOutputConfig) -> None:
        self.config = config
        self.cache = CompiledGrammarCache(config.cache_limit_bytes)
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=config.xgrammar_max_threads, cache_enabled=False
        )
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[_PendingBuild] = []
        self._lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Builds submitted but not yet returned by ``poll`` (they count as unfinished requests)."""
        with self._lock:
            return len(self._pending)

    def submit(self, request_id: str, spec: StructuredOutputSpecLike) -> None:
        """Start building the matcher of ``request_id``; never raises for a bad spec (that becomes a failure)."""
        submitted_at = time.monotonic()
        error = self._validate(spec)
        future = None
        if error is None:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.config.num_compile_threads, thread_name_prefix="deepinfer-grammar"
                )
            future = self._executor.submit(self._build, spec)
        with self._lock:
            self._pending.append(_PendingBuild(request_id, submitted_at, future, error))

    def poll(self, wait_s: float = 0.0) -> list[GrammarBuildResult]:
        """Return every build that finished, failed or timed out since the last poll, ordered by submission.

        Args:
            wait_s: when nothing is ready yet, wait up to this many seconds for the first result.
        """
        deadline = time.monotonic() + wait_s
        while True:
            results = self._collect()
            remaining = deadline - time.monotonic()
            if results or remaining <= 0:
                return results
            with self._lock:
                futures = [p.future for p in self._pending if p.future is not None]
                earliest = min((p.submitted_at for p in self._pending), default=None)
            if earliest is None:
                return results
            until_timeout = earliest + self.config.compile_timeout_s - time.monotonic()
            concurrent.futures.wait(
                futures, timeout=max(0.0, min(remaining, until_timeout)), return_when=concurrent.futures.FIRST_COMPLETED
            )

    def shutdown(self) -> None:
        """Stop the worker threads (running compiles finish first) and drop pending builds."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        with self._lock:
            self._pending.clear()

    def _validate(self, spec: StructuredOutputSpecLike) -> StructuredOutputError | None:
        if spec.schema_type not in SCHEMA_TYPES:
            return StructuredOutputError(
                "invalid_spec", f"schema_type={spec.schema_type!r} is not one of {SCHEMA_TYPES}"
            )
        if not isinstance(spec.schema, str):
            return StructuredOutputError("invalid_spec", f"schema must be a str, got {type(spec.schema).__name__}")
        reason = validate_trigger_and_bound(spec.trigger_token_ids, spec.bound_token_id)
        if reason is not None:
            return StructuredOutputError("invalid_spec", reason)
        return None

    def _build(self, spec: StructuredOutputSpecLike) -> tuple[RequestGrammarMatcher, float]:
        """Worker body: cached or fresh grammar → matcher, plus the time it finished."""
        # "json" with a schema compiles as "json_schema", so they share cache entries; an empty "json" stays apart.
        is_schema_alias = spec.schema_type == "json" and spec.schema.strip()
        key = ("json_schema" if is_schema_alias else spec.schema_type, spec.schema)
        grammar = self.cache.get(key)
        if grammar is None:
            grammar = compile_structured_grammar(self._compiler, *key)
            self.cache.put(key, grammar)
        matcher = RequestGrammarMatcher(
            grammar,
            tuple(spec.trigger_token_ids or ()),
            spec.bound_token_id,
            max_rollback_tokens=self.config.max_rollback_tokens,
        )
        return matcher, time.monotonic()

    def _collect(self) -> list[GrammarBuildResult]:
        now = time.monotonic()
        timeout = self.config.compile_timeout_s
        results: list[GrammarBuildResult] = []
        with self._lock:
            still_pending: list[_PendingBuild] = []
            for build in self._pending:
                result = self._result_of(build, now, timeout)
                if result is None:
                    still_pending.append(build)
                else:
                    results.append(result)
            self._pending = still_pending
        return results

    @staticmethod
    def _result_of(build: _PendingBuild, now: float, timeout: float) -> GrammarBuildResult | None:
        if build.error is not None:
            return GrammarBuildResult(build.request_id, None, build.error)
        assert build.future is not None
        timed_out = StructuredOutputError(
            "timeout", f"grammar compilation took longer than compile_timeout_s={timeout} s"
        )
        if not build.future.done():
            if now - build.submitted_at <= timeout:
                return None
            build.future.cancel()
            return GrammarBuildResult(build.request_id, None, timed_out)
        exception = build.future.exception()
        if exception is not None:
            error = StructuredOutputError("compile_error", f"{type(exception).__name__}: {exception}")
            return GrammarBuildResult(build.request_id, None, error)
        matcher, finished_at = build.future.result()
        if finished_at - build.submitted_at > timeout:
            return GrammarBuildResult(build.request_id, None, timed_out)
        return GrammarBuildResult(build.request_id, matcher, None)
