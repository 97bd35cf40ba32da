"""``DeepseekV41ForCausalLM``: the layered DeepSeek-V4.1-Flash text model the engine runs.

Build from a ``ModelConfig`` on any device (``meta`` included), ``load_weights`` from ``(hf_name, tensor)`` pairs in
stored formats, declare the cache groups with ``cache_spec``, allocate a ``ModelState`` and call
``forward(batch, state)`` once per step. Each step: embed → expand to ``m`` streams → blocks → final read → RMSNorm →
LM head (docs/design/model.md, "Forward pass"); DSpark target features are captured on the way and the drafter's
context keys written into its rings (docs/design/model.md, "Context keys"). With YOCO prefill truncation
(``deepseek_v41.truncation``) the consumer half of a prefill step narrows its windows (``mask``) or computes only the
kept rows (``compact``; docs/design/attention.md, "YOCO prefill truncation").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from deepinfer_kernels.branch_streams import branch_streams_active
from deepinfer_model.cache_spec import CacheGroupSpec, CacheSpec
from deepinfer_model.config import ModelConfig
from deepinfer_model.deepseek_v41.block import DecoderBlock, HCHeadParameters
from deepinfer_model.deepseek_v41.context import (
    COMPRESSOR_GROUP,
    DSPARK_GROUP,
    SWA_GROUP,
    WHOLE_STEP,
    StepContext,
    compressed_group,
    index_k_group,
)
from deepinfer_model.deepseek_v41.context_parallel import token_split
from deepinfer_model.deepseek_v41.dspark import DSparkBlock
from deepinfer_model.deepseek_v41.engram import EngramVocab, ngram_rows
from deepinfer_model.deepseek_v41.expert_parallel import ExpertParallelMoE
from deepinfer_model.deepseek_v41.hyper_connection import initial_read_mix
from deepinfer_model.deepseek_v41.moe import ExpertDispatch, MoE, local_expert_dispatch
from deepinfer_model.deepseek_v41.truncation import Compaction, PrefillTruncation, truncate_step
from deepinfer_model.deepseek_v41.weight_loading import load_named_weights
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.embedding import LMHead, VocabEmbedding
from deepinfer_model.layers.kernel_modes import kernel_modes_forward
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm
from deepinfer_model.state import ModelState, StepMetadata
from deepinfer_model.state.codecs import (
    Fp4E4m3RowCodec,
    Fp4Ue8m0RowCodec,
    Fp8RowCodec,
    RawFp32RowCodec,
    RowCodec,
)
from deepinfer_parallel.groups import RankGroup

__all__ = ["DeepseekV41ForCausalLM"]


class DeepseekV41ForCausalLM(HCHeadParameters):
    """The text model (backbone + DSpark blocks).

    Args:
        config: validated model config.
        mode: compute mode (``EXACT`` for inference, ``FP32`` for parity tests).
        engram_vocab: compressed vocabulary; required to run a model with Engram layers.
        expert_dispatch: expert dispatch seam of every MoE that no expert-parallel argument covers.
        max_backtracking_tokens: ``BT``, positions that can be rolled back (sizes the rings, ≥ 1).
        expert_parallel: shards the backbone's routed experts over an EP group: each block stores only this rank's
            experts (``load_weights`` skips the others) and dispatches tokens over the group. None keeps every
            expert here.
        draft_expert_parallel: the same for the DSpark blocks' routed experts (a placement of
            ``num_nextn_predict_layers`` layers of ``dspark_n_routed_experts``); None keeps them all here.
        context_parallel: the CP group prefill steps are split over (``deepseek_v41.context_parallel``; every rank
            of the group runs the same steps). None or a group of one runs every step whole. Also settable as the
            ``context_parallel`` attribute after construction.
        prefill_truncation: YOCO prefill truncation of prompt chunks (off by default); it applies to the steps whose
            ``ForwardBatch.known_lens`` is set.
        batch_invariant: on the CPU and on CUDA, ``forward``, ``draft_forward``, ``draft_logits`` and ``draft_heads``
            give every request the same bits whatever else is in the step (``deepinfer_model.layers.kernel_modes``;
            docs/design/numerics.md, "Batch invariance"); other devices ignore it.
        dependent_launch: the same four entry points launch the nvidia backend's Triton kernels as programmatic
            dependent launches (the same bits; docs/design/kernels.md, "Dependent launches"); a no-op elsewhere.
        dependent_launch_max_tokens: as ``dependent_launch``, for the entry point calls of at most this many tokens
            only (0: none; ``deepinfer_model.layers.kernel_modes``).
        branch_streams: on CUDA the four entry points run their independent branches (the shared expert, the window
            keys, the next Engram projection) on side streams (the same bits; docs/design/kernels.md, "Branch
            streams"); a no-op elsewhere.
        flashmla: prompt-sized attention calls of the four entry points run FlashMLA's sparse prefill kernel where
            it is importable on an SM90 device (``deepinfer_kernels.vendor_attention``; not the same bits:
            docs/design/kernels.md, "FlashMLA sparse prefill"); a no-op elsewhere and in the batch-invariant mode.

    Attributes:
        consumer_layer_rows: query rows the YOCO consumer layers computed, summed over layers and eager forwards
            since construction (a work counter: ``compact`` truncation lowers it; CUDA graph replays are not
            counted).

    Raises:
        ValueError: ``BT < 1``, an ``expert_parallel`` placement that does not match the config, or a truncation
            setting the model cannot run (``PrefillTruncation.check``).
    """

    def __init__(
        self,
        config: ModelConfig,
        mode: ComputeMode = ComputeMode.EXACT,
        engram_vocab: EngramVocab | None = None,
        expert_dispatch: ExpertDispatch = local_expert_dispatch,
        max_backtracking_tokens: int = 6,
        expert_parallel: ExpertParallelMoE | None = None,
        draft_expert_parallel: ExpertParallelMoE | None = None,
        context_parallel: RankGroup | None = None,
        prefill_truncation: PrefillTruncation | None = None,
        batch_invariant: bool = False,
        dependent_launch: bool = False,
        dependent_launch_max_tokens: int = 0,
        branch_streams: bool = False,
        flashmla: bool = False,
    ) -> None:
        super().__init__()
        cfg = config.text
        if max_backtracking_tokens < 1:
            raise ValueError(f"max_backtracking_tokens must be >= 1, got {max_backtracking_tokens}")
        if dependent_launch_max_tokens < 0:
            raise ValueError(f"dependent_launch_max_tokens must be >= 0, got {dependent_launch_max_tokens}")
        prefill_truncation = prefill_truncation or PrefillTruncation()
        prefill_truncation.check(cfg, max_backtracking_tokens)
        if expert_parallel is not None:
            expert_parallel.check_covers(cfg.num_hidden_layers, cfg.n_routed_experts, "backbone layers")
        if draft_expert_parallel is not None:
            draft_expert_parallel.check_covers(
                cfg.num_nextn_predict_layers, cfg.dspark_n_routed_experts, "DSpark blocks"
            )
        self.config = config
        self.mode = mode
        self.engram_vocab = engram_vocab
        self.max_backtracking_tokens = max_backtracking_tokens
        self.context_parallel = context_parallel
        self.prefill_truncation = prefill_truncation
        self.batch_invariant = batch_invariant
        self.dependent_launch = dependent_launch
        self.dependent_launch_max_tokens = dependent_launch_max_tokens
        self.branch_streams = branch_streams
        self.flashmla = flashmla
        self.consumer_layer_rows = 0
        backbone = cfg.layers[: cfg.num_hidden_layers]
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, mode)
        self.layers = nn.ModuleList(
            DecoderBlock(
                cfg,
                spec,
                mode,
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                SWA_GROUP,
                expert_dispatch if expert_parallel is None else expert_parallel.layer_dispatch(index),
                None if expert_parallel is None else expert_parallel.local_experts(index),
            )
            for index, spec in enumerate(backbone)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, mode)
        self.head = LMHead(cfg.vocab_size, cfg.hidden_size)
        self.add_hc_head(cfg)
        self.mtp = nn.ModuleList(
            DSparkBlock(
                cfg,
                spec,
                mode,
                index,
                DSPARK_GROUP,
                expert_dispatch if draft_expert_parallel is None else draft_expert_parallel.layer_dispatch(index),
                None if draft_expert_parallel is None else draft_expert_parallel.local_experts(index),
            )
            for index, spec in enumerate(cfg.layers[cfg.num_hidden_layers :])
        )

    # ---- cache declaration -------------------------------------------------------------------------------------

    def row_codecs(self) -> dict[str, RowCodec]:
        """Row codec of every cache group this model may declare (by group name)."""
        cfg = self.config.text
        width, index_width = cfg.head_dim, cfg.index_head_dim
        codecs: dict[str, RowCodec] = {COMPRESSOR_GROUP: RawFp32RowCodec(2 * width)}
        for ratio in (1, 2):
            if self.mode is ComputeMode.EXACT:
                main: RowCodec = Fp4E4m3RowCodec(width) if cfg.use_fp4_sparse_kv else Fp8RowCodec(width)
                codecs[compressed_group(ratio)] = main
                codecs[index_k_group(ratio)] = Fp4Ue8m0RowCodec(index_width)
            else:
                codecs[compressed_group(ratio)] = RawFp32RowCodec(width)
                codecs[index_k_group(ratio)] = RawFp32RowCodec(index_width)
        swa: RowCodec = Fp8RowCodec(width) if self.mode is ComputeMode.EXACT else RawFp32RowCodec(width)
        codecs[SWA_GROUP] = swa
        codecs[DSPARK_GROUP] = swa
        return codecs

    def cache_spec(self) -> CacheSpec:
        """The cache groups (docs/design/cache.md, "Cache groups") for this config and compute mode."""
        cfg = self.config.text
        codecs = self.row_codecs()
        bt = self.max_backtracking_tokens
        backbone = cfg.layers[: cfg.num_hidden_layers]
        groups = [
            CacheGroupSpec.sliding_window(
                SWA_GROUP,
                tuple(spec.layer_id for spec in backbone),
                codecs[SWA_GROUP].bytes_per_row,
                cfg.sliding_window,
                bt,
                torch.uint8,
            )
        ]
        for ratio in (2, 1):
            kv_layers = tuple(s.layer_id for s in backbone if s.owns_compressor and s.compress_ratio == ratio)
            index_layers = tuple(s.layer_id for s in backbone if s.owns_index_k and s.compress_ratio == ratio)
            if kv_layers:
                name = compressed_group(ratio)
                groups.append(CacheGroupSpec.paged(name, kv_layers, codecs[name].bytes_per_row, ratio, torch.uint8))
            if index_layers:
                name = index_k_group(ratio)
                groups.append(CacheGroupSpec.paged(name, index_layers, codecs[name].bytes_per_row, ratio, torch.uint8))
            if ratio == 2 and kv_layers:
                groups.append(
                    CacheGroupSpec.state(
                        COMPRESSOR_GROUP, kv_layers, codecs[COMPRESSOR_GROUP].bytes_per_row, 2, bt, torch.uint8
                    )
                )
        if cfg.num_nextn_predict_layers:
            drafter = tuple(range(cfg.num_hidden_layers, cfg.num_runtime_layers))
            groups.append(
                CacheGroupSpec.sliding_window(
                    DSPARK_GROUP, drafter, codecs[DSPARK_GROUP].bytes_per_row, cfg.sliding_window, bt, torch.uint8
                )
            )
        return CacheSpec(tuple(groups))

    def allocate_state(
        self, block_size: int, num_blocks: int, num_state_slots: int, device: torch.device | str = "cpu"
    ) -> ModelState:
        """Zeroed cache pools for ``num_blocks`` pages of ``block_size`` tokens and ``num_state_slots`` requests."""
        return ModelState.allocate(
            self.cache_spec(), self.row_codecs(), block_size, num_blocks, num_state_slots, device
        )

    # ---- what the engine may ask ------------------------------------------------------------------------------

    def supports_graphs(self) -> bool:
        """Whether a decode forward can be captured in a CUDA graph: exact compute mode (the FP32 parity mode loops
        over experts on the host) and every backbone expert held locally (an expert-parallel dispatch exchanges
        data-dependent token counts over the host). The device is the caller's to check."""
        if self.mode is not ComputeMode.EXACT:
            return False
        return all(moe.dispatch is local_expert_dispatch for moe in self.moe_layers())

    def moe_layers(self) -> list[MoE]:
        """The backbone MoE of every layer, in layer order (what expert-parallel load balancing moves).

        Raises:
            ValueError: a backbone layer's feed-forward is not a MoE.
        """
        moes = []
        for index, block in enumerate(self.layers):
            ffn = block.ffn
            if not isinstance(ffn, MoE):
                raise ValueError(f"layer {index}'s feed-forward is {type(ffn).__name__}, not a MoE")
            moes.append(ffn)
        return moes

    # ---- weights -----------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load stored-format checkpoint tensors by HF name, strictly (see ``weight_loading``)."""
        load_named_weights(self, weights)

    # ---- forward -----------------------------------------------------------------------------------------------

    @kernel_modes_forward
    def forward(self, batch: ForwardBatch, state: ModelState) -> torch.Tensor:
        """One step: compute every query token of the batch, update the caches, return logits.

        With a ``context_parallel`` group, a step with a prefill chunk is split over the group (a collective: every
        CP rank calls ``forward`` with the same batch) and returns the same logits on every rank.

        Args:
            batch: the step's tokens and cache addressing.
            state: cache pools from ``allocate_state`` (updated in place).

        Returns:
            [N, V] fp32 logits of ``batch.logits_indices`` (every token when None; under ``compact`` truncation of a
            prefill step only kept tokens may be asked for, and None returns the kept rows).
        """
        cfg = self.config.text
        meta = StepMetadata.from_batch(batch)
        compaction: Compaction | None = None
        if self.prefill_truncation.enabled and batch.known_lens is not None and meta.max_query_len > 1:
            meta, compaction = truncate_step(meta, batch.known_lens, self.prefill_truncation)
        split = token_split(batch, meta, self.context_parallel)
        if compaction is not None and split is not WHOLE_STEP:
            raise ValueError("compact YOCO prefill truncation cannot run a context-parallel split step; use 'mask'")
        ctx = StepContext.for_step(
            meta, state, split, capture_layers=frozenset(cfg.dspark_target_layer_ids), compaction=compaction
        )
        if cfg.engram_enabled:
            self.prepare_engram(batch, ctx)
        hidden = self.embed(split.local(batch.input_ids))
        trunk = hidden[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        read_mix = initial_read_mix(ctx.meta.num_tokens, cfg.hc_mult, hidden.device)
        blocks = list(zip(cfg.layers, self.layers, strict=False))
        for index, (spec, block) in enumerate(blocks):
            if index + 1 < len(blocks) and branch_streams_active(trunk.device):
                # The next block's Engram projection reads only the tokens: it runs beside this block. Without the
                # streams it would only hold its output longer, so each block then starts its own.
                upcoming = blocks[index + 1][1]
                assert isinstance(upcoming, DecoderBlock)
                upcoming.start_engram(ctx)
            trunk, read_mix = block(trunk, read_mix, ctx)
            if spec.is_yoco_consumer:
                self.consumer_layer_rows += trunk.shape[0]
        if len(self.mtp):
            self.store_context_keys(ctx)
        final = split.gather(self.collapse(trunk, read_mix, cfg, self.mode))
        if batch.logits_indices is not None:
            rows = batch.logits_indices if compaction is None else compaction.logits_rows(batch.logits_indices)
            final = final[rows]
        return self.head(self.norm(final))

    @kernel_modes_forward
    def draft_forward(self, batch: ForwardBatch, state: ModelState) -> torch.Tensor:
        """DSpark draft forward (docs/design/model.md, "Draft forward"): every request's tokens form one non-causal
        draft block.

        The runner lays out each request's block as tokens ``[g, N, …, N]`` at positions ``p* + 1 … p* + B``
        (``context_lens = p* + 1 + B``), ``p*`` the last accepted position, whose context keys the main forward
        already wrote; the draft keys overwrite ring rows ``p* + 1 … p* + B``.

        Args:
            batch: the draft step (no logits selection, no Engram).
            state: cache pools (the DSpark rings are read and written).

        Returns:
            [T, H] pre-norm hidden ``h_k`` of every slot (activation dtype).
        """
        if not len(self.mtp):
            raise ValueError("the model has no DSpark blocks (num_nextn_predict_layers = 0)")
        cfg = self.config.text
        meta = StepMetadata.from_batch(batch)
        ctx = StepContext.for_step(meta, state, draft=True)
        hidden = self.embed(batch.input_ids)
        trunk = hidden[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        read_mix = initial_read_mix(meta.num_tokens, cfg.hc_mult, hidden.device)
        for block in self.mtp:
            trunk, read_mix = block(trunk, read_mix, ctx)
        return self._last_dspark().collapse(trunk, read_mix, cfg, self.mode)

    @kernel_modes_forward
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits before the Markov bias of any number of draft rows (``DSparkBlock.head_logits``): a drafter
        passes every slot of its blocks at once, so the LM head is read once per draft step, not once per slot.

        Args:
            hidden: [m, H] from ``draft_forward``.

        Returns:
            [m, V] fp32.
        """
        return self._last_dspark().head_logits(hidden, self.head)

    @kernel_modes_forward
    def draft_heads(
        self, logits: torch.Tensor, hidden: torch.Tensor, previous_tokens: torch.Tensor, temperature: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits and confidences of one draft slot (docs/design/model.md, "Draft heads"); see
        ``DSparkBlock.slot_heads``.

        Args:
            logits: [n, V] fp32 ``draft_logits`` of the slot's rows.
            hidden: [n, H] from ``draft_forward``, the same rows.
            previous_tokens: [n] int64 previous token of each row.
            temperature: [n] fp32 confidence temperatures.

        Returns:
            ``(logits [n, V] fp32, confidences [n] fp32)``.
        """
        return self._last_dspark().slot_heads(logits, hidden, previous_tokens, temperature)

    def _last_dspark(self) -> DSparkBlock:
        last = self.mtp[-1]
        assert isinstance(last, DSparkBlock)
        return last

    def prepare_engram(self, batch: ForwardBatch, ctx: StepContext) -> None:
        """Set the step's compressed n-gram rows (and the vocabulary) on ``ctx`` from ``batch``'s tokens.

        n-grams look back across a split step's block boundaries: they are derived over every token, then the
        context keeps its local rows."""
        cfg = self.config.text
        assert cfg.engram_max_ngram_size is not None
        if self.engram_vocab is None:
            raise ValueError("this config has Engram layers: build the model with an EngramVocab")
        meta = ctx.step_meta
        prefix = batch.engram_prefix_ids
        if prefix is None:
            if bool((meta.q_start > 0).any()):
                raise ValueError("engram_prefix_ids is required when a request does not start at position 0")
            prefix = torch.full(
                (batch.num_requests, cfg.engram_max_ngram_size - 1), -1, dtype=torch.int64, device=meta.positions.device
            )
        # Keep the table on the step's device once instead of copying it every step.
        self.engram_vocab = self.engram_vocab.to(batch.input_ids.device)
        rows, active = ngram_rows(meta, batch.input_ids, prefix, self.engram_vocab)
        ctx.engram_rows, ctx.engram_active = ctx.split.local(rows), ctx.split.local(active)
        ctx.engram_vocab = self.engram_vocab

    def store_context_keys(self, ctx: StepContext) -> None:
        """Write the drafter's context keys of every token of the step into every DSpark ring
        (docs/design/model.md, "Context keys"); of the kept rows only when the target layers are YOCO consumers of a
        ``compact`` step (docs/design/attention.md, "YOCO prefill truncation")."""
        cfg = self.config.text
        consumers = min(cfg.dspark_target_layer_ids) >= cfg.n_prefill_layer
        meta = ctx.key_meta if consumers else ctx.step_meta
        features = ctx.split.gather(torch.cat([ctx.features[layer] for layer in cfg.dspark_target_layer_ids], dim=-1))
        first = self.mtp[0]
        assert isinstance(first, DSparkBlock)
        projected = first.project_features(features)
        for block in self.mtp:
            assert isinstance(block, DSparkBlock)
            block.attn.store_window_keys(projected, meta, ctx.state)
