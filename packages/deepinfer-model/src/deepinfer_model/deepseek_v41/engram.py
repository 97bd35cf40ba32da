"""Engram: hashed n-gram memory added to the trunk of selected layers (docs/design/model.md, "Engram").

Per token: the suffix n-grams (orders 2 … ``N_g``) over the compressed vocabulary are hashed with ``h_e`` odd
multiplier hashes into prime-sized sub-tables; the gathered FP8 rows are projected by ``engram.wkv`` into one key
per stream and one shared value, and each stream adds the value through a sigmoid gate comparing it with its key.

Glossary:
    compressed vocabulary: token ids merged by normalized text (``EngramVocab``, built from ``tokenizer.json``).
    n-gram row: compressed ids ``g_r`` of the tokens at positions ``p − r``, ``r = 0 … N_g − 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer_kernels import dequantize_fp8_per_token_group, engram_gate, engram_lookup, engram_ngram_rows
from deepinfer_model.config import TextConfig
from deepinfer_model.deepseek_v41._pcg64 import bounded_int64s
from deepinfer_model.layers.linear import Fp8BlockLinear, make_parameter
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.state import StepMetadata

__all__ = ["Engram", "EngramVocab", "hash_multipliers", "ngram_rows"]

_SEED_STRIDE = 10007


@dataclass(frozen=True)
class EngramVocab:
    """Compressed vocabulary (docs/design/model.md, "Compressed vocabulary").

    Attributes:
        old_to_new: [V_t] int64 compressed id of every tokenizer id.
        num_compressed: ``V_c``, number of distinct compressed ids.
        pad_id: compressed id of the Engram pad token.
    """

    old_to_new: torch.Tensor
    num_compressed: int
    pad_id: int

    def to(self, device: torch.device | str) -> EngramVocab:
        """The same vocabulary with its table on ``device`` (self when already there)."""
        if self.old_to_new.device == torch.device(device):
            return self
        return EngramVocab(self.old_to_new.to(device), self.num_compressed, self.pad_id)


def hash_multipliers(layer_id: int, num_compressed: int, max_ngram: int) -> torch.Tensor:
    """Odd int64 multipliers ``a_ℓ = 2·r + 1`` (docs/design/model.md, "Hash multipliers"), ``r`` drawn by NumPy's
    ``default_rng(10007·ℓ)`` below ``B = max(1, ⌊⌊(2^63 − 1) / V_c⌋ / 2⌋)`` (reproduced without NumPy).
    Returns: [N_g] int64."""
    bound = max(1, (2**63 - 1) // num_compressed // 2)
    values = bounded_int64s(_SEED_STRIDE * layer_id, bound, max_ngram)
    return torch.tensor([2 * value + 1 for value in values], dtype=torch.int64)


def ngram_rows(
    meta: StepMetadata, input_ids: torch.Tensor, prefix_ids: torch.Tensor, vocab: EngramVocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed n-gram rows of the step's tokens (docs/design/model.md, "N-gram rows"; the kernels'
    ``engram_ngram_rows``, one launch on a GPU).

    Args:
        meta: step metadata.
        input_ids: [T] int64.
        prefix_ids: [R, N_g − 1] int64 tokens preceding each request's chunk.
        vocab: compressed vocabulary, on the tokens' device.

    Returns:
        ``(rows [T, N_g] int64, active [T] bool)``; inactive tokens (current token outside the tokenizer
        vocabulary) skip the Engram.
    """
    return engram_ngram_rows(
        input_ids, meta.positions, meta.token_request, meta.q_start, prefix_ids, vocab.old_to_new, vocab.pad_id
    )


