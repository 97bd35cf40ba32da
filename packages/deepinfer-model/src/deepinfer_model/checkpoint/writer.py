"""Writes a synthetic checkpoint in the exact released format for any configuration.

Output directory::

    config.json                          ModelConfig.to_dict()
    model-0000k-of-0000n.safetensors     every catalogue tensor, in catalogue order, packed into shards
    model.safetensors.index.json         {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
    tokenizer.json, tokenizer_config.json  the byte-level BPE of ``checkpoint.tokenizer``

Weights are random, drawn per tensor from a generator seeded by ``(seed, tensor name)``, so a tensor does not depend
on the sharding or on other tensors. Initialisation (chosen so every activation stays O(1)):

    tensor family                                   value
    ----------------------------------------------  ---------------------------------------------------------
    dense FP8 / MXFP4 / BF16 projections [out, in]  N(0, 1/in), then quantized (quantize_fp8_block, quantize_mxfp4)
    embed.weight, image_*, Engram table rows        N(0, 1) (Engram rows via quantize_fp8_per_token_group, 1×32)
    norm weights, engram.q_weight / k_weight        1 + N(0, 0.1²)
    ffn.gate.bias / bias_vl                         N(0, 0.01²)
    attn.attn_sink                                  N(0, 0.5²)
    hc_*_base, hc_*_scale (block ℓ, runtime id)     model-core §10.12: read logits −3 except +3 at ℓ mod m, write
                                                    logits 0, comb +3 diagonal / −3 off; scale 0.01
    hc_*_fn                                         N(0, 0.01²) (small, so mixes start near §10.12)
    hc_head_* (non-shifted only)                    base −3 except +3 at (layer count) mod m; fn N(0, 0.01²)
    vision biases                                   0
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from deepinfer_kernels import quantize_fp8_block, quantize_fp8_per_token_group, quantize_mxfp4
from deepinfer_model.checkpoint.tokenizer import tokenizer_config, tokenizer_json
from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.catalogue import CatalogueEntry, TensorFormat, build_catalogue
from deepinfer_model.loading.checkpoint_dir import CONFIG_FILE, INDEX_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, write_shard

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
_HC_LOGIT = 3.0  # §10.12 magnitude of the initial read and comb logits
_HC_SCALE = 0.01
_HC_FN_STD = 0.01


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _hc_base(m: int, layer: int) -> torch.Tensor:
    """§10.12 initial ``base`` of a sub-layer in block ``layer`` (runtime id): ``[(2+m)·m]`` FP32."""
    read = torch.full((m,), -_HC_LOGIT)
    read[layer % m] = _HC_LOGIT
    comb = torch.full((m, m), -_HC_LOGIT)
    comb.fill_diagonal_(_HC_LOGIT)
    return torch.cat([read, torch.zeros(m), comb.flatten()])


def _block_layer_id(name: str, config: ModelConfig) -> int:
    """Runtime layer id of a ``layers.{l}.*`` or ``mtp.{i}.*`` tensor."""
    container, index = name.split(".")[:2]
    return int(index) if container == "layers" else config.text.num_hidden_layers + int(index)


def _plain_value(entry: CatalogueEntry, config: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Value of a BF16/F32 tensor (FP32, before the final cast)."""
    name, shape, m = entry.name, entry.shape, config.text.hc_mult
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("hc_attn_base", "hc_ffn_base"):
        return _hc_base(m, _block_layer_id(name, config))
    if leaf == "hc_head_base":
        # Backbone head: §10.12 uses L mod m; a DSpark head follows the block it closes.
        target = config.text.num_hidden_layers if name == leaf else _block_layer_id(name, config) + 1
        read = torch.full((m,), -_HC_LOGIT)
        read[target % m] = _HC_LOGIT
        return read
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return _normal(shape, _HC_FN_STD, gen)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return torch.full(shape, _HC_SCALE)
    if leaf == "bias" and name.startswith(("vision.", "aligner.")):
        return torch.zeros(shape)
    if name.endswith(("ffn.gate.bias", "ffn.gate.bias_vl")):
        return _normal(shape, 0.01, gen)
    if leaf == "attn_sink":
        return _normal(shape, 0.5, gen)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "engram.q_weight", "engram.k_weight")):
        return _normal(shape, 0.1, gen, mean=1.0)
    if name in ("embed.weight", "image_start", "image_end", "image_newline") or name.endswith(
        "markov_head.embed.weight"
    ):
        return _normal(shape, 1.0, gen)
    return _normal(shape, shape[-1] ** -0.5, gen)


