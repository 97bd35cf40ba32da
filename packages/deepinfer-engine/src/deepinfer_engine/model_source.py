"""Where the engine's checkpoint comes from: a directory, a Hugging Face repo id, or the built-in tiny checkpoint.

`LLM(model=None)` runs the built-in checkpoint shipped inside this package (`builtin_checkpoint/`, see its
README.md): the tiny preset (`deepinfer_model` preset "tiny": every layer kind of DeepSeek-V4.1-Flash at toy size)
trained by `tools/train_tiny.py` on synthetic tasks (sums, counting, copying, dates, JSON records, capital cities),
in the released checkpoint format and read by the same loader as any checkpoint directory.

Tests and benchmarks that need a checkpoint independent of training use the random tiny checkpoint
(`LLM(model="tiny")`, `tiny_checkpoint_dir`): written once, deterministically (weight seed `TINY_SEED`), into
`<cache root>/tiny-<digest>`, where the digest covers the preset text, the seed, the model package version and the
checkpoint writer's source, so a change to any of them writes a fresh copy. Writing goes to a temporary sibling
directory that is renamed into place in one step; concurrent first uses each write their own copy and the first
rename wins, so a reader never sees a half-written checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.config import load_preset, preset_json
from deepinfer_model.loading.checkpoint_dir import open_checkpoint_dir, resolve_model_dir

__all__ = [
    "RANDOM_TINY_MODEL",
    "TINY_PRESET",
    "TINY_SEED",
    "builtin_checkpoint_dir",
    "default_cache_root",
    "resolve_checkpoint",
    "tiny_checkpoint_dir",
]

TINY_PRESET = "tiny"
RANDOM_TINY_MODEL = "tiny"  # the `LLM(model=...)` spelling of the random tiny checkpoint
TINY_SEED = 0


def default_cache_root() -> Path:
    """`~/.cache/deepinfer`."""
    return Path.home() / ".cache" / "deepinfer"


def _tiny_digest() -> str:
    digest = hashlib.sha256()
    digest.update(preset_json(TINY_PRESET).encode())
    digest.update(f"seed={TINY_SEED}".encode())
    try:
        digest.update(importlib.metadata.version("deepinfer-model").encode())
    except importlib.metadata.PackageNotFoundError:
        digest.update(b"unversioned")
    writer = resources.files("deepinfer_model.checkpoint").joinpath("writer.py")
    digest.update(writer.read_bytes())
    return digest.hexdigest()[:16]


def builtin_checkpoint_dir() -> Path:
    """The trained tiny checkpoint shipped as package data (the default model; see the module docstring)."""
    return Path(str(resources.files("deepinfer_engine").joinpath("builtin_checkpoint")))


def tiny_checkpoint_dir(cache_root: Path | None = None) -> Path:
    """The random tiny checkpoint, written on first use (see the module docstring)."""
    root = cache_root if cache_root is not None else default_cache_root()
    target = root / f"{TINY_PRESET}-{_tiny_digest()}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_checkpoint(load_preset(TINY_PRESET), scratch, seed=TINY_SEED)
        try:
            os.rename(scratch, target)
        except OSError:
            if not target.is_dir():  # the rename failed for another reason than a concurrent writer winning
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve_checkpoint(
    model: str | None, *, local_model_dir: str | None, revision: str | None, cache_root: Path | None
) -> Path:
    """The checkpoint directory for an `LLM(model=...)` argument.

    Args:
        model: a directory, a Hugging Face repo id, None for the built-in trained checkpoint, or "tiny" for the random
            tiny checkpoint.
        local_model_dir: DEEPINFER_HF_MODEL_DIR, a local copy used when `model` is not a directory.
        revision: Hub revision.
        cache_root: where the random tiny checkpoint lives; None for `default_cache_root()`.

    Raises:
        deepinfer_model.loading.errors.CheckpointError: nothing usable was found (the message says what to do).
    """
    if model is None:
        directory = builtin_checkpoint_dir()
    elif model == RANDOM_TINY_MODEL:
        return tiny_checkpoint_dir(cache_root)
    else:
        directory = resolve_model_dir(model, local_model_dir=local_model_dir, revision=revision)
    open_checkpoint_dir(directory)  # an empty or partial directory is a checkpoint problem, reported as one, here
    return directory
