"""DSpark drafter blocks (``mtp.{i}``; docs/design/model.md, "DSpark blocks"): a full SWA-only decoder block with base
RoPE and the drafter MoE, plus the first block's target-feature projection and the last block's heads.

Glossary:
    target features: per token, the mean over mHC streams of the trunk entering each ``dspark_target_layer_ids``
        layer, concatenated in list order (``[T, n_t·H]``; docs/design/model.md, "Target features").
    context keys: drafter SWA keys derived from target features (``main_proj`` → ``main_norm`` → block ``wkv``).
    Markov head: low-rank bigram bias ``markov_head.head · markov_head.embed[prev]`` added to draft logits.
    confidence head: ``σ(proj · [h ; markov_embed[prev]])``, the conditional acceptance probability of a draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer_kernels import bf16_gemm
from deepinfer_model.config import LayerSpec, TextConfig
from deepinfer_model.deepseek_v41.block import DecoderBlock, HCHeadParameters
from deepinfer_model.deepseek_v41.moe import ExpertDispatch
from deepinfer_model.layers.embedding import LMHead
from deepinfer_model.layers.linear import Fp8BlockLinear, make_parameter
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm

__all__ = ["ConfidenceHead", "DSparkBlock", "MarkovHead"]

_CONFIDENCE_CLAMP = 60.0


class _Weight(nn.Module):
    """A module holding one BF16 ``weight`` (keeps the HF ``<name>.weight`` path)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = make_parameter(shape, torch.bfloat16)


class MarkovHead(nn.Module):
    """``markov_head.embed`` ``[V, R_m]`` and ``markov_head.head`` ``[V, R_m]`` (BF16)."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = _Weight((vocab_size, rank))
        self.head = _Weight((vocab_size, rank))

    def previous_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Args: prev_tokens [n] int64. Returns: [n, R_m] bf16 rows ``e_k``."""
        return self.embed.weight[prev_tokens]

    def bias(self, prev_embedding: torch.Tensor) -> torch.Tensor:
        """Args: prev_embedding [n, R_m]. Returns: [n, V] fp32 ``e · headᵀ`` (the stored BF16 weight read as it is)."""
        return bf16_gemm(prev_embedding, self.head.weight)


class ConfidenceHead(nn.Module):
    """``confidence_head.proj`` ``[1, H + R_m]`` (no bias)."""

    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = _Weight((1, hidden + rank))

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """``σ(clamp((h·w_h + e·w_m) / τ, −60, 60))``.

        Args:
            hidden: [n, H] pre-final-norm drafter hidden.
            prev_embedding: [n, R_m] Markov embedding of the previous token.
            temperature: [n] fp32 τ per row (clamped to ≥ 1e−5).

        Returns:
            [n] fp32 confidences.
        """
        features = torch.cat([hidden.float(), prev_embedding.float()], dim=-1)
        logit = (features @ self.proj.weight.float().t()).squeeze(-1) / temperature.clamp(min=1e-5)
        return torch.sigmoid(logit.clamp(-_CONFIDENCE_CLAMP, _CONFIDENCE_CLAMP))


class DSparkBlock(DecoderBlock, HCHeadParameters):
    """``mtp.{i}``: a decoder block, plus ``main_proj``/``main_norm`` (first block) and ``norm``, the Markov and the
    confidence head (last block)."""

    def __init__(
        self,
        cfg: TextConfig,
        spec: LayerSpec,
        mode: ComputeMode,
        index: int,
        swa_group: str,
        dispatch: ExpertDispatch,
        local_experts: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            cfg,
            spec,
            mode,
            cfg.dspark_n_routed_experts,
            cfg.dspark_num_experts_per_tok,
            swa_group,
            dispatch,
            local_experts,
        )
        hidden = cfg.hidden_size
        first, last = index == 0, index == cfg.num_nextn_predict_layers - 1
        self.main_proj = Fp8BlockLinear(cfg.dspark_num_targets * hidden, hidden, mode) if first else None
        self.main_norm = RMSNorm(hidden, cfg.rms_norm_eps, mode) if first else None
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, mode) if last else None
        self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank) if last else None
        self.confidence_head = ConfidenceHead(hidden, cfg.dspark_markov_rank) if last else None
        if last:
            self.add_hc_head(cfg)

    def head_logits(self, hidden: torch.Tensor, lm_head: LMHead) -> torch.Tensor:
        """Draft logits before the Markov bias, ``lm_head(norm(h))``, for any number of rows: every slot of a block at
        once, since no slot's ``h`` depends on the tokens drafted before it (docs/design/model.md, "Draft heads").

        Args:
            hidden: [m, H] pre-norm drafter hidden.
            lm_head: the backbone's (tied) LM head.

        Returns:
            [m, V] fp32.
        """
        if self.norm is None:
            raise RuntimeError("only the last DSpark block owns the final norm and the heads")
        return lm_head(self.norm(hidden))

    def slot_heads(
        self, logits: torch.Tensor, hidden: torch.Tensor, previous_tokens: torch.Tensor, temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft slot's sequential part (docs/design/model.md, "Draft heads"): the Markov bias of the previous
        token added to the slot's ``head_logits``, and the confidence.

        Args:
            logits: [n, V] fp32 ``head_logits`` of the slot's rows.
            hidden: [n, H] pre-norm drafter hidden ``h_k`` of those rows.
            previous_tokens: [n] int64 previous token of each row (``g`` for slot 0, else the previous draft).
            temperature: [n] fp32 confidence temperatures ``τ_k``.

        Returns:
            ``(logits [n, V] fp32, confidences [n] fp32)``.
        """
        if self.markov_head is None or self.confidence_head is None:
            raise RuntimeError("only the last DSpark block owns the final norm and the heads")
        prev = self.markov_head.previous_embedding(previous_tokens)
        return logits + self.markov_head.bias(prev), self.confidence_head(hidden, prev, temperature)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """``m = RMSNorm(F · main_projᵀ; main_norm)`` (docs/design/model.md, "Context keys"). Args: features [T, n_t·H].
        Returns: [T, H] activation dtype."""
        if self.main_proj is None or self.main_norm is None:
            raise RuntimeError("only the first DSpark block owns main_proj / main_norm")
        return self.main_norm(self.main_proj(features))
