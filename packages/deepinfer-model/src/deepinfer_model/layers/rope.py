"""Rotary embedding of the last ``r`` elements of a vector, interleaved pairs
(docs/design/model.md, "RoPE and YaRN"; docs/design/attention.md, "RoPE positions").

``RotaryEmbedding`` owns one layer's inverse frequencies: base RoPE (``rope_theta``) or YaRN over
``compress_rope_theta``. Angles are formed on the fly as FP32 products ``fp32(t · f_i)`` (``rope_table``: one launch
on a GPU for the forward and inverse rotations), which equals a lookup in a cos/sin table, so no position-capacity
table is allocated. Within a step, the table of a set of positions is built
once for all layers whose RoPE has the same frequencies (``step_table``; docs/design/attention.md, "Step-invariant
index math").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from deepinfer_kernels import apply_rope_, rope_inverse_frequencies, rope_table, yarn_inverse_frequencies
from deepinfer_model.state import StepMemo, StepMetadata

__all__ = ["RopeTable", "RotaryEmbedding"]

RopeTable = tuple[torch.Tensor, torch.Tensor]
"""``(cos, sin)`` each [n, r/2] fp32: the rotation of ``n`` positions (``sin`` negated for the inverse rotation)."""


class RotaryEmbedding(nn.Module):
    """RoPE of one layer.

    Args:
        rope_dim: rotated width ``r`` (even).
        base: RoPE base.
        yarn: None for base RoPE, else ``(factor, original_max_position_embeddings, beta_fast, beta_slow)``.
    """

    inverse_frequencies: torch.Tensor

    def __init__(self, rope_dim: int, base: float, yarn: tuple[float, int, float, float] | None) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        # The arguments the inverse frequencies are computed from: equal keys, bitwise-equal frequencies.
        self.frequency_key = (rope_dim, base, yarn)
        with torch.device("cpu"):
            if yarn is None:
                freqs = rope_inverse_frequencies(rope_dim, base)
            else:
                freqs = yarn_inverse_frequencies(rope_dim, base, *yarn)
        self.register_buffer("inverse_frequencies", freqs, persistent=False)

    def table(self, positions: torch.Tensor, inverse: bool = False) -> RopeTable:
        """The rotation of ``positions`` [n] int (``inverse``: the conjugate rotation)."""
        return _rotation(rope_table(positions, self.inverse_frequencies), inverse)

    def step_table(
        self, memo: StepMemo, positions_key: Hashable, positions: Callable[[], torch.Tensor], inverse: bool = False
    ) -> RopeTable:
        """``table(positions(), inverse)``, built once per step for every RoPE with these frequencies.

        Memo key: ``("rope", positions_key, frequency_key)``. Valid because the table reads nothing but the positions
        and the frequencies, which ``frequency_key`` determines; ``positions_key`` must name ``positions()`` within
        the memo's step. One ``rope_table`` serves both directions (its cosines with its sines or negated sines).
        """
        key = ("rope", positions_key, self.frequency_key)
        return _rotation(memo.get(key, lambda: rope_table(positions(), self.inverse_frequencies)), inverse)

    def table_at(self, meta: StepMetadata, inverse: bool = False) -> RopeTable:
        """The rotation of ``meta.positions``, built once per step metadata (``step_table``)."""
        return self.step_table(meta.memo, "positions", lambda: meta.positions, inverse)

    def rotate(self, x: torch.Tensor, table: RopeTable) -> torch.Tensor:
        """Rotate the last ``r`` elements of every vector of ``x``.

        Args:
            x: [n, ..., width] bf16/fp32, ``width ≥ r``.
            table: the rotation of each leading row's position (``table``, ``step_table`` or ``table_at``; the
                inverse one de-rotates attention outputs).

        Returns:
            A new tensor like ``x`` (same dtype); the first ``width − r`` elements are unchanged.
        """
        return self.rotate_(x.clone(), table)

    def rotate_(self, x: torch.Tensor, table: RopeTable) -> torch.Tensor:
        """``rotate`` in place: the last ``r`` elements of ``x`` are overwritten and ``x`` is returned. For a tensor
        nothing else reads (a projection's fresh output): the other ``width − r`` elements are not copied, where a new
        tensor would copy all of them (at 64 heads × 512 of which 64 rotate, eight times the rotated bytes)."""
        if x.shape[0]:
            cos, sin = table
            apply_rope_(x[..., -self.rope_dim :], cos, sin)
        return x


def _rotation(planes: torch.Tensor, inverse: bool) -> RopeTable:
    # rope_table's planes: cos, sin, −sin.
    return planes[0], planes[2 if inverse else 1]
