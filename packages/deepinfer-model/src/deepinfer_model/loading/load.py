"""Strict checkpoint loading into stored-format tensors keyed by HF name (docs/design/model.md, "Checkpoint layout").

Flow: ``resolve_model_dir`` → ``open_checkpoint_dir`` (files, index, shard headers, tokenizer) → ``check_coverage``
against the catalogue of the config (every problem collected into one ``CoverageError``) → bytes copied from the
shards straight into one preallocated tensor per catalogue tensor.

The result maps each text-model tensor's HF name (without ``model.``) to a tensor in its stored format: FP8 weights
as ``float8_e4m3fn`` with ``float8_e8m0fnu`` scales, MXFP4 experts as packed ``int8`` bytes with ``float8_e8m0fnu``
scales, BF16 and FP32 as stored. Nothing is dequantized, cast or merged, and each byte is held once (peak host memory
≈ checkpoint size); ``DeepseekV41ForCausalLM.load_weights`` and ``reference.py`` both consume these names (the name
table is ``loading.hf_names``). Tied DSpark copies of ``embed``/``head`` are validated but not read. Vision tensors
(``vision.*``, ``aligner.*``) are checked from the headers like every other tensor but only read when
``load_vision`` is set; they are then returned under their HF names in ``LoadedCheckpoint.vision``.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.catalogue import CatalogueEntry, build_catalogue
from deepinfer_model.loading.checkpoint_dir import CheckpointDir, open_checkpoint_dir, resolve_model_dir
from deepinfer_model.loading.errors import CoverageError
from deepinfer_model.loading.hf_names import is_rejected_name, is_tied_duplicate
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, read_tensor_into

_VISION_PREFIXES = ("vision.", "aligner.")
_READ_THREADS = 8  # concurrent shard readers


@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint.

    Attributes:
        path: the checkpoint directory.
        config: its configuration.
        tensors: HF name (without ``model.``) → stored-format CPU tensor of every text-model tensor.
        vision: HF name → BF16 tensor of the vision tower and projector; empty unless requested.
    """

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    vision: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        tensors = [*self.tensors.values(), *self.vision.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def check_coverage(checkpoint: CheckpointDir, entries: tuple[CatalogueEntry, ...]) -> None:
    """Compare a checkpoint with the catalogue; raise one ``CoverageError`` listing every problem.

    Rules (docs/design/model.md, "Checkpoint layout"): every catalogue tensor present with exactly its shape and dtype;
    no other tensor, except tied DSpark copies of ``embed``/``head`` with the backbone's shape and dtype
    (docs/design/model.md, "Tensor names"); no separate mHC norm tensors; no shard tensor outside the index; each Engram
    table in the same shard as its scale.
    """
    expected = {e.name: e for e in entries}
    present = checkpoint.weight_map
    missing = [name for name in expected if name not in present]
    unexpected, wrong_shape, wrong_dtype, other = [], [], [], []
    for name in present:
        record = checkpoint.record(name)
        entry = expected.get(name)
        if entry is None and is_tied_duplicate(name):
            entry = expected.get(name.split(".", 2)[2])
        if entry is None:
            if is_rejected_name(name):
                other.append(f"{name}: separate mHC norm tensors are not allowed; fold the weight into *_fn")
            else:
                unexpected.append(name)
            continue
        if record.shape != entry.shape:
            wrong_shape.append(f"{name}: stored {list(record.shape)} expected {list(entry.shape)}")
        if record.dtype != entry.dtype:
            wrong_dtype.append(f"{name}: stored {record.dtype} expected {entry.dtype}")
    indexed = {(checkpoint.weight_map[n], checkpoint.stored_names[n]) for n in present}
    for shard, header in checkpoint.shards.items():
        other += [
            f"{t}: present in shard {shard} but not listed in the index"
            for t in header.tensors
            if (shard, t) not in indexed
        ]
    for name in expected:
        if name.endswith("engram.embed.weight"):
            scale = name[: -len("weight")] + "scale"
            if name in present and scale in present and present[name] != present[scale]:
                other.append(f"{name}: must be in the same shard as {scale} ({present[name]} vs {present[scale]})")
    if missing or unexpected or wrong_shape or wrong_dtype or other:
        raise CoverageError(missing, unexpected, wrong_shape, wrong_dtype, other)


def _read_all(checkpoint: CheckpointDir, jobs: list[tuple[str, torch.Tensor]]) -> None:
    """Fill destinations from the shards: one open file per shard, in file order, shards read concurrently.

    ``readinto`` releases the GIL, so threads overlap the I/O of different shards.
    """
    by_shard: dict[str, list[tuple[int, str, torch.Tensor]]] = defaultdict(list)
    for name, out in jobs:
        by_shard[checkpoint.weight_map[name]].append((checkpoint.record(name).offset, name, out))

    def read_shard(shard: str) -> None:
        path = checkpoint.path / shard
        with path.open("rb") as f:
            for _, name, out in sorted(by_shard[shard], key=lambda item: item[0]):
                read_tensor_into(f, path, name, checkpoint.record(name), out)

    if not by_shard:
        return
    with ThreadPoolExecutor(max_workers=min(_READ_THREADS, len(by_shard))) as pool:
        for future in [pool.submit(read_shard, shard) for shard in by_shard]:
            future.result()


def load_checkpoint_dir(directory: str | Path, *, load_vision: bool = False) -> LoadedCheckpoint:
    """Validate and load a local checkpoint directory.

    Args:
        directory: checkpoint directory (``config.json``, index, shards, tokenizer files).
        load_vision: also read the vision tower and projector (they are always validated).

    Raises:
        CheckpointError: a file is missing, unreadable or corrupt (the message names it).
        CoverageError: tensors are missing, unexpected, or have the wrong shape or dtype (all listed at once).
    """
    checkpoint = open_checkpoint_dir(directory)
    entries = build_catalogue(checkpoint.config)
    check_coverage(checkpoint, entries)
    text_entries = [e for e in entries if not e.name.startswith(_VISION_PREFIXES)]
    tensors = {e.name: torch.empty(e.shape, dtype=SAFETENSORS_TO_TORCH[e.dtype]) for e in text_entries}
    jobs = list(tensors.items())
    vision: dict[str, torch.Tensor] = {}
    if load_vision:
        for entry in entries:
            if entry.name.startswith(_VISION_PREFIXES):
                vision[entry.name] = torch.empty(entry.shape, dtype=SAFETENSORS_TO_TORCH[entry.dtype])
                jobs.append((entry.name, vision[entry.name]))
    _read_all(checkpoint, jobs)
    return LoadedCheckpoint(path=checkpoint.path, config=checkpoint.config, tensors=tensors, vision=vision)


def load_checkpoint(
    model: str | Path,
    *,
    local_model_dir: str | Path | None = None,
    revision: str | None = None,
    load_vision: bool = False,
) -> LoadedCheckpoint:
    """Resolve a model argument (directory or Hub repo id, see ``resolve_model_dir``) and load it strictly."""
    directory = resolve_model_dir(model, local_model_dir=local_model_dir, revision=revision)
    return load_checkpoint_dir(directory, load_vision=load_vision)
