"""KV compressor of compressed kv-source layers (docs/design/attention.md, "KV compressor"): forms one compressed row
per ``c`` raw tokens and stores it, RoPE'd at the block's first position, in the layer's paged compressed cache.

C1: the row is the token's latent. C2: per channel, a softmax over the block's two gate scores weights the two
latents; tokens of a block that arrived in an earlier step are read back from the compressor state ring (FP32
``(score, latent)`` of the last ``2 + BT − 1`` positions).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import position_sources, uniform_compressed_rows
from deepinfer_model.deepseek_v41.context import COMPRESSOR_GROUP, NewRows, compressed_group
from deepinfer_model.layers.linear import Bf16Linear
from deepinfer_model.layers.mode import ComputeMode, round_activation
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.layers.rope import RopeTable, RotaryEmbedding
from deepinfer_model.state import ModelState, StepMetadata

__all__ = ["Compressor", "completed_rows", "new_compressed_rows", "new_rows_rope_table", "new_rows_slots"]


class Compressor(nn.Module):
    """``attn.compressor``: ``wkv`` (latent), ``wgate`` (score, ratio 2 only), ``norm``."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float, mode: ComputeMode) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compress ratio must be 1 or 2, got {ratio}")
        self.ratio = ratio
        self.head_dim = head_dim
        self.mode = mode
        self.wkv = Bf16Linear(hidden, head_dim, mode, fp32_output=ratio == 2)
        self.wgate = Bf16Linear(hidden, head_dim, mode, fp32_output=True) if ratio == 2 else None
        self.norm = RMSNorm(head_dim, eps, mode)

    def forward(
        self, hidden: torch.Tensor, meta: StepMetadata, state: ModelState, layer_id: int, rope: RotaryEmbedding
    ) -> NewRows:
        """Form, RoPE and store this step's compressed rows.

        Args:
            hidden: [T, H] activation dtype, the compressor input (own ``attn_norm`` output or YOCO shared hidden).
            meta: index math of the step's tokens.
            state: the cache pools.
            layer_id: this kv-source layer.
            rope: the layer's RoPE.

        Returns:
            The new rows with their pre-RoPE values.
        """
        ratio = self.ratio
        request, row = new_compressed_rows(meta, ratio)
        latent = self.wkv(hidden)
        if self.wgate is None:
            # Each C1 row is one chunk token's latent; which token is the same for every C1 kv source. (A C1 row's
            # position is always in the chunk, so no ring is read: the ring size given is any.)
            tokens = meta.memo.get(("compressed_row_tokens", ratio), lambda: block_sources(meta, 1, 1)[0][:, 0])
            rows = latent[tokens]
        else:
            score = self.wgate(hidden)
            rows = self._combine_c2(torch.cat([score, latent.float()], dim=-1), meta, state, layer_id)
        pre_rope = self.norm(rows)
        keys = rope.rotate(pre_rope, new_rows_rope_table(rope, meta, ratio))
        group = compressed_group(ratio)
        state.write(group, layer_id, new_rows_slots(meta, ratio, state.rows_per_block(group)), keys)
        return NewRows(request=request, row=row, pre_rope_kv=pre_rope)

    def _combine_c2(self, entries: torch.Tensor, meta: StepMetadata, state: ModelState, layer_id: int) -> torch.Tensor:
        """Softmax-weighted latent of each new C2 row; then store the chunk's tail in the state ring.

        Args:
            entries: [T, 2D] fp32 ``(score | latent)`` of the chunk tokens.
        """
        ring = state.ring_size(COMPRESSOR_GROUP)
        from_chunk, from_ring, in_chunk = meta.memo.get(
            ("compressor_block_sources", self.ratio, ring), lambda: block_sources(meta, self.ratio, ring)
        )
        block = torch.where(in_chunk, entries[from_chunk], state.read(COMPRESSOR_GROUP, layer_id, from_ring))
        score, latent = block[..., : self.head_dim], block[..., self.head_dim :]
        combined = (torch.softmax(score, dim=1) * latent).sum(dim=1)
        tail_rows, keep = meta.ring_tail(ring)
        state.write(COMPRESSOR_GROUP, layer_id, tail_rows, entries if keep is None else entries[keep])
        return round_activation(combined, self.mode)


