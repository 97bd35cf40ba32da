"""One decoder block (docs/design/model.md, "Forward pass"): optional Engram, attention and MoE around the mHC trunk.

Shifted mHC schedule (default): the attention input is read with the read-mix handed in (computed by the previous
sub-layer) and the FFN input with the attention read-mix; non-shifted: each sub-layer reads with its own read-mix.
The block returns the trunk after its own MoE post together with its FFN read-mix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from deepinfer_kernels.branch_streams import prefetch
from deepinfer_model.config import LayerSpec, TextConfig
from deepinfer_model.deepseek_v41.attention import Attention
from deepinfer_model.deepseek_v41.context import StepContext
from deepinfer_model.deepseek_v41.engram import Engram
from deepinfer_model.deepseek_v41.hyper_connection import hc_head, hc_mixes, hc_post, hc_read
from deepinfer_model.deepseek_v41.moe import ExpertDispatch, MoE
from deepinfer_model.layers.linear import make_parameter
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm

__all__ = ["DecoderBlock", "HCHeadParameters"]


class HCHeadParameters(nn.Module):
    """Mixin registering ``hc_head_base`` ``[m]``, ``hc_head_fn`` ``[m, m·H]``, ``hc_head_scale`` ``[1]`` (FP32) on the
    owning module (the model, or the last DSpark block) when ``hc_shifted`` is false."""

    def add_hc_head(self, cfg: TextConfig) -> None:
        if cfg.hc_shifted:
            return
        self.hc_head_base = make_parameter((cfg.hc_mult,), torch.float32)
        self.hc_head_fn = make_parameter((cfg.hc_mult, cfg.hc_norm_group_size), torch.float32)
        self.hc_head_scale = make_parameter((1,), torch.float32)

    def collapse(self, trunk: torch.Tensor, read_mix: torch.Tensor, cfg: TextConfig, mode: ComputeMode) -> torch.Tensor:
        """The final hidden ``[T, H]`` of a trunk after its last post: last read-mix (shifted) or the HC head."""
        if cfg.hc_shifted:
            return hc_read(trunk, read_mix, mode)
        return hc_head(
            trunk, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, cfg.rms_norm_eps, cfg.hc_eps, mode
        )


class DecoderBlock(nn.Module):
    """``layers.{ℓ}`` (also the body of ``mtp.{i}``).

    Args:
        cfg: text config.
        spec: the layer's structural spec.
        mode: compute mode.
        num_experts: routed experts of this block (``n_routed_experts`` or ``dspark_n_routed_experts``).
        top_k: experts per token.
        swa_group: cache group of the layer's SWA ring.
        dispatch: expert dispatch seam.
        local_experts: routed experts (logical ids per stored slot) this rank holds; None holds all.
    """

    def __init__(
        self,
        cfg: TextConfig,
        spec: LayerSpec,
        mode: ComputeMode,
        num_experts: int,
        top_k: int,
        swa_group: str,
        dispatch: ExpertDispatch,
        local_experts: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.mode = mode
        self.cfg = cfg
        mix, width = cfg.hc_mix_size, cfg.hc_norm_group_size
        for side in ("attn", "ffn"):
            setattr(self, f"hc_{side}_base", make_parameter((mix,), torch.float32))
            setattr(self, f"hc_{side}_fn", make_parameter((mix, width), torch.float32))
            setattr(self, f"hc_{side}_scale", make_parameter((3,), torch.float32))
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, mode)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, mode)
        self.attn = Attention(cfg, spec, mode, swa_group)
        self.ffn = MoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            num_experts,
            top_k,
            cfg.n_shared_experts,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            mode,
            dispatch,
            local_experts,
        )
        self.engram = Engram(cfg, spec.layer_id, mode) if spec.has_engram else None

    def _mixes(self, side: str, trunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return hc_mixes(
            trunk,
            getattr(self, f"hc_{side}_fn"),
            getattr(self, f"hc_{side}_scale"),
            getattr(self, f"hc_{side}_base"),
            cfg.rms_norm_eps,
            cfg.hc_eps,
            cfg.hc_sinkhorn_iters,
            self.mode,
        )

    def start_engram(self, ctx: StepContext) -> None:
        """Start this block's Engram projection (``Engram.project``, which reads the step's tokens only) unless it
        has started: the forward starts the next block's beside the running one (the prefetch stream under branch
        streams; docs/design/kernels.md, "Branch streams"). A block without an Engram does nothing."""
        layer = self.spec.layer_id
        if self.engram is None or layer in ctx.engram_kv:
            return
        if ctx.engram_rows is None or ctx.engram_active is None or ctx.engram_vocab is None:
            raise ValueError(f"layer {layer} has an Engram: the step needs engram_prefix_ids and an EngramVocab")
        rows = ctx.engram_rows
        ctx.engram_kv[layer] = prefetch(rows.device, self.engram.project, rows, ctx.engram_vocab)

    def forward(
        self, trunk: torch.Tensor, read_mix: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block.

        Args:
            trunk: [T, m, H] activation dtype, after the previous block's post.
            read_mix: [T, m] fp32 read-mix computed by the previous sub-layer (one-hot for the first block; unused
                by the non-shifted schedule).
            ctx: step context.

        Returns:
            ``(trunk after this block's MoE post [T, m, H], FFN read-mix [T, m])``; at the first YOCO consumer layer of
            a ``compact`` prefill step only the kept rows ``T_kept``.
        """
        layer = self.spec.layer_id
        if self.engram is not None:
            self.start_engram(ctx)
            assert ctx.engram_active is not None
            trunk = self.engram(trunk, ctx.engram_kv.pop(layer).result(), ctx.engram_active)
        read_a, write_a, comb_a = self._mixes("attn", trunk)
        shifted = self.cfg.hc_shifted
        # The norms' FP8 copies feed the FP8 GEMMs that read their outputs (docs/design/numerics.md, "Rounding points").
        x, x_fp8 = self.attn_norm.with_fp8_copy(hc_read(trunk, read_mix if shifted else read_a, self.mode))
        if self.spec.is_yoco_consumer and ctx.shared_hidden is None:
            # The shared hidden covers every token; the consumer half may go on with fewer rows from here
            # (docs/design/attention.md, "YOCO prefill truncation"), so the GEMMs quantize the kept rows themselves.
            ctx.shared_hidden = x
            trunk, read_a, write_a, comb_a, x = ctx.enter_consumer_half(trunk, read_a, write_a, comb_a, x)
            x_fp8 = None
        if layer in ctx.capture_layers:
            # The FP32 mean without an FP32 copy of the trunk first (the same values: FP32 sums in either case).
            ctx.features[layer] = trunk.mean(dim=1, dtype=torch.float32).to(self.mode.activation_dtype)
        trunk_ffn = hc_post(self.attn(x, ctx, x_fp8), trunk, write_a, comb_a, self.mode)
        read_f, write_f, comb_f = self._mixes("ffn", trunk_ffn)
        ffn_in = hc_read(trunk_ffn, read_a if shifted else read_f, self.mode)
        y = self.ffn(*self.ffn_norm.with_fp8_codes(ffn_in, self.ffn.input_code_order(ffn_in.shape[0])))
        return hc_post(y, trunk_ffn, write_f, comb_f, self.mode), read_f
