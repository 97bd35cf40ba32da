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
    hc_*_base, hc_*_scale (block ℓ, runtime id)     "Initial mHC values": read logits −3 except +3 at ℓ mod m,
                                                    write logits 0, comb +3 diagonal / −3 off; scale 0.01
    hc_*_fn                                         N(0, 0.01²) (small, so mixes start near those values)
    hc_head_* (non-shifted only)                    base −3 except +3 at (layer count) mod m; fn N(0, 0.01²)
    vision biases                                   0

Large checkpoints (real widths, hundreds of experts) spend nearly all their time quantizing MXFP4 experts. With
``fast_experts=True`` each MXFP4 weight is drawn directly in its stored form instead: uniformly random e2m1 codes
(random packed bytes) and one UE8M0 scale 2^e for the whole tensor, e = round(log2(in^-0.5 / σ_code)) with
σ_code = sqrt(mean of the 16 squared code values) ≈ 2.93, so the weight's standard deviation stays ≈ in^-0.5. The
format, names, shapes and dtypes are unchanged; only the values differ from the default draw. ``num_workers`` > 1
builds and writes shards in parallel threads (each tensor's value depends only on its name and the seed, so the
files are identical for any number of workers).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer_kernels import quantize_fp8_block, quantize_fp8_per_token_group, quantize_mxfp4
from deepinfer_model.checkpoint.tokenizer import tokenizer_config, tokenizer_json
from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.catalogue import CatalogueEntry, TensorFormat, build_catalogue
from deepinfer_model.loading.checkpoint_dir import CONFIG_FILE, INDEX_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, write_shard

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
_HC_LOGIT = 3.0  # magnitude of the initial read and comb logits (docs/design/model.md, "Initial mHC values")
_HC_SCALE = 0.01
_HC_FN_STD = 0.01
_FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # e2m1, uniform codes
_UE8M0_BIAS = 127


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _hc_base(m: int, layer: int) -> torch.Tensor:
    """The initial ``base`` of a sub-layer in block ``layer`` (runtime id): ``[(2+m)·m]`` FP32."""
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
        # Backbone head: stream L mod m; a DSpark head follows the block it closes.
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


