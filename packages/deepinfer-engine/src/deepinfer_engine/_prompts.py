"""Normalising the arguments of `LLM.generate`: prompt lists, per-prompt sampling parameters."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_sampling import SamplingParams

__all__ = ["ParamsLike", "as_params", "normalize_prompts", "per_prompt_params", "stream_indices"]

ParamsLike = SamplingParams | Mapping[str, Any] | None


def normalize_prompts(
    prompts: str | Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None
) -> tuple[list[str | None], list[Sequence[int] | None]]:
    """Text and token-id lists of equal length (ids win when both are given)."""
    if prompts is None and prompt_token_ids is None:
        raise ValueError("generate needs prompts or prompt_token_ids, got neither")
    texts: list[str | None] = [prompts] if isinstance(prompts, str) else list(prompts or [])
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"prompts[{i}] must be a str, got {type(text).__name__}")
    ids: list[Sequence[int] | None] = _token_id_lists(prompt_token_ids) if prompt_token_ids is not None else []
    if prompts is not None and prompt_token_ids is not None and len(texts) != len(ids):
        raise ValueError(f"prompts has {len(texts)} entries but prompt_token_ids has {len(ids)}; they must match")
    if prompt_token_ids is None:
        ids = [None] * len(texts)
    if prompts is None:
        texts = [None] * len(ids)
    return texts, ids


def _token_id_lists(prompt_token_ids: object) -> list[Sequence[int] | None]:
    """`prompt_token_ids` as one list of ints per prompt.

    Raises:
        TypeError: it is not a list of int lists (a flat list of ints, floats, strings...), naming the first problem.
    """
    if isinstance(prompt_token_ids, str) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}")
    lists: list[Sequence[int] | None] = []
    for i, ids in enumerate(prompt_token_ids):
        if isinstance(ids, numbers.Integral):
            raise TypeError(
                "prompt_token_ids must be a list of token-id lists, one per prompt, but it is a flat list of ints; "
                "for one prompt pass [[id, id, ...]]"
            )
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise TypeError(f"prompt_token_ids[{i}] must be a list of ints, got {type(ids).__name__}")
        for j, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise TypeError(
                    f"prompt_token_ids[{i}][{j}] must be an int token id, got {token!r} ({type(token).__name__})"
                )
        lists.append([int(token) for token in ids])
    return lists


def per_prompt_params(sampling_params: ParamsLike | Sequence[ParamsLike], num: int) -> list[ParamsLike]:
    """One parameters entry per prompt (a single entry is shared)."""
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
        if len(sampling_params) != num:
            raise ValueError(f"{len(sampling_params)} sampling params for {num} prompts; give one or one per prompt")
        return list(sampling_params)
    return [sampling_params] * num


def stream_indices(per_prompt: Sequence[ParamsLike]) -> list[int]:
    """Each prompt's stream index: how many earlier prompts of the call share its parameters object.

    With a `seq_seed` the request seed is keyed by it (`deepinfer_sampling.request_seed`): prompts that share one
    object get distinct streams, and a prompt with its own object keeps its tokens wherever it sits in the call.
    """
    seen: dict[int, int] = {}
    indices = []
    for params in per_prompt:
        key = id(params)  # identity: equal but separate objects are separate requests' own parameters
        indices.append(seen.get(key, 0))
        seen[key] = indices[-1] + 1
    return indices


def as_params(params: ParamsLike) -> SamplingParams:
    """A validated `SamplingParams` (dict entries whose value is None are dropped)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    if isinstance(params, Mapping):
        return SamplingParams(**{k: v for k, v in params.items() if v is not None})
    raise TypeError(f"sampling params must be a SamplingParams, a dict or None, got {type(params).__name__}")
