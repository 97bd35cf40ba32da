"""How a configuration rule reports a violation: ``ValueError`` naming the key, its value and what is allowed."""

from __future__ import annotations


def config_error(key: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def require_equal(key: str, value: object, expected: object) -> None:
    if value != expected or type(value) is not type(expected):
        raise config_error(key, value, f"must be {expected!r}")
