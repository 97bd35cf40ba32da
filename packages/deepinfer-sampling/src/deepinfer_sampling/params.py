"""User-facing sampling parameters and the structured-output spec, validated once and frozen.

`SamplingParams` carries every field of the reference release (temperature, top_p, top_k, ignore_eos, max_tokens,
prompt_logprobs, top_logprobs, first_n_token_no_eos, eos_id, so_args, seq_seed, golden_token_ids) with the
reference's defaults and validation, plus stop_token_ids, stop, min_p, repetition/presence/frequency penalties and n.
Normalisation applied in `__post_init__`, after validation:

- `max_tokens == 0` becomes 1 (reference behaviour).
- temperature < `SAMPLING_EPS` means greedy: temperature becomes exactly 0.0 and top_p, top_k and min_p are reset
  to "disabled". The sampler takes the argmax (ties → lowest token id) and reports a one-hot processed distribution.
  (The reference rewrites to temperature 1e-5; exact argmax is the limit of that and needs no random draw.)
- `seq_seed` is reduced modulo 2^64 (so -1 becomes 2^64 - 1).
- List arguments (`golden_token_ids`, `stop_token_ids`, `stop`, `so_args` mappings) become tuples / a
  `StructuredOutputSpec`, so a params object is hashable and safe to share.
- `first_n_token_no_eos = n` masks EOS for the first n generated tokens (the reference only acts on n = 1, the first
  token; larger n generalise it).

Seed semantics. A request's randomness is keyed only by its 64-bit *request seed*, the position of the token being
generated and a stream case (see `seeds.py`). The request seed is never the raw `seq_seed`: the engine calls
`seeds.request_seed(params.seq_seed, ...)`, which mixes

- `seq_seed` with the request's index among the call's samples that share this params object (k × n + sample index
  for the k-th prompt given this object), when `seq_seed` is set: one params object shared by many prompts (or n > 1)
  gives each sample its own stream; a prompt given its own params object gets index 0, so its tokens do not depend
  on where it sits in the call; and re-running the same call with the same `seq_seed` reproduces every sample
  exactly, whatever the batch composition or scheduling;
- the engine seed with the engine's global request counter, when `seq_seed` is None: successive requests differ, and
  two engines built with the same seed that receive the same requests in the same order reproduce each other.

Unlike the reference (which draws `random.getrandbits(64)` at construction), a default `SamplingParams()` therefore
never silently gives all prompts of a call the same random stream.

Stricter than the reference: structured-output specs are validated here (the reference fails them later,
asynchronously), booleans are rejected where an int or float is expected, and `logprobs` (accepted and discarded by
the reference) does not exist.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

SAMPLING_EPS = 1e-5
INT32_MAX = 2**31 - 1
UINT64_MOD = 2**64
MAX_TOP_LOGPROBS = 1000
PENALTY_LIMIT = 2.0

SchemaType = Literal["json_schema", "json", "regex", "ebnf"]
SCHEMA_TYPES: tuple[str, ...] = get_args(SchemaType)
_SPEC_KEYS = frozenset({"schema_type", "schema", "trigger_token_ids", "bound_token_id"})
_FORBIDDEN_SPEC_KEYS = frozenset({"serialized", "bound_token_ids"})


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int in [{low}, {high}], got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _token_id_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of token ids (ints >= 0), got {value!r}")
    return tuple(_check_int(f"{name}[{i}]", v, 0, INT32_MAX) for i, v in enumerate(value))


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a request's output must match; compiled by `deepinfer_sampling.structured`.

    Attributes:
        schema_type: "json_schema" (schema is JSON Schema text), "json" (with a schema: the reference's name for
            json_schema; with an empty schema: any JSON object), "regex" (a regular expression) or "ebnf" (an
            xgrammar EBNF grammar).
        schema: the schema, regex or grammar text; non-empty except for "json" (any JSON object).
        trigger_token_ids: output is unconstrained until this exact token sequence has been generated; empty means
            constrained from the first token. The trigger tokens themselves are not fed to the grammar.
        bound_token_id: if generated while the trigger is pending, the remaining trigger tokens are forced. Requires
            a non-empty trigger.
    """

    schema_type: SchemaType
    schema: str
    trigger_token_ids: tuple[int, ...] = ()
    bound_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.schema_type not in SCHEMA_TYPES:
            raise ValueError(f"so_args.schema_type must be one of {SCHEMA_TYPES}, got {self.schema_type!r}")
        if not isinstance(self.schema, str) or (not self.schema and self.schema_type != "json"):
            raise ValueError(
                f"so_args.schema must be a non-empty str for schema_type {self.schema_type!r} (only 'json' accepts "
                f"an empty schema, meaning any JSON object), got {self.schema!r}"
            )
        object.__setattr__(
            self, "trigger_token_ids", _token_id_tuple("so_args.trigger_token_ids", self.trigger_token_ids)
        )
        if self.bound_token_id is not None:
            _check_int("so_args.bound_token_id", self.bound_token_id, 0, INT32_MAX)
            if not self.trigger_token_ids:
                raise ValueError(
                    f"so_args.bound_token_id={self.bound_token_id} requires non-empty trigger_token_ids, got ()"
                )

    @classmethod
    def from_mapping(cls, so_args: Mapping[str, Any]) -> StructuredOutputSpec:
        """Builds a spec from the reference's `so_args` dict (keys as in the dataclass; None values mean absent)."""
        forbidden = sorted(_FORBIDDEN_SPEC_KEYS & so_args.keys())
        if forbidden:
            raise ValueError(f"so_args must not contain {forbidden}; allowed keys are {sorted(_SPEC_KEYS)}")
        unknown = sorted(set(so_args.keys()) - _SPEC_KEYS)
        if unknown:
            raise ValueError(f"so_args has unknown keys {unknown}; allowed keys are {sorted(_SPEC_KEYS)}")
        for key in ("schema_type", "schema"):
            if key not in so_args:
                raise ValueError(f"so_args is missing the required key {key!r}; got keys {sorted(so_args.keys())}")
        trigger = so_args.get("trigger_token_ids")
        return cls(
            schema_type=so_args["schema_type"],
            schema=so_args["schema"],
            trigger_token_ids=() if trigger is None else trigger,
            bound_token_id=so_args.get("bound_token_id"),
        )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. See the module docstring for normalisation and seed semantics.

    Attributes:
        temperature: >= 0; below `SAMPLING_EPS` means greedy (stored as 0.0).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: -1 disables, else 1 … 2^31-1; values >= vocab size behave as disabled.
        ignore_eos: EOS does not stop generation.
        max_tokens: 1 … 2^31-1 generated tokens (0 becomes 1).
        prompt_logprobs: return per-prompt-token processed log-probs.
        top_logprobs: 0 … 1000 alternatives returned per generated token.
        first_n_token_no_eos: EOS is masked for the first n generated tokens.
        eos_id: EOS token id; engines overwrite it with the tokenizer's.
        so_args: structured-output spec (a `StructuredOutputSpec` or the reference's dict).
        seq_seed: 64-bit seed (reduced modulo 2^64) or None for an engine-derived seed.
        golden_token_ids: teacher-forced first output tokens.
        stop_token_ids: generation stops after any of these (besides EOS).
        stop: generation stops when the text ends with any of these strings (non-empty).
        min_p: in [0, 1]; drop tokens whose probability is below min_p × the top probability; 0 disables.
        repetition_penalty: > 0; 1 disables. Logits of tokens seen in the prompt or output are divided by it when
            positive and multiplied by it otherwise.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token already generated.
        frequency_penalty: in [-2, 2]; subtracted from a logit once per previous generation of that token.
        n: number of independent samples for the prompt, 1 … 2^31-1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    max_tokens: int = 16
    prompt_logprobs: bool = False
    top_logprobs: int = 0
    first_n_token_no_eos: int = 0
    eos_id: int = 0
    so_args: StructuredOutputSpec | None = None
    seq_seed: int | None = None
    golden_token_ids: tuple[int, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default=())
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # Checked here, before the generated __init__, so that a misspelt field names the closest real one.
        unknown = [name for name in kwargs if name not in _FIELD_NAMES]
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, _FIELD_NAMES, n=1)
                hints.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
            raise TypeError(
                f"SamplingParams got unknown keyword argument(s) {', '.join(hints)}; the fields are "
                f"{', '.join(_FIELD_NAMES)}"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (values < {SAMPLING_EPS} mean greedy), got {temperature}")
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables), got {top_p}")
        allowed_top_k = f"-1 (disabled) or an int in [1, {INT32_MAX}]"
        top_k = self.top_k
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be {allowed_top_k}, got {top_k!r} ({type(top_k).__name__})")
        if top_k != -1 and not 1 <= top_k <= INT32_MAX:
            raise ValueError(f"top_k must be {allowed_top_k}, got {top_k}")
        _check_bool("ignore_eos", self.ignore_eos)
        max_tokens = 1 if self.max_tokens == 0 and not isinstance(self.max_tokens, bool) else self.max_tokens
        _check_int("max_tokens", max_tokens, 1, INT32_MAX)
        _check_bool("prompt_logprobs", self.prompt_logprobs)
        _check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        _check_int("first_n_token_no_eos", self.first_n_token_no_eos, 0, INT32_MAX)
        _check_int("eos_id", self.eos_id, 0, INT32_MAX)
        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables), got {min_p}")
        repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables), got {repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [{-PENALTY_LIMIT}, {PENALTY_LIMIT}] (0 disables), got {value}")
            set_(self, name, value)
        _check_int("n", self.n, 1, INT32_MAX)

        if self.seq_seed is not None:
            if isinstance(self.seq_seed, bool) or not isinstance(self.seq_seed, int):
                raise TypeError(f"seq_seed must be an int or None, got {self.seq_seed!r} ({type(self.seq_seed)})")
            set_(self, "seq_seed", self.seq_seed % UINT64_MOD)
        if self.golden_token_ids is not None:
            set_(self, "golden_token_ids", _token_id_tuple("golden_token_ids", self.golden_token_ids))
        set_(self, "stop_token_ids", _token_id_tuple("stop_token_ids", self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty str or a sequence of non-empty str, got {self.stop!r}")
        set_(self, "stop", tuple(stop))
        if isinstance(self.so_args, Mapping):
            set_(self, "so_args", StructuredOutputSpec.from_mapping(self.so_args))
        elif self.so_args is not None and not isinstance(self.so_args, StructuredOutputSpec):
            raise TypeError(f"so_args must be a StructuredOutputSpec, a mapping or None, got {self.so_args!r}")

        set_(self, "max_tokens", max_tokens)
        set_(self, "repetition_penalty", repetition_penalty)
        if temperature < SAMPLING_EPS:
            temperature, top_p, min_p = 0.0, 1.0, 0.0
            set_(self, "top_k", -1)
        set_(self, "temperature", temperature)
        set_(self, "top_p", top_p)
        set_(self, "min_p", min_p)

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature was below `SAMPLING_EPS`)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


_FIELD_NAMES = tuple(f.name for f in fields(SamplingParams))
