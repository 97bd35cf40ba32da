"""Inputs and scores of the evaluation harness (`eval.py`), free of the engine so they can be checked by hand.

- `load_items` reads the held-out JSONL file (one `{"task", "prompt", "answer"[, "schema"]}` object a line) and says
  which line and key is wrong; `select_items` applies the task filter and the per-task limit.
- `task_accuracy` scores exact matches per task; `schema_violations` checks a parsed JSON value against the subset
  of JSON Schema the records use (type, required, properties, additionalProperties: false, items, enum).
- `text_chunks` cuts a tokenized text into prompts that fit the context; `perplexity` turns their prompt log-probs
  into tokens, mean negative log-likelihood and perplexity.
- `acceptance` sums the per-request draft counters of a drafting run into decode steps, accepted drafts per step and
  acceptance length (tokens emitted per decode step).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EvalInputError",
    "Item",
    "acceptance",
    "is_exact_match",
    "load_items",
    "perplexity",
    "read_text",
    "schema_violations",
    "select_items",
    "task_accuracy",
    "text_chunks",
]

_REQUIRED_KEYS = ("task", "prompt", "answer")
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


class EvalInputError(ValueError):
    """A missing or malformed input file, or a filter naming no task of the file."""


@dataclass(frozen=True)
class Item:
    """One held-out example: greedy generation of `prompt` up to a newline must give exactly `answer`."""

    task: str
    prompt: str
    answer: str
    schema: dict[str, Any] | None = None


def read_text(path: pathlib.Path, what: str) -> str:
    """The file's text, or an `EvalInputError` naming the option (`what`) when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EvalInputError(f"{what} file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalInputError(f"cannot read {what} file {str(path)!r}: {exc}") from None