def _direct_mxfp4(logical_shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weight drawn in stored form (module docstring, ``fast_experts``).

    Returns:
        packed [N, K/2] int8 (uniformly random bytes, i.e. two uniform e2m1 codes each) and scale [N, K/32]
        float8_e8m0fnu (one value for the whole tensor).
    """
    rows, cols = logical_shape
    num_bytes = rows * cols // 2
    # 8 random bytes per draw: int64 over its full range (the byte count is a multiple of 16 since K % 32 == 0).
    words = torch.empty(num_bytes // 8, dtype=torch.int64).random_(-(2**63), None, generator=gen)
    packed = words.view(torch.int8).view(rows, cols // 2)
    exponent = round(math.log2(cols**-0.5 / _FP4_CODE_RMS))
    scale = torch.full((rows, cols // 32), _UE8M0_BIAS + exponent, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return packed, scale


def logical_value(entry: CatalogueEntry, config: ModelConfig, seed: int) -> torch.Tensor:
    """The random FP32 value of one catalogue weight before it is stored (module docstring): ``[out, in]`` for FP8 and
    MXFP4 weights (the logical shape), the stored shape otherwise. A trainer starts from these values."""
    gen = _generator(seed, entry.name)
    if entry.format in (TensorFormat.FP8_BLOCK, TensorFormat.MXFP4):
        return _normal(entry.logical_shape, entry.logical_shape[1] ** -0.5, gen)
    if entry.format is TensorFormat.FP8_ROW:
        return _normal(entry.shape, 1.0, gen)
    if entry.format in (TensorFormat.BF16, TensorFormat.F32):
        return _plain_value(entry, config, gen)
    raise ValueError(f"catalogue entry {entry.name!r} of format {entry.format} is a scale, not a weight")


def stored_pair(entry: CatalogueEntry, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The stored form of an FP32 ``value`` of one catalogue weight: the weight and, if it has one, its scale.

    FP8 weights are quantized in 32×32 blocks with UE8M0 scales, MXFP4 experts in 1×32 groups, Engram rows in 1×32
    FP8 groups, BF16/F32 tensors are cast (docs/design/numerics.md, "Weight formats").

    Raises:
        ValueError: ``value`` does not have the entry's logical shape.
    """
    expected = entry.logical_shape if entry.format in (TensorFormat.FP8_BLOCK, TensorFormat.MXFP4) else entry.shape
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{entry.name}: value has shape {tuple(value.shape)}, expected {tuple(expected)}")
    value = value.detach().to("cpu", torch.float32).contiguous()
    stem = entry.name[: -len(".weight")] if entry.name.endswith(".weight") else entry.name
    if entry.format is TensorFormat.FP8_BLOCK:
        weight, scale = quantize_fp8_block(value)
    elif entry.format is TensorFormat.MXFP4:
        weight, scale = quantize_mxfp4(value)
    elif entry.format is TensorFormat.FP8_ROW:
        weight, scale = quantize_fp8_per_token_group(value, 32)
    elif entry.format in (TensorFormat.BF16, TensorFormat.F32):
        return [(entry.name, value.to(SAFETENSORS_TO_TORCH[entry.dtype]))]
    else:
        raise ValueError(f"catalogue entry {entry.name!r} of format {entry.format} is a scale, not a weight")
    return [(entry.name, weight), (f"{stem}.scale", scale)]


def tensor_pair(
    entry: CatalogueEntry, config: ModelConfig, seed: int, fast_experts: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Random stored-format value(s) for one catalogue weight: the weight and, if it has one, its scale.

    Args:
        entry: a non-scale catalogue entry.
        config: the model configuration.
        seed: checkpoint seed.
        fast_experts: draw MXFP4 weights directly in stored form (module docstring).

    Returns:
        ``[(name, tensor)]`` or ``[(weight name, weight), (scale name, scale)]``; dtypes as in the catalogue.
    """
    if entry.format is TensorFormat.MXFP4 and fast_experts:
        weight, scale = _direct_mxfp4(entry.logical_shape, _generator(seed, entry.name))
        return [(entry.name, weight), (f"{entry.name.removesuffix('.weight')}.scale", scale)]
    return stored_pair(entry, logical_value(entry, config, seed))


def _units(entries: tuple[CatalogueEntry, ...]) -> Iterator[list[CatalogueEntry]]:
    """Catalogue entries grouped as (weight[, scale]) so a weight and its scale share a shard
    (docs/design/model.md, "Checkpoint layout")."""
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


def _write_one_shard(
    path: Path,
    units: list[list[CatalogueEntry]],
    config: ModelConfig,
    seed: int,
    fast_experts: bool,
    values: Mapping[str, torch.Tensor] | None,
) -> tuple[int, list[str]]:
    """Build and write one shard; returns its tensor bytes and tensor names (in file order)."""
    tensors: dict[str, torch.Tensor] = {}
    for unit in units:
        if values is None:
            tensors.update(tensor_pair(unit[0], config, seed, fast_experts))
        else:
            tensors.update(stored_pair(unit[0], values[unit[0].name]))
    return write_shard(path, tensors, {"format": "pt"}), list(tensors)


def write_checkpoint(
    config: ModelConfig,
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    fast_experts: bool = False,
    num_workers: int = 1,
    values: Mapping[str, torch.Tensor] | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a checkpoint of ``config`` in the released format: random (see the module docstring) or given values.

    Args:
        config: any valid configuration.
        out_dir: destination directory; created if needed; existing checkpoint files in it are overwritten.
        seed: weight seed; the same (config, seed, fast_experts) gives byte-identical files.
        max_shard_bytes: upper bound per shard (a single larger weight+scale unit gets a shard of its own).
        fast_experts: draw MXFP4 weights directly in stored form (module docstring); for real-width checkpoints.
        num_workers: shards built and written at once (threads, >= 1); each holds one shard in memory.
        values: FP32 values of every catalogue weight (no scales; FP8/MXFP4 weights in their logical ``[out, in]``
            shape), e.g. trained ones, stored with ``stored_pair`` instead of the random draw; ``seed`` is then unused.
        tokenizer: the tokenizer to ship; None trains ``build_tokenizer(config)`` on the package corpus.

    Returns:
        The output directory.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = build_catalogue(config)
    if values is not None:
        weights = {e.name for e in entries if e.format is not TensorFormat.SCALE}
        if set(values) != weights:
            missing, extra = sorted(weights - set(values)), sorted(set(values) - weights)
            raise ValueError(f"values must name every catalogue weight: missing {missing[:5]}, unknown {extra[:5]}")
    plan = _plan_shards(entries, max_shard_bytes)
    names = [f"model-{number:05d}-of-{len(plan):05d}.safetensors" for number in range(1, len(plan) + 1)]
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        futures = [
            pool.submit(_write_one_shard, out / name, units, config, seed, fast_experts, values)
            for name, units in zip(names, plan, strict=True)
        ]
        written = [future.result() for future in futures]
    weight_map: dict[str, str] = {}
    total = 0
    for name, (num_bytes, tensor_names) in zip(names, written, strict=True):
        total += num_bytes
        weight_map.update(dict.fromkeys(tensor_names, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
    (out / TOKENIZER_FILE).write_text(tokenizer_json(config, tokenizer), encoding="utf-8")
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config(config), indent=2) + "\n", encoding="utf-8")
    return out
