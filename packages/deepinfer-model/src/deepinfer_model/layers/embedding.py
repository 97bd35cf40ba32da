"""Token embedding (row gather, out-of-range ids give zero rows; docs/design/model.md, "Embedding") and the BF16 LM head
(docs/design/model.md, "Final norm and LM head")."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels import bf16_gemm
from deepinfer_model.layers.linear import make_parameter
from deepinfer_model.layers.mode import ComputeMode

__all__ = ["LMHead", "VocabEmbedding"]


class VocabEmbedding(nn.Module):
    """BF16 table ``[V, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, mode: ComputeMode) -> None:
        super().__init__()
        self.mode = mode
        self.vocab_size = vocab_size
        self.weight = make_parameter((vocab_size, hidden_size), torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Args: ids [n] int. Returns: [n, H] activation dtype; ids outside ``[0, V)`` give zeros."""
        # Four launches: an out-of-range id reads a clamped row, then its row is zeroed (+0.0, as zeros_like gave).
        clamped = ids.clamp(0, self.vocab_size - 1)
        rows = self.weight[clamped].masked_fill_((clamped != ids)[:, None], 0.0)
        return rows.to(self.mode.activation_dtype)


class LMHead(nn.Module):
    """BF16 head ``[V, H]``; BF16 × BF16 with FP32 accumulation and FP32 logits."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = make_parameter((vocab_size, hidden_size), torch.bfloat16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Args: h [n, H]. Returns: logits [n, V] fp32.

        The kernels' ``bf16_gemm``: on CUDA a BF16 ``h`` reads the stored weight as it is.
        """
        return bf16_gemm(h, self.weight)
