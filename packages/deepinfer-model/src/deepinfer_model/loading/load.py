"""Strict checkpoint loading into stored-format tensors keyed by internal names (model-core §4.4–§4.8).

Flow: ``resolve_model_dir`` → ``open_checkpoint_dir`` (files, index, shard headers, tokenizer) → ``check_coverage``
against the catalogue of the config (every problem collected into one ``CoverageError``) → ``plan_layout`` (internal
tensors and where each HF tensor lands) → bytes copied from the shards straight into preallocated tensors.

The result keeps every tensor in its stored format: FP8 weights as ``float8_e4m3fn`` with ``float8_e8m0fnu`` scales,
MXFP4 experts as packed ``int8`` bytes with ``float8_e8m0fnu`` scales, BF16 and FP32 as stored. Nothing is
dequantized or cast, and each byte is held once (peak host memory ≈ checkpoint size). Internal layout:

    internal tensor                                    shape                      from (HF)
    -------------------------------------------------  -------------------------  -----------------------------------
    <block>.experts.shared_experts.0.linear1.weight    [2·S·I, H] e4m3            rows [w1; w3]
    <block>.experts.shared_experts.0.linear1.scale     [2·S·I/32, H/32] e8m0      rows [w1.scale; w3.scale]
    <block>.experts.linear1.weight                     [E, 2I, H/2] int8          expert e: rows [w1; w3]
    <block>.experts.linear1.scale                      [E, 2I, H/32] e8m0         expert e: rows [w1.scale; w3.scale]
    <block>.experts.linear2.weight / .scale            [E, H, I/2] / [E, H, I/32] expert e: w2 / w2.scale
    everything else                                    as stored                  one HF tensor (hf_names table)

``<block>`` is ``layers.{l}`` or ``mtp.{i}.block``. Vision tensors (``vision.*``, ``aligner.*``) are checked from the
headers like every other tensor but only read when ``load_vision`` is set; they are then returned under their HF
names in ``LoadedCheckpoint.vision``.
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
from deepinfer_model.loading.hf_names import InternalTarget, hf_to_internal, is_rejected_name, is_tied_duplicate
from deepinfer_model.loading.safetensors_io import SAFETENSORS_TO_TORCH, read_tensor_into

_VISION_PREFIXES = ("vision.", "aligner.")
_READ_THREADS = 8  # concurrent shard readers


@dataclass(frozen=True)
class Placement:
    """One HF tensor and the internal slot it fills."""

    entry: CatalogueEntry
    target: InternalTarget


@dataclass(frozen=True)
class InternalLayout:
    """Internal tensors to allocate (name → shape, dtype) and the placements that fill them."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    placements: tuple[Placement, ...]


@dataclass
class LoadedCheckpoint:
    """A loaded checkpoint.

    Attributes:
        path: the checkpoint directory.
        config: its configuration.
        tensors: internal name → stored-format CPU tensor (layout in the module docstring), or HF name → tensor
            when loaded with ``hf_names=True``.
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


def plan_layout(entries: tuple[CatalogueEntry, ...]) -> InternalLayout:
    """Internal tensor shapes and dtypes implied by catalogue entries (vision entries excluded)."""
    placements = []
    groups: dict[str, list[Placement]] = defaultdict(list)
    for entry in entries:
        if entry.name.startswith(_VISION_PREFIXES):
            continue
        target = hf_to_internal(entry.name)
        assert target is not None, entry.name
        placement = Placement(entry, target)
        placements.append(placement)
        groups[target.name].append(placement)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for name, members in groups.items():
        first = members[0]
        rows, *rest = first.entry.shape
        shape = (rows * first.target.num_parts, *rest) if rest else (rows * first.target.num_parts,)
        experts = {p.target.expert for p in members}
        if None not in experts:
            shape = (max(e for e in experts if e is not None) + 1, *shape)
        shapes[name] = shape
        dtypes[name] = SAFETENSORS_TO_TORCH[first.entry.dtype]
    return InternalLayout(shapes=shapes, dtypes=dtypes, placements=tuple(placements))


def check_coverage(checkpoint: CheckpointDir, entries: tuple[CatalogueEntry, ...]) -> None:
    """Compare a checkpoint with the catalogue; raise one ``CoverageError`` listing every problem.

    Rules (model-core §4.4): every catalogue tensor present with exactly its shape and dtype; no other tensor, except
    tied DSpark copies of ``embed``/``head`` with the backbone's shape and dtype (§4.6); no separate mHC norm
    tensors; no shard tensor outside the index; each Engram table in the same shard as its scale.
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
                other.append(f"{name}: separate mHC norm tensors are not allowed; fold the weight into *_fn (§4.4)")
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


def _internal_jobs(
    entries: tuple[CatalogueEntry, ...],
) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """Allocate the internal tensors and the (HF name, destination view) copy jobs that fill them."""
    layout = plan_layout(entries)
    tensors = {name: torch.empty(shape, dtype=layout.dtypes[name]) for name, shape in layout.shapes.items()}
    jobs: list[tuple[str, torch.Tensor]] = []
    for placement in layout.placements:
        dest = tensors[placement.target.name]
        if placement.target.expert is not None:
            dest = dest[placement.target.expert]
        rows = placement.entry.shape[0]
        jobs.append((placement.entry.name, dest[placement.target.part * rows : (placement.target.part + 1) * rows]))
    return tensors, jobs


def load_checkpoint_dir(
    directory: str | Path, *, load_vision: bool = False, hf_names: bool = False
) -> LoadedCheckpoint:
    """Validate and load a local checkpoint directory.

    Args:
        directory: checkpoint directory (``config.json``, index, shards, tokenizer files).
        load_vision: also read the vision tower and projector (they are always validated).
        hf_names: key ``tensors`` by HF name (without ``model.``), one tensor per checkpoint tensor and no merges,
            instead of the internal layout (the single-file reference model consumes HF names).

    Raises:
        CheckpointError: a file is missing, unreadable or corrupt (the message names it).
        CoverageError: tensors are missing, unexpected, or have the wrong shape or dtype (all listed at once).
    """
    checkpoint = open_checkpoint_dir(directory)
    entries = build_catalogue(checkpoint.config)
    check_coverage(checkpoint, entries)
    if hf_names:
        text_entries = [e for e in entries if not e.name.startswith(_VISION_PREFIXES)]
        tensors = {e.name: torch.empty(e.shape, dtype=SAFETENSORS_TO_TORCH[e.dtype]) for e in text_entries}
        jobs = list(tensors.items())
    else:
        tensors, jobs = _internal_jobs(entries)
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
    hf_names: bool = False,
) -> LoadedCheckpoint:
    """Resolve a model argument (directory or Hub repo id, see ``resolve_model_dir``) and load it strictly."""
    directory = resolve_model_dir(model, local_model_dir=local_model_dir, revision=revision)
    return load_checkpoint_dir(directory, load_vision=load_vision, hf_names=hf_names)