class EngramTable(nn.Module):
    """FP8 n-gram table ``[R, d_e]`` with one UE8M0 scale per row and 32 columns
    (docs/design/numerics.md, "Weight formats")."""

    def __init__(self, num_rows: int, width: int) -> None:
        super().__init__()
        self.weight = make_parameter((num_rows, width), torch.float8_e4m3fn)
        self.scale = make_parameter((num_rows, width // 32), torch.float8_e8m0fnu)


class Engram(nn.Module):
    """``layers.{ℓ}.engram``: FP8 table ``embed`` (per-row 1×32 scales), ``wkv``, ``q_weight``, ``k_weight``."""

    sizes: torch.Tensor
    offsets: torch.Tensor

    def __init__(self, cfg: TextConfig, layer_id: int, mode: ComputeMode) -> None:
        super().__init__()
        if cfg.engram_max_ngram_size is None or cfg.engram_n_heads is None or cfg.engram_head_dim is None:
            raise ValueError(f"layer {layer_id} has an Engram but the Engram config keys are missing")
        self.layer_id = layer_id
        self.max_ngram = cfg.engram_max_ngram_size
        self.hc_mult = cfg.hc_mult
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        sizes = cfg.engram_table_sizes[cfg.engram_layer_ids.index(layer_id)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        num_rows, width = sum(sizes), cfg.engram_head_dim
        self.embed = EngramTable(num_rows, width)
        self.wkv = Fp8BlockLinear(cfg.engram_input_width, (cfg.hc_mult + 1) * cfg.hidden_size, mode)
        self.q_weight = make_parameter((cfg.hc_mult, cfg.hidden_size), torch.bfloat16)
        self.k_weight = make_parameter((cfg.hc_mult, cfg.hidden_size), torch.bfloat16)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64), persistent=False)
        self._multipliers: dict[tuple[int, torch.device], torch.Tensor] = {}

    def multipliers(self, num_compressed: int) -> torch.Tensor:
        """Hash multipliers for a compressed vocabulary of ``num_compressed`` ids, on the module's device (computed
        once per device: a module moved after a call must not keep the old device's copy). Returns [N_g]."""
        key = (num_compressed, self.sizes.device)
        cached = self._multipliers.get(key)
        if cached is None:
            cached = hash_multipliers(self.layer_id, num_compressed, self.max_ngram).to(self.sizes.device)
            self._multipliers[key] = cached
        return cached

    def project(self, rows: torch.Tensor, vocab: EngramVocab) -> torch.Tensor:
        """The gathered table rows of every token projected by ``wkv`` (docs/design/model.md, "Engram lookup and
        gate"): they depend on the tokens alone, not on the trunk, so a forward may compute them ahead of the layer.

        Args:
            rows: [T, N_g] compressed n-gram rows.
            vocab: compressed vocabulary (``V_c`` seeds the multipliers).

        Returns:
            [T, m + 1, H] activation dtype: one key per stream, then the shared value.
        """
        # The hash (docs/design/model.md, "Engram hash") and the gather of the rows and their scales, in one launch on
        # a GPU.
        codes, scales = engram_lookup(
            rows, self.multipliers(vocab.num_compressed), self.sizes, self.offsets, self.embed.weight, self.embed.scale
        )
        if self.wkv.runs_on_fp8_copy():
            # The gathered rows are already an FP8 copy with 32-column scales: the FP8 GEMM reads them as they are
            # (no dequantized activation, no dequantized weight per step).
            kv = self.wkv.forward_fp8((codes, scales))
        else:
            kv = self.wkv(dequantize_fp8_per_token_group(codes, scales), prequantized=True)
        return kv.view(rows.shape[0], self.hc_mult + 1, self.hidden)

    def forward(self, trunk: torch.Tensor, kv: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Apply the Engram to the trunk (docs/design/model.md, "Engram lookup and gate").

        Args:
            trunk: [T, m, H] activation dtype.
            kv: [T, m + 1, H] ``project`` of the tokens' n-gram rows.
            active: [T] bool; inactive tokens are returned unchanged.

        Returns:
            [T, m, H] activation dtype.
        """
        # One kernel for the gate and the update (docs/design/model.md, "Engram lookup and gate"); the streams keep
        # the trunk's dtype, the mode's activation dtype.
        return engram_gate(
            trunk, kv[:, : self.hc_mult], kv[:, self.hc_mult], self.q_weight, self.k_weight, active, self.eps
        )
