"""Rotary embedding of the last ``r`` elements of a vector, interleaved pairs
(docs/design/model.md, "RoPE and YaRN"; docs/design/attention.md, "RoPE positions").

``RotaryEmbedding`` owns one layer's inverse frequencies: base RoPE (``rope_theta``) or YaRN over
``compress_rope_theta``. Angles are formed on the fly as FP32 products ``fp32(t · f_i)``, which equals a lookup in a
cos/sin table, so no position-capacity table is allocated.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import apply_rope, rope_inverse_frequencies, yarn_inverse_frequencies

__all__ = ["RotaryEmbedding"]


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
        with torch.device("cpu"):
            if yarn is None:
                freqs = rope_inverse_frequencies(rope_dim, base)
            else:
                freqs = yarn_inverse_frequencies(rope_dim, base, *yarn)
        self.register_buffer("inverse_frequencies", freqs, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: positions [n] int. Returns: ``(cos, sin)`` each [n, r/2] fp32."""
        angles = positions.to(torch.float32)[:, None] * self.inverse_frequencies[None, :]
        rotation = torch.polar(torch.ones_like(angles), angles)
        return rotation.real.contiguous(), rotation.imag.contiguous()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the last ``r`` elements of every vector of ``x``.

        Args:
            x: [n, ..., width] bf16/fp32, ``width ≥ r``.
            positions: [n] int, the position of each leading row.
            inverse: apply the conjugate rotation (attention output de-rotation).

        Returns:
            Tensor like ``x`` (same dtype); the first ``width − r`` elements are unchanged.
        """
        cos, sin = self.cos_sin(positions)
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :]
        if x.shape[0] == 0:
            return x.clone()
        rotated = apply_rope(rope, cos, sin)
        return torch.cat([nope, rotated], dim=-1)
