"""Strict loading of stored-format checkpoint tensors into a module tree through per-parameter ``weight_loader``s.

Every tensor is mapped with ``loading.hf_names.map_hf_name`` (the one name table) and handed to its parameter's
loader (which checks shape and dtype exactly). Coverage is strict both ways: a tensor that maps to no parameter, a
tensor loaded twice, or a parameter (or shard of a merged/expert parameter) left unloaded raises ``ValueError``
naming the first offenders. The one exception: tensors of routed experts an expert-parallel rank does not hold
(``Mxfp4ExpertStack.local_experts``) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer_model.layers.linear import Fp8BlockLinear, Mxfp4ExpertStack, default_weight_loader
from deepinfer_model.loading.hf_names import ShardId, map_hf_name

__all__ = ["expected_shards", "load_named_weights"]

_SHOWN = 5


def expected_shards(module: nn.Module) -> dict[str, set[ShardId]]:
    """Parameter name → the shard ids that must be loaded into it (``{None}`` for plain parameters)."""
    expected: dict[str, set[ShardId]] = {name: {None} for name, _ in module.named_parameters()}
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(sub, Fp8BlockLinear) and sub.shard_sizes is not None:
            shards: set[ShardId] = set(range(len(sub.shard_sizes)))
        elif isinstance(sub, Mxfp4ExpertStack):
            shards = {(e, s) for e in set(sub.local_experts) for s in range(len(sub.shard_sizes))}
        else:
            continue
        expected[f"{dot}weight"] = shards
        expected[f"{dot}scale"] = set(shards)
    return expected


def _held_elsewhere(module: nn.Module) -> dict[str, set[ShardId]]:
    """Parameter name → shards of experts this (expert-parallel) rank does not hold: skipped, never an error."""
    elsewhere: dict[str, set[ShardId]] = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, Mxfp4ExpertStack):
            dot = f"{prefix}." if prefix else ""
            shards: set[ShardId] = {
                (e, s) for e in range(sub.num_experts) if not sub.holds(e) for s in range(len(sub.shard_sizes))
            }
            elsewhere[f"{dot}weight"] = shards
            elsewhere[f"{dot}scale"] = set(shards)
    return elsewhere


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load ``(hf_name, tensor)`` pairs into ``module`` strictly.

    Raises:
        ValueError: unknown tensor, duplicate tensor, or missing parameter/shard after all tensors were consumed.
        TypeError: a dtype differs from the parameter's stored format.
    """
    params = dict(module.named_parameters())
    expected = expected_shards(module)
    elsewhere = _held_elsewhere(module)
    loaded: dict[str, set[ShardId]] = {name: set() for name in params}
    unknown: list[str] = []
    for hf_name, tensor in weights:
        target = map_hf_name(hf_name)
        if target is None:
            continue
        name, shard = target
        param = params.get(name)
        if param is not None and shard in elsewhere.get(name, set()):
            continue
        if param is None or shard not in expected[name]:
            unknown.append(hf_name)
            continue
        if shard in loaded[name]:
            raise ValueError(f"checkpoint tensor {hf_name!r} was given twice")
        param.hf_name = hf_name  # type: ignore[attr-defined]
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            loader(param, tensor.to(param.device), shard)
        loaded[name].add(shard)
    if unknown:
        raise ValueError(f"{len(unknown)} checkpoint tensors match no parameter, e.g. {unknown[:_SHOWN]}")
    missing = [f"{name}{'' if s is None else f' shard {s}'}" for name in params for s in expected[name] - loaded[name]]
    if missing:
        raise ValueError(f"{len(missing)} parameters were not loaded, e.g. {sorted(missing)[:_SHOWN]}")