def load_items(path: pathlib.Path) -> list[Item]:
    """Every item of a JSONL file, in file order; blank lines are skipped.

    Raises:
        EvalInputError: the file is missing or empty, or a line is not a JSON object with non-empty string "task",
            string "prompt" and "answer", and (optionally) an object "schema"; the message names the line.
    """
    items = []
    for number, line in enumerate(read_text(path, "--tasks").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalInputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise EvalInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key in _REQUIRED_KEYS:
            if key not in record:
                raise EvalInputError(f"{where}: missing key {key!r} (each line needs {', '.join(_REQUIRED_KEYS)})")
            if not isinstance(record[key], str):
                raise EvalInputError(f"{where}: key {key!r} must be a string, got {type(record[key]).__name__}")
        if not record["task"]:
            raise EvalInputError(f"{where}: key 'task' must be a non-empty string")
        schema = record.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise EvalInputError(f"{where}: key 'schema' must be a JSON object, got {type(schema).__name__}")
        items.append(Item(record["task"], record["prompt"], record["answer"], schema))
    if not items:
        raise EvalInputError(f"--tasks file {str(path)!r} holds no items")
    return items


def select_items(items: Sequence[Item], tasks: Sequence[str] | None, limit: int | None) -> list[Item]:
    """The items of the named tasks (all when None), at most `limit` per task, in file order.

    Raises:
        EvalInputError: a named task is not in the file (the message lists the tasks it has).
    """
    known = list(dict.fromkeys(item.task for item in items))
    unknown = [task for task in tasks or () if task not in known]
    if unknown:
        raise EvalInputError(f"unknown task(s) {unknown} in --only; the tasks file has {known}")
    wanted = set(tasks) if tasks else set(known)
    taken: dict[str, int] = {}
    chosen = []
    for item in items:
        if item.task in wanted and (limit is None or taken.get(item.task, 0) < limit):
            taken[item.task] = taken.get(item.task, 0) + 1
            chosen.append(item)
    return chosen


def is_exact_match(text: str, answer: str) -> bool:
    """Whether a completion (stop string already cut off) is exactly the answer: no extra space, no case folding."""
    return text == answer


def task_accuracy(items: Sequence[Item], texts: Sequence[str]) -> list[dict[str, Any]]:
    """Per task (sorted by name): {"task", "n", "correct", "accuracy"} for completions `texts` of `items`."""
    if len(items) != len(texts):
        raise ValueError(f"{len(items)} items but {len(texts)} completions")
    counts: dict[str, list[int]] = {}
    for item, text in zip(items, texts, strict=True):
        count = counts.setdefault(item.task, [0, 0])
        count[0] += 1
        count[1] += is_exact_match(text, item.answer)
    return [{"task": t, "n": n, "correct": c, "accuracy": c / n} for t, (n, c) in sorted(counts.items())]


def schema_violations(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """What in `value` breaks `schema` (empty when it conforms), one message per problem with its JSON path.

    Checks "type" (a name or a list of names), "enum", and recursively "required", "properties" and
    "additionalProperties": false of objects and "items" of arrays; other keywords are not checked. Booleans are not
    integers or numbers here, as in JSON Schema.

    Raises:
        ValueError: the schema names a type that JSON Schema does not have.
    """
    problems = []
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        for name in names:
            if name not in _JSON_TYPES:
                allowed = list(_JSON_TYPES)
                raise ValueError(f"schema at {path} has unknown type {name!r}; JSON Schema types are {allowed}")
        is_bool = isinstance(value, bool)
        if not any(isinstance(value, _JSON_TYPES[n]) and (n == "boolean" or not is_bool) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        problems += [f"{path}: missing required key {key!r}" for key in schema.get("required", ()) if key not in value]
        if schema.get("additionalProperties") is False:
            known = schema.get("properties", {})
            problems += [f"{path}: key {key!r} is not allowed" for key in value if key not in known]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                problems += schema_violations(value[key], sub, f"{path}.{key}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, element in enumerate(value):
            problems += schema_violations(element, schema["items"], f"{path}[{index}]")
    return problems


def text_chunks(token_ids: Sequence[int], bos_token_id: int | None, max_prompt_len: int) -> list[list[int]]:
    """Cut a tokenized text (starting with BOS when the tokenizer adds one) into prompts of at most `max_prompt_len`
    tokens. Each prompt starts with BOS, so every text token is scored once (prompt log-probs cover positions 1 …);
    without BOS the first token of each prompt has no log-prob."""
    prefix = [bos_token_id] if bos_token_id is not None and token_ids and token_ids[0] == bos_token_id else []
    body = list(token_ids[len(prefix) :])
    step = max_prompt_len - len(prefix)
    if step < 2:
        raise ValueError(f"a prompt of {max_prompt_len} tokens cannot hold BOS and two text tokens")
    return [prefix + body[start : start + step] for start in range(0, len(body), step)]


def perplexity(chunk_logprobs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """{"tokens", "chunks", "mean_nll", "perplexity"} from each chunk's per-token log-probs (natural log):
    perplexity = exp(−Σ log p / tokens)."""
    values = [v for chunk in chunk_logprobs for v in chunk]
    if not values:
        raise ValueError("no scored tokens: the text is shorter than two tokens")
    if not all(math.isfinite(v) for v in values):
        raise ValueError("a prompt log-prob is not finite")
    mean_nll = -math.fsum(values) / len(values)
    chunks = len(chunk_logprobs)
    return {"tokens": len(values), "chunks": chunks, "mean_nll": mean_nll, "perplexity": math.exp(mean_nll)}


def acceptance(counters: Sequence[tuple[int, int, int]], nextn: int) -> dict[str, Any]:
    """Speculative acceptance from per-request (generated, accepted, verified) draft counters.

    The drafting run ends each request by its length limit alone, so no step emits tokens that are then dropped.
    A request's first token comes from its prompt step, which verifies nothing; every later (decode) step verifies
    up to `nextn` drafts (fewer near the length limit) and emits its accepted drafts plus one token, so a request has
    generated − 1 − accepted decode steps. Acceptance length = tokens emitted per decode step = 1 + accepted drafts
    per decode step.
    """
    generated = sum(c[0] for c in counters)
    accepted = sum(c[1] for c in counters)
    verified = sum(c[2] for c in counters)
    steps = sum(c[0] - 1 - c[1] for c in counters if c[0] > 0)
    return {
        "nextn": nextn,
        "requests": len(counters),
        "generated_tokens": generated,
        "decode_steps": steps,
        "verified_draft_tokens": verified,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / verified if verified else None,
        "mean_accepted_per_step": accepted / steps if steps else None,
        "mean_acceptance_length": 1 + accepted / steps if steps else None,
    }