def tensor_pair(entry: CatalogueEntry, config: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random stored-format value(s) for one catalogue weight: the weight and, if it has one, its scale.

    Args:
        entry: a non-scale catalogue entry.
        config: the model configuration.
        seed: checkpoint seed.

    Returns:
        ``[(name, tensor)]`` or ``[(weight name, weight), (scale name, scale)]``; dtypes as in the catalogue.
    """
    gen = _generator(seed, entry.name)
    stem = entry.name[: -len(".weight")] if entry.name.endswith(".weight") else entry.name
    if entry.format is TensorFormat.FP8_BLOCK:
        weight, scale = quantize_fp8_block(_normal(entry.logical_shape, entry.logical_shape[1] ** -0.5, gen))
    elif entry.format is TensorFormat.MXFP4:
        weight, scale = quantize_mxfp4(_normal(entry.logical_shape, entry.logical_shape[1] ** -0.5, gen))
    elif entry.format is TensorFormat.FP8_ROW:
        weight, scale = quantize_fp8_per_token_group(_normal(entry.shape, 1.0, gen), 32)
    elif entry.format in (TensorFormat.BF16, TensorFormat.F32):
        value = _plain_value(entry, config, gen).to(SAFETENSORS_TO_TORCH[entry.dtype])
        return [(entry.name, value)]
    else:
        raise ValueError(f"catalogue entry {entry.name!r} of format {entry.format} is a scale, not a weight")
    return [(entry.name, weight), (f"{stem}.scale", scale)]


def _units(entries: tuple[CatalogueEntry, ...]) -> Iterator[list[CatalogueEntry]]:
    """Catalogue entries grouped as (weight[, scale]) so a weight and its scale share a shard (§4.4)."""
    index = 0
    while index < len(entries):
        unit = [entries[index]]
        if index + 1 < len(entries) and entries[index + 1].format is TensorFormat.SCALE:
            unit.append(entries[index + 1])
        index += len(unit)
        yield unit


def _plan_shards(entries: tuple[CatalogueEntry, ...], max_shard_bytes: int) -> list[list[list[CatalogueEntry]]]:
    shards: list[list[list[CatalogueEntry]]] = [[]]
    size = 0
    for unit in _units(entries):
        unit_bytes = sum(e.num_bytes for e in unit)
        if shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit_bytes
    return shards


def write_checkpoint(
    config: ModelConfig, out_dir: str | Path, *, seed: int = 0, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Path:
    """Write a random checkpoint of ``config`` in the released format (see the module docstring).

    Args:
        config: any valid configuration.
        out_dir: destination directory; created if needed; existing checkpoint files in it are overwritten.
        seed: weight seed; the same (config, seed) gives byte-identical files.
        max_shard_bytes: upper bound per shard (a single larger weight+scale unit gets a shard of its own).

    Returns:
        The output directory.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = build_catalogue(config)
    plan = _plan_shards(entries, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for number, units in enumerate(plan, start=1):
        shard = f"model-{number:05d}-of-{len(plan):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for unit in units:
            tensors.update(tensor_pair(unit[0], config, seed))
        total += write_shard(out / shard, tensors, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
    (out / TOKENIZER_FILE).write_text(tokenizer_json(config), encoding="utf-8")
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(config), indent=2) + "\n", encoding="utf-8")
    return out
