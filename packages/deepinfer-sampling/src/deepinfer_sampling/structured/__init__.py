"""Structured output: xgrammar vocabulary, grammar compilation and cache, per-request matchers, token bitmasks.

Flow: ``build_tokenizer_info`` (vocabulary passed in by the engine) → ``GrammarCompilationService.submit`` per request
→ ``poll`` yields a ``RequestGrammarMatcher`` or a ``StructuredOutputError`` → each step ``fill_step_bitmask`` on the
CPU → ``apply_token_bitmask_`` on the device before sampling/verification.
"""

from deepinfer_sampling.structured.bitmask import (
    StepMaskRequest,
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_width,
    fill_step_bitmask,
    unpack_token_bitmask,
)
from deepinfer_sampling.structured.cache import CompiledGrammarCache
from deepinfer_sampling.structured.compiler import (
    SCHEMA_TYPES,
    GrammarBuildResult,
    GrammarCompilationService,
    StructuredOutputConfig,
    StructuredOutputError,
    StructuredOutputSpecLike,
    compile_structured_grammar,
)
from deepinfer_sampling.structured.matcher import MatcherMode, RequestGrammarMatcher
from deepinfer_sampling.structured.vocab import build_tokenizer_info

__all__ = [
    "SCHEMA_TYPES",
    "CompiledGrammarCache",
    "GrammarBuildResult",
    "GrammarCompilationService",
    "MatcherMode",
    "RequestGrammarMatcher",
    "StepMaskRequest",
    "StructuredOutputConfig",
    "StructuredOutputError",
    "StructuredOutputSpecLike",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_width",
    "build_tokenizer_info",
    "compile_structured_grammar",
    "fill_step_bitmask",
    "unpack_token_bitmask",
]
