"""Incremental attention state: byte pools per cache group (``ModelState``), row codecs, per-step index math."""

from deepinfer_model.state.model_state import ModelState
from deepinfer_model.state.step import StepMemo, StepMetadata

__all__ = ["ModelState", "StepMemo", "StepMetadata"]
