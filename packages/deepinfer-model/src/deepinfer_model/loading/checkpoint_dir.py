"""Locating a checkpoint and validating its directory before any tensor is read
(docs/design/model.md, "Checkpoint layout", "Tokenizer policy").

``resolve_model_dir`` turns a model argument into a local directory: an existing directory is used as is; otherwise the
caller-supplied local copy (the engine passes the value of ``DEEPINFER_HF_MODEL_DIR``; this package never reads the
environment) or a Hugging Face Hub snapshot. ``open_checkpoint_dir`` checks the checkpoint files (``config.json``,
``model.safetensors.index.json``, every shard the index names, ``tokenizer.json``, ``tokenizer_config.json``), parses
every shard header, checks that each indexed tensor is in its shard, and applies the tokenizer rules that the config
alone cannot check (the Engram pad id, the release policy; ``tokenizer_policy``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.errors import CheckpointError
from deepinfer_model.loading.hf_names import MODEL_PREFIX, strip_model_prefix
from deepinfer_model.loading.safetensors_io import ShardHeader, TensorRecord, read_header
from deepinfer_model.loading.tokenizer_policy import check_tokenizer_files

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
LOCAL_DIR_VARIABLE = "DEEPINFER_HF_MODEL_DIR"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.txt"]


def resolve_model_dir(
    model: str | Path, *, local_model_dir: str | Path | None = None, revision: str | None = None
) -> Path:
    """Resolve a model argument to a local checkpoint directory.

    Args:
        model: a local directory, or a Hugging Face repo id (``owner/name``).
        local_model_dir: a local copy to use when ``model`` is not a directory (the engine passes
            ``DEEPINFER_HF_MODEL_DIR``); None to download.
        revision: Hub revision for the download.

    Raises:
        CheckpointError: nothing usable was found; the message says how to point at a local copy.
    """
    candidate = Path(model).expanduser()
    if candidate.is_dir():
        return candidate
    if local_model_dir is not None:
        local = Path(local_model_dir).expanduser()
        if not local.is_dir():
            raise CheckpointError(f"{LOCAL_DIR_VARIABLE} = {str(local_model_dir)!r} is not a directory")
        return local
    name = str(model)
    if not _REPO_ID.match(name):
        raise CheckpointError(
            f"model {name!r} is neither an existing directory nor a Hugging Face repo id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS))
    except OSError as exc:  # LocalEntryNotFoundError, HTTP errors and network failures are all OSErrors
        raise CheckpointError(
            f"cannot fetch {name!r} from the Hugging Face Hub ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            f"Point at a local copy instead: pass the checkpoint directory as the model, or set {LOCAL_DIR_VARIABLE} "
            "to the directory that holds its config.json"
        ) from exc


@dataclass(frozen=True)
class CheckpointDir:
    """A validated checkpoint directory.

    Attributes:
        path: the directory.
        config: the parsed ``config.json``.
        weight_map: tensor name without ``model.`` → shard file name.
        stored_names: tensor name without ``model.`` → name as stored in the index and shard.
        shards: shard file name → validated header.
    """

    path: Path
    config: ModelConfig
    weight_map: Mapping[str, str]
    stored_names: Mapping[str, str]
    shards: Mapping[str, ShardHeader]

    def record(self, name: str) -> TensorRecord:
        """Header record of a tensor (name without ``model.``)."""
        return self.shards[self.weight_map[name]].tensors[self.stored_names[name]]

    def shard_path(self, name: str) -> Path:
        return self.path / self.weight_map[name]


def _require_file(directory: Path, name: str, why: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"checkpoint directory {directory} has no {name} ({why})")
    return path


def _read_weight_map(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{path} must hold an object with a 'weight_map' of tensor name -> shard file name")
    return weight_map


def _normalize_names(path: Path, weight_map: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    normalized: dict[str, str] = {}
    stored: dict[str, str] = {}
    ambiguous = []
    for name, shard in weight_map.items():
        key = strip_model_prefix(name)
        if key in stored:
            ambiguous.append(key)
        normalized[key] = shard
        stored[key] = name
    if ambiguous:
        raise CheckpointError(
            f"{path} lists {len(ambiguous)} tensors both with and without the '{MODEL_PREFIX}' prefix "
            f"(ambiguous), e.g. {ambiguous[:5]}"
        )
    return normalized, stored


def _read_shards(directory: Path, weight_map: Mapping[str, str], stored: Mapping[str, str]) -> dict[str, ShardHeader]:
    root = directory.resolve()
    shards: dict[str, ShardHeader] = {}
    for shard in sorted(set(weight_map.values())):
        path = directory / shard
        if root not in path.resolve().parents:
            raise CheckpointError(f"{INDEX_FILE} names shard {shard!r}, which lies outside {directory}")
        if not path.is_file():
            example = next(name for name, s in weight_map.items() if s == shard)
            raise CheckpointError(f"shard file {path} is missing ({INDEX_FILE} places {example!r} and others in it)")
        shards[shard] = read_header(path)
    missing = [f"{stored[n]} (in {s})" for n, s in weight_map.items() if stored[n] not in shards[s].tensors]
    if missing:
        raise CheckpointError(
            f"{len(missing)} tensors listed in {INDEX_FILE} are absent from their shard: {', '.join(missing[:20])}"
        )
    return shards


def open_checkpoint_dir(directory: str | Path) -> CheckpointDir:
    """Validate a local checkpoint directory and read every shard header (no tensor data is read).

    Raises:
        CheckpointError: a required file is missing or unreadable, a shard is missing or corrupt, the index is
            inconsistent with the shards, or the tokenizer breaks a policy rule. The message names the file.
        ValueError: ``config.json`` breaks a configuration rule (docs/design/model.md, "Configuration rules").
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist or is not a directory")
    config_path = _require_file(path, CONFIG_FILE, "the model configuration")
    try:
        config = ModelConfig.from_json(config_path)
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from exc
    index_path = _require_file(path, INDEX_FILE, "required even for a single shard")
    weight_map, stored = _normalize_names(index_path, _read_weight_map(index_path))
    shards = _read_shards(path, weight_map, stored)
    tokenizer = _require_file(path, TOKENIZER_FILE, "the tokenizer, also used by the Engram vocabulary compression")
    settings = _require_file(path, TOKENIZER_CONFIG_FILE, "tokenizer class and BOS/EOS policy")
    check_tokenizer_files(tokenizer, settings, config)
    return CheckpointDir(path=path, config=config, weight_map=weight_map, stored_names=stored, shards=shards)