def new_compressed_rows(meta: StepMetadata, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [N], row [N])`` int64: the compressed rows of ratio ``ratio`` the step completes
    (``completed_rows``), built once per step for every kv source of that ratio (memo key: the ratio)."""
    return meta.memo.get(("compressed_new_rows", ratio), lambda: completed_rows(meta, ratio))


def new_rows_slots(meta: StepMetadata, ratio: int, rows_per_block: int) -> torch.Tensor:
    """[N] int64 flat paged rows of ``new_compressed_rows(meta, ratio)`` in a group of ``rows_per_block`` rows per
    page: the compressed rows' and their index keys' slots (memo key: the ratio and the page geometry)."""

    def build() -> torch.Tensor:
        request, row = new_compressed_rows(meta, ratio)
        return meta.paged_rows(request, row, rows_per_block)

    return meta.memo.get(("compressed_new_rows_slots", ratio, rows_per_block), build)


def new_rows_rope_table(rope: RotaryEmbedding, meta: StepMetadata, ratio: int) -> RopeTable:
    """The rotation of ``new_compressed_rows(meta, ratio)`` at their blocks' first positions ``b·c``
    (docs/design/attention.md, "RoPE positions"), built once per step for every RoPE with ``rope``'s frequencies."""
    return rope.step_table(
        meta.memo, ("compressed_new_rows", ratio), lambda: new_compressed_rows(meta, ratio)[1] * ratio
    )


def completed_rows(meta: StepMetadata, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [N], row [N])`` int64, the rows of ratio ``c`` completed in this step: ``floor(q_start/c) …
    floor(context/c) − 1`` per request.

    A uniform step (every request computes ``q`` tokens) instead yields a static number of rows per request, the
    rows its positions touch, ``floor(q_start/c) … floor((context − 1)/c)``, padded to ``q // c + (c > 1)`` by
    repeating the last one (identical values, written twice). For ``c = 2`` the last row may not be complete yet
    and is written provisionally (see ``_combine_c2``). Nothing reads it before it is complete: queries see rows
    ``< klen(t) = (t + 1) // c`` only (every reader masks the others; docs/design/attention.md, "Row
    visibility"), and the step that computes the block's last position forms and rewrites the row before any
    layer reads it.
    """
    if meta.is_uniform:
        count = meta.max_query_len // ratio + (1 if ratio > 1 else 0)
        return uniform_compressed_rows(meta.q_start, meta.context_lens, ratio, count)
    first = torch.div(meta.q_start, ratio, rounding_mode="floor")
    counts = torch.div(meta.context_lens, ratio, rounding_mode="floor") - first
    request = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    row = first[request] + torch.arange(request.shape[0], device=counts.device) - starts[request]
    return request, row


def block_sources(meta: StepMetadata, ratio: int, ring: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the ``c`` positions of every new row (``new_compressed_rows``) are read from: the chunk's tokens or the
    compressor state ring of ``ring`` rows per slot.

    A provisional decode row (its block's last position is not computed yet) repeats the current token in place of
    the missing one: finite values, never read (``completed_rows``). A no-op for complete rows.

    Returns:
        ``(token [N, c], ring_row [N, c], in_chunk [N, c, 1] bool)`` int64 indices, ``in_chunk`` choosing between them
        (``deepinfer_kernels.position_sources``: one launch on NVIDIA).
    """
    request, row = new_compressed_rows(meta, ratio)
    token, ring_row, in_chunk = position_sources(
        request, row, ratio, meta.q_start, meta.cu_query_lens, meta.context_lens, meta.state_slots, ring,
        meta.num_tokens,
    )  # fmt: skip
    return token, ring_row, in_chunk[..., None]
