"""YOCO prefill truncation (docs/design/attention.md, "YOCO prefill truncation"): what the consumer half computes for
prompt chunks.

Glossary:
    rect_lo: a request's known length minus ``keep_tokens``; a consumer-layer query of a truncated step sees window
        keys at positions ``≥ rect_lo`` only (the ``window_floor`` of ``StepMetadata``).
    kept rows: under ``compact``, the chunk rows the consumer half computes: positions ``≥ rect_lo``, and at least the
        chunk's last token (a placeholder with an empty window when the whole chunk lies below ``rect_lo``).

``PrefillTruncation`` is the setting (validated against the model once); ``truncate_step`` derives one step's
consumer-half metadata from it. Decode steps are never truncated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer_model.config import TextConfig
from deepinfer_model.state import StepMetadata

__all__ = ["TRUNCATION_MODES", "Compaction", "PrefillTruncation", "truncate_step"]

TRUNCATION_MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class PrefillTruncation:
    """The truncation setting.

    Attributes:
        mode: ``off`` (exact), ``mask`` (every query computed, consumer windows start at ``rect_lo``) or ``compact``
            (the consumer half computes the kept rows only).
        keep_tokens: ``KEEP``, the tail of each prompt the consumer half sees; > 0 when the mode is not ``off``.
        mode_name, keep_tokens_name: how error messages call the two values (the engine names its environment
            variables).

    Raises:
        ValueError: an unknown mode, or truncation on with ``keep_tokens`` <= 0.
    """

    mode: str = "off"
    keep_tokens: int = 0
    mode_name: str = field(default="mode", compare=False)
    keep_tokens_name: str = field(default="keep_tokens", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in TRUNCATION_MODES:
            allowed = ", ".join(repr(mode) for mode in TRUNCATION_MODES)
            raise ValueError(
                f"{self.mode_name}={self.mode!r} is not a YOCO prefill truncation mode; allowed: {allowed}"
            )
        keep = self.keep_tokens
        if isinstance(keep, bool) or not isinstance(keep, int):
            raise ValueError(f"{self.keep_tokens_name} must be an int, got {keep!r}")
        if self.enabled and keep <= 0:
            raise ValueError(f"{self.keep_tokens_name}={keep} must be > 0 when {self.mode_name}={self.mode!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def check(self, text: TextConfig, max_backtracking_tokens: int) -> None:
        """Raise ValueError unless the model can run this setting.

        Needs YOCO consumer layers and ``keep_tokens ≥ W + BT``, the SWA ring's length: a query re-fed after a
        rollback of ``BT`` positions must still find its whole window among the consumer window keys that exist.
        ``compact`` also needs every Engram layer in the producer half and the DSpark target layers on one side of
        the boundary (their features, hence the drafter's context keys, exist only for kept rows in the consumer
        half).
        """
        if not self.enabled:
            return
        setting = f"{self.mode_name}={self.mode!r}"
        if not text.yoco_enabled:
            raise ValueError(
                f"{setting} needs a model with YOCO consumer layers; this one has none (no backbone layer has "
                f"compress ratio 1, so all {text.num_hidden_layers} layers are producers); use 'off'"
            )
        window = text.sliding_window
        needed = window + max_backtracking_tokens
        if self.keep_tokens < needed:
            raise ValueError(
                f"{self.keep_tokens_name}={self.keep_tokens} is below sliding_window ({window}) + max backtracking "
                f"tokens ({max_backtracking_tokens}) = {needed}"
            )
        if self.mode != "compact":
            return
        boundary = text.n_prefill_layer
        consumer_engram = [layer for layer in text.engram_layer_ids if layer >= boundary]
        if consumer_engram:
            raise ValueError(
                f"{setting} needs every Engram layer in the producer half (layers < {boundary}); "
                f"Engram layers {consumer_engram} are consumers"
            )
        sides = {layer >= boundary for layer in text.dspark_target_layer_ids}
        if len(sides) > 1:
            raise ValueError(
                f"{setting} needs all DSpark target layers {list(text.dspark_target_layer_ids)} on one side of the "
                f"YOCO boundary (layer {boundary})"
            )


@dataclass(frozen=True)
class Compaction:
    """The consumer half's rows of one ``compact`` prefill step.

    Attributes:
        meta: index math of the kept rows (per-token arrays of kept rows; ``q_start``/``q_len``/``cu_query_lens`` of
            the kept part of each chunk; ``window_floor`` with ``floor_stores``).
        rows: [T_kept] int64 full-layout index of each kept row.
        full_to_compact: [T] int64 compact index of each full-layout row, −1 for dropped rows.
    """

    meta: StepMetadata
    rows: torch.Tensor
    full_to_compact: torch.Tensor

    def gather(self, full: torch.Tensor) -> torch.Tensor:
        """The kept rows ``[T_kept, ...]`` of a full-layout tensor ``[T, ...]``."""
        return full[self.rows]

    def logits_rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Compact rows of full-layout token ``indices`` (a device sync: dropped rows are an error).

        Raises:
            ValueError: a requested row was dropped (only the last token of every chunk and positions ≥ rect_lo
                have consumer-half outputs).
        """
        mapped = self.full_to_compact[indices]
        dropped = indices[mapped < 0]
        if dropped.numel():
            raise ValueError(
                f"logits of tokens {dropped[:8].tolist()} were asked for, but YOCO compact prefill truncation "
                f"dropped them from the consumer layers; only each chunk's last token and positions >= rect_lo "
                f"have logits"
            )
        return mapped


def truncate_step(
    meta: StepMetadata, known_lens: torch.Tensor, truncation: PrefillTruncation
) -> tuple[StepMetadata, Compaction | None]:
    """A non-decode step's metadata under ``truncation``.

    Args:
        meta: the step's metadata (every token).
        known_lens: [R] int each request's known length (``ForwardBatch.known_lens``).
        truncation: an enabled setting.

    Returns:
        ``(meta, compaction)``: ``mask`` sets ``window_floor`` on ``meta`` (only consumer layers apply it) and
        returns no compaction; ``compact`` leaves ``meta`` as is and returns the consumer half's rows (a device
        sync: their number depends on the data).
    """
    floor = known_lens.long() - truncation.keep_tokens
    if truncation.mode == "mask":
        return dataclasses.replace(meta, window_floor=floor), None
    clip = torch.minimum((floor - meta.q_start).clamp(min=0), (meta.q_len - 1).clamp(min=0))
    start = meta.q_start + clip
    kept = meta.positions >= start[meta.token_request]
    rows = kept.nonzero().squeeze(1)
    q_len = meta.q_len - clip
    compact = dataclasses.replace(
        meta,
        token_request=meta.token_request[rows],
        positions=meta.positions[rows],
        q_start=start,
        q_len=q_len,
        cu_query_lens=torch.cat([meta.cu_query_lens[:1], torch.cumsum(q_len, 0)]),
        window_floor=floor,
        floor_stores=True,
    )
    full_to_compact = torch.where(kept, torch.cumsum(kept, 0) - 1, -1)
    return meta, Compaction(compact, rows, full_to_compact)
