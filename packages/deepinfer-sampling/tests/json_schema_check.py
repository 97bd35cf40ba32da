"""A JSON Schema checker for the structured-output tests: exactly the keywords their schemas use.

Known xgrammar 0.2.9 looseness it accepts: ``ipv4`` octets may be zero-padded (``032``).
"""

from __future__ import annotations

import re
import uuid

_TYPE_CHECKS = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _check_format(fmt: str, value: str) -> None:
    # RFC 3339 syntax (a grammar cannot know month lengths; leap second 60 is allowed).
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    time = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
    if fmt == "date":
        assert re.fullmatch(date, value), value
    elif fmt == "date-time":
        assert re.fullmatch(f"{date}T{time}", value), value
    elif fmt == "uuid":
        uuid.UUID(value)
    elif fmt == "ipv4":
        # xgrammar 0.2.9 admits zero-padded octets ("032"), which Python's ipaddress rejects; check the values.
        octets = value.split(".")
        assert len(octets) == 4 and all(o.isdigit() and len(o) <= 3 and int(o) <= 255 for o in octets), value
    elif fmt == "email":
        assert re.fullmatch(r"[^@\s]+@[^@\s]+", value), value
    else:
        raise AssertionError(f"format {fmt} not handled by the test checker")


def validate_json(value: object, schema: dict, defs: dict) -> None:
    """Raise AssertionError unless ``value`` satisfies ``schema`` (the keyword subset the schema tests use)."""
    if "$ref" in schema:
        validate_json(value, defs[schema["$ref"].split("/")[-1]], defs)
        return
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                validate_json(value, option, defs)
                return
            except (AssertionError, ValueError) as exc:
                errors.append(exc)
        raise AssertionError(f"{value!r} matches no anyOf option: {errors}")
    if "const" in schema:
        assert value == schema["const"] and type(value) is type(schema["const"]), (value, schema)
    if "enum" in schema:
        assert any(value == e and type(value) is type(e) for e in schema["enum"]), (value, schema)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(_TYPE_CHECKS[t](value) for t in types), (value, schema)
    if isinstance(value, int | float) and not isinstance(value, bool):
        assert value >= schema.get("minimum", -float("inf")), (value, schema)
        assert value <= schema.get("maximum", float("inf")), (value, schema)
        assert value > schema.get("exclusiveMinimum", -float("inf")), (value, schema)
        assert value < schema.get("exclusiveMaximum", float("inf")), (value, schema)
    if isinstance(value, str):
        assert len(value) >= schema.get("minLength", 0), (value, schema)
        assert len(value) <= schema.get("maxLength", 1 << 30), (value, schema)
        if "pattern" in schema:
            assert re.search(schema["pattern"], value), (value, schema)
        if "format" in schema:
            _check_format(schema["format"], value)
    if isinstance(value, list):
        assert len(value) >= schema.get("minItems", 0), (value, schema)
        assert len(value) <= schema.get("maxItems", 1 << 30), (value, schema)
        prefix = schema.get("prefixItems", [])
        for item, item_schema in zip(value, prefix, strict=False):
            validate_json(item, item_schema, defs)
        rest = value[len(prefix) :]
        if prefix and "items" not in schema:
            assert not rest, f"strict mode allows no items beyond prefixItems: {value!r}"
        for item in rest:
            validate_json(item, schema.get("items", {}), defs)
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, (key, value)
        extra = schema.get("additionalProperties", False)
        for key, item in value.items():
            if key in properties:
                validate_json(item, properties[key], defs)
            elif extra is False:
                raise AssertionError(f"strict mode allows no extra property {key!r} in {value!r}")
            elif isinstance(extra, dict):
                validate_json(item, extra, defs)
