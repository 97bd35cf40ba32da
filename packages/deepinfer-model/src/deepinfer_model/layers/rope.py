"""Rotary embedding of the last ``r`` elements of a vector, interleaved pairs
(docs/design/model.md, "RoPE and YaRN"; docs/design/attention.md, "RoPE positions").

``RotaryEmbedding`` owns one layer's inverse frequencies: base RoPE (``rope_theta``) or YaRN over
``compress_rope_theta``. Angles are formed on the fly as FP32 products ``fp32(t · f_i)``, which equals a lookup in a
cos/sin table, so no position-capacity table is allocated. Within a step, the table of a set of positions is built
once for all layers whose RoPE has the same frequencies (``step_table``; docs/design/attention.md, "Step-invariant
index math").
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from deepinfer_kernels import apply_rope_, rope_inverse_frequencies, yarn_inverse_frequencies
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
        # Four launches a table: the product promotes the positions to FP32 (the values of a conversion first), and
        # one copy lays out the cosines and then the sines, each half contiguous.
        angles = positions[:, None] * self.inverse_frequencies[None, :]
        rotation = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
        cos, sin = rotation.permute(2, 0, 1).contiguous()
        return _conjugate((cos, sin)) if inverse else (cos, sin)

    def step_table(
        self, memo: StepMemo, positions_key: Hashable, positions: Callable[[], torch.Tensor], inverse: bool = False
    ) -> RopeTable:
        """``table(positions(), inverse)``, built once per step for every RoPE with these frequencies.

        Memo key: ``("rope", positions_key, frequency_key, inverse)``. Valid because the table reads nothing but the
        positions and the frequencies, which ``frequency_key`` determines; ``positions_key`` must name
        ``positions()`` within the memo's step. The inverse table reuses the forward one (same cosines, negated
        sines: the same values ``table`` gives).
        """
        key = ("rope", positions_key, self.frequency_key, inverse)
        if inverse:
            return memo.get(key, lambda: _conjugate(self.step_table(memo, positions_key, positions)))
        return memo.get(key, lambda: self.table(positions()))

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


def _conjugate(table: RopeTable) -> RopeTable:
    cos, sin = table
    return cos, -sin
