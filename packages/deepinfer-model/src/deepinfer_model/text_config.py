"""``text_config`` of DeepSeek-V4.1-Flash: the frozen field set (HF key names), the values derived from it (internal
sizes without an HF key, the per-layer attention kind, the cross-layer sharing maps, the YOCO boundary, the Engram
table sizes of docs/design/model.md "Table primes", the DSpark sizes) and the fail-fast rules that run at
construction (docs/design/model.md, "Configuration rules", "Layer roles"). Checks run in dependency order so that
the sharing-map checks only see well-formed id lists. GPU-kernel layout constraints of the release (``H % 128``,
``D = 512``, ``n_h in {64, 128}``, the candidate MQA-path constraints ...) are deliberately not enforced; only the
constraints the stored formats themselves need are (multiples of 32 for every FP8/MXFP4 group,
docs/design/numerics.md, "Number formats"). ``deepinfer_model.config`` re-exports ``TextConfig``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from deepinfer_model import _primes
from deepinfer_model._config_errors import config_error, require_equal
from deepinfer_model.config_sections import RopeScalingConfig
from deepinfer_model.layer_spec import LayerKind, LayerSpec

__all__ = ["TextConfig"]

_FORMAT_GROUP = 32  # FP8 activation groups and MXFP4 / Engram scale groups (docs/design/numerics.md, "Number formats")
_ROPE_HEAD_DIM = 64  # asserted by the reference indexer (docs/design/model.md, "Configuration rules")
_RATIO_TO_KIND = {0: LayerKind.SWA, 1: LayerKind.C1, 2: LayerKind.C2}


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """``text_config`` (docs/design/model.md, "Configuration rules"). Field names are the HF keys; defaults are the
    spec's optional defaults.

    ``index_k_source_layer_ids`` defaults to ``kv_source_layer_ids`` (it is filled in by ``from_dict``); the Engram
    keys are None when ``engram_layer_ids`` is empty.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool
    attention_dropout: float
    num_key_value_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    swiglu_limit: float | None
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    compress_ratios: tuple[int, ...]
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    index_source_layer_ids: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_k_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int | None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    dspark_block_size: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_noise_token_id: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    num_nextn_predict_layers: int = 0
    rope_scaling: RopeScalingConfig | None = None
    use_fp4_sparse_kv: bool = True
    candidate_topk_blocks: int | None = None
    candidate_block_size: int | None = None
    hc_shifted: bool = True
    dspark_target_attn_input: bool = True
    engram_layer_ids: tuple[int, ...] = ()
    engram_max_ngram_size: int | None = None
    engram_vocab_size: int | None = None
    engram_n_heads: int | None = None
    engram_head_dim: int | None = None
    engram_compressed_vocab_size: int | None = None
    engram_pad_token_id: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived values -----------------------------------------------------------------------------------------

    @property
    def kv_lora_rank(self) -> int:
        """``D − r``: the NoPE part of the shared KV vector."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_norm_group_size(self) -> int:
        """``m·H``: one RMS group over all residual streams."""
        return self.hc_mult * self.hidden_size

    @property
    def window_size(self) -> tuple[int, int]:
        return (self.sliding_window, 0)

    @property
    def hc_mix_size(self) -> int:
        """``(2+m)·m``: rows of every ``hc_*_fn`` / entries of every ``hc_*_base``."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def num_runtime_layers(self) -> int:
        """``L + N_mtp``: backbone blocks followed by DSpark blocks."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def n_prefill_layer(self) -> int:
        """First index of the whole ``compress_ratios`` list whose value is 1 (the YOCO boundary)."""
        return self.compress_ratios.index(1)

    @property
    def yoco_enabled(self) -> bool:
        return self.n_prefill_layer < self.num_hidden_layers

    @property
    def engram_enabled(self) -> bool:
        return len(self.engram_layer_ids) > 0

    @property
    def shared_intermediate_size(self) -> int:
        """``S·I``: width of the shared-expert block (0 when there is no shared expert)."""
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def dspark_num_targets(self) -> int:
        return len(self.dspark_target_layer_ids)

    # ---- sharing maps (docs/design/model.md, "Layer roles") -------------------------------------------------------

    def _source_map(self, sources: tuple[int, ...]) -> tuple[int, ...]:
        mapping = list(range(self.num_runtime_layers))
        current = sources[0]
        source_set = set(sources)
        for layer in range(sources[0], self.num_hidden_layers):
            if layer in source_set:
                current = layer
            mapping[layer] = current
        return tuple(mapping)

    @cached_property
    def layer_kv_map(self) -> tuple[int, ...]:
        """Runtime layer → layer owning its compressed KV cache (length ``L + N_mtp``)."""
        return self._source_map(self.kv_source_layer_ids)

    @cached_property
    def layer_index_module_map(self) -> tuple[int, ...]:
        """Runtime layer → layer whose indexer produces its top-k (length ``L + N_mtp``)."""
        return self._source_map(self.index_source_layer_ids)

    @cached_property
    def layer_index_k_map(self) -> tuple[int, ...]:
        """Runtime layer → layer owning its index-K cache (length ``L + N_mtp``)."""
        return self._source_map(self.index_k_source_layer_ids)

    @cached_property
    def layer_candidate_source_map(self) -> Mapping[int, int]:
        """Sparse map: layers ``c … L−1`` → candidate source ``c``; empty when no candidate source is set."""
        source = self.candidate_source_layer_id
        if source is None:
            return {}
        return {layer: source for layer in range(source, self.num_hidden_layers)}

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """One ``LayerSpec`` per runtime layer (backbone then DSpark)."""
        engram = set(self.engram_layer_ids)
        specs = []
        for layer in range(self.num_runtime_layers):
            is_backbone = layer < self.num_hidden_layers
            ratio = self.compress_ratios[layer] if is_backbone else 0
            kind = _RATIO_TO_KIND[ratio] if is_backbone else LayerKind.DSPARK
            compressed = kind in (LayerKind.C1, LayerKind.C2)
            specs.append(
                LayerSpec(
                    layer_id=layer,
                    kind=kind,
                    compress_ratio=ratio,
                    kv_source=self.layer_kv_map[layer],
                    index_source=self.layer_index_module_map[layer],
                    index_k_source=self.layer_index_k_map[layer],
                    candidate_source=self.layer_candidate_source_map.get(layer),
                    is_yoco_consumer=is_backbone and self.yoco_enabled and layer >= self.n_prefill_layer,
                    has_engram=layer in engram,
                    rope_theta=self.compress_rope_theta if compressed else self.rope_theta,
                    uses_yarn=compressed and self.rope_scaling is not None,
                )
            )
        return tuple(specs)

    # ---- Engram (docs/design/model.md, "Table primes") ------------------------------------------------------------

    @cached_property
    def engram_table_sizes(self) -> tuple[tuple[int, ...], ...]:
        """Prime sub-table sizes per Engram layer (in ``engram_layer_ids`` order), sub-tables order-major.

        Returns:
            One tuple of ``(N_g − 1)·h_e`` distinct primes ``> V_e − 1`` per Engram layer.
        """
        if not self.engram_enabled:
            return ()
        assert self.engram_max_ngram_size is not None and self.engram_n_heads is not None
        assert self.engram_vocab_size is not None
        used: set[int] = set()
        tables = []
        for _ in self.engram_layer_ids:
            sizes = []
            for _order in range(2, self.engram_max_ngram_size + 1):
                start = self.engram_vocab_size - 1
                for _head in range(self.engram_n_heads):
                    prime = _primes.next_prime(start)
                    while prime in used:
                        prime = _primes.next_prime(prime)
                    used.add(prime)
                    sizes.append(prime)
                    start = prime
            tables.append(tuple(sizes))
        return tuple(tables)

    def engram_num_rows(self, layer: int) -> int:
        """``R_ℓ``: rows of ``layers.{layer}.engram.embed`` (sum of the layer's table sizes)."""
        if layer not in self.engram_layer_ids:
            raise ValueError(f"layer {layer} is not an Engram layer; Engram layers are {list(self.engram_layer_ids)}")
        return sum(self.engram_table_sizes[self.engram_layer_ids.index(layer)])

    @property
    def engram_input_width(self) -> int:
        """``(N_g − 1)·h_e·d_e``: input width of ``engram.wkv`` (0 when Engram is off)."""
        if not self.engram_enabled:
            return 0
        assert self.engram_max_ngram_size is not None and self.engram_n_heads is not None
        assert self.engram_head_dim is not None
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim

    @property
    def softmax_scale(self) -> float:
        """``D^−0.5``, identical for every layer kind."""
        return 1.0 / math.sqrt(self.head_dim)


# ---- fail-fast rules (run by TextConfig.__post_init__) ----------------------------------------------------------


def _check_constants(t: TextConfig) -> None:
    require_equal("text_config.hidden_act", t.hidden_act, "silu")
    require_equal("text_config.attention_bias", t.attention_bias, False)
    if t.attention_dropout != 0.0:
        raise config_error("text_config.attention_dropout", t.attention_dropout, "must be 0.0")
    require_equal("text_config.num_key_value_heads", t.num_key_value_heads, 1)
    require_equal("text_config.scoring_func", t.scoring_func, "sqrtsoftplus")
    require_equal("text_config.topk_method", t.topk_method, "noaux_tc")
    require_equal("text_config.norm_topk_prob", t.norm_topk_prob, True)


def _check_dimensions(t: TextConfig) -> None:
    for key in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "sliding_window",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "hc_mult",
        "hc_sinkhorn_iters",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "dspark_block_size",
        "dspark_n_routed_experts",
        "dspark_num_experts_per_tok",
    ):
        value = getattr(t, key)
        if value <= 0:
            raise config_error(f"text_config.{key}", value, "must be a positive integer")
    for key in ("n_shared_experts", "num_nextn_predict_layers", "dspark_markov_rank"):
        value = getattr(t, key)
        if value < 0:
            raise config_error(f"text_config.{key}", value, "must be >= 0")
    for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        value = getattr(t, key)
        if not math.isfinite(value) or value < 0 or (key.endswith("theta") and value == 0):
            raise config_error(f"text_config.{key}", value, "must be a finite number >= 0 (> 0 for RoPE bases)")
    if t.swiglu_limit is not None and not t.swiglu_limit > 0:
        raise config_error("text_config.swiglu_limit", t.swiglu_limit, "must be null or a number > 0")
    if t.qk_rope_head_dim != _ROPE_HEAD_DIM:
        raise config_error("text_config.qk_rope_head_dim", t.qk_rope_head_dim, f"must be {_ROPE_HEAD_DIM}")
    if t.head_dim <= t.qk_rope_head_dim:
        raise config_error("text_config.head_dim", t.head_dim, f"must exceed qk_rope_head_dim ({t.qk_rope_head_dim})")
    if t.num_attention_heads % t.o_groups != 0:
        raise config_error(
            "text_config.o_groups", t.o_groups, f"must divide num_attention_heads ({t.num_attention_heads})"
        )
    for key in ("hidden_size", "moe_intermediate_size", "q_lora_rank", "head_dim", "o_lora_rank"):
        value = getattr(t, key)
        if value % _FORMAT_GROUP != 0:
            raise config_error(f"text_config.{key}", value, f"must be a multiple of {_FORMAT_GROUP} (FP8/MXFP4 groups)")
    if t.num_experts_per_tok > t.n_routed_experts:
        raise config_error(
            "text_config.num_experts_per_tok",
            t.num_experts_per_tok,
            f"must be <= n_routed_experts ({t.n_routed_experts})",
        )
    if t.dspark_num_experts_per_tok > t.dspark_n_routed_experts:
        raise config_error(
            "text_config.dspark_num_experts_per_tok",
            t.dspark_num_experts_per_tok,
            f"must be <= dspark_n_routed_experts ({t.dspark_n_routed_experts})",
        )


def _check_compress_ratios(t: TextConfig) -> None:
    expected = t.num_hidden_layers + t.num_nextn_predict_layers
    if len(t.compress_ratios) != expected:
        raise config_error(
            "text_config.compress_ratios",
            list(t.compress_ratios),
            f"must have num_hidden_layers + num_nextn_predict_layers = {expected} entries, "
            f"has {len(t.compress_ratios)}",
        )
    for layer, ratio in enumerate(t.compress_ratios[: t.num_hidden_layers]):
        if ratio not in (0, 1, 2):
            raise config_error(
                f"text_config.compress_ratios[{layer}]", ratio, "backbone layer ratios must be 0, 1 or 2"
            )
    if 1 not in t.compress_ratios:
        raise config_error(
            "text_config.compress_ratios", list(t.compress_ratios), "must contain a 1 (the YOCO boundary)"
        )


def _check_layer_ids(key: str, ids: tuple[int, ...], num_layers: int, non_empty: bool, ordered: bool) -> None:
    if non_empty and not ids:
        raise config_error(key, list(ids), "must be a non-empty list")
    for layer in ids:
        if not 0 <= layer < num_layers:
            raise config_error(key, list(ids), f"every id must be a backbone layer in [0, {num_layers})")
    if ordered and any(a >= b for a, b in itertools.pairwise(ids)):
        raise config_error(key, list(ids), "ids must be strictly increasing")
    if len(set(ids)) != len(ids):
        raise config_error(key, list(ids), "ids must be unique")


def _check_sharing(t: TextConfig) -> None:
    num_layers = t.num_hidden_layers
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "index_k_source_layer_ids"):
        _check_layer_ids(f"text_config.{key}", getattr(t, key), num_layers, non_empty=True, ordered=True)
    kv, index, index_k = t.layer_kv_map, t.layer_index_module_map, t.layer_index_k_map
    boundary = t.n_prefill_layer
    if boundary < num_layers and kv[boundary] != boundary:
        raise config_error(
            "text_config.kv_source_layer_ids",
            list(t.kv_source_layer_ids),
            f"the KV map may not cross the YOCO boundary: layer {boundary} (first ratio 1) must be a KV source",
        )
    ratios = t.compress_ratios
    maps = (
        ("kv_source_layer_ids", t.layer_kv_map),
        ("index_source_layer_ids", t.layer_index_module_map),
        ("index_k_source_layer_ids", t.layer_index_k_map),
    )
    for key, mapping in maps:
        for layer in range(num_layers):
            source = mapping[layer]
            if source == layer:
                continue
            if ratios[layer] == 0:
                raise config_error(
                    f"text_config.{key}",
                    list(getattr(t, key)),
                    f"makes SWA-only layer {layer} a consumer of layer {source}; list it as a source",
                )
            if ratios[source] != ratios[layer]:
                raise config_error(
                    f"text_config.{key}",
                    list(getattr(t, key)),
                    f"layer {layer} (ratio {ratios[layer]}) would share with layer {source} (ratio {ratios[source]});"
                    " a consumer must have its source's compress ratio",
                )
    for layer in range(num_layers):
        if index_k[index[layer]] != index_k[layer]:
            raise config_error(
                "text_config.index_source_layer_ids",
                list(t.index_source_layer_ids),
                f"layer {layer}: index segments must refine index-K segments "
                f"(index-K of index source {index[layer]} is {index_k[index[layer]]}, of the layer {index_k[layer]})",
            )
        if kv[index_k[layer]] != kv[layer]:
            raise config_error(
                "text_config.index_k_source_layer_ids",
                list(t.index_k_source_layer_ids),
                f"layer {layer}: index-K segments must refine KV segments "
                f"(KV source of index-K source {index_k[layer]} is {kv[index_k[layer]]}, of the layer {kv[layer]})",
            )


def _check_candidates(t: TextConfig) -> None:
    source = t.candidate_source_layer_id
    if source is None:
        return
    key = "text_config.candidate_source_layer_id"
    if not 0 <= source < t.num_hidden_layers:
        raise config_error(key, source, f"must be null or a backbone layer in [0, {t.num_hidden_layers})")
    if t.layer_index_module_map[source] != source or t.compress_ratios[source] == 0:
        raise config_error(key, source, "must be a compressed layer that is an index source")
    blocks, size = t.candidate_topk_blocks, t.candidate_block_size
    assert blocks is not None and size is not None
    if blocks <= 0 or blocks % 8 != 0:
        raise config_error("text_config.candidate_topk_blocks", blocks, "must be a positive multiple of 8")
    if size not in (8, 16):
        # The reference release's candidate-block kernel only takes these sizes.
        raise config_error("text_config.candidate_block_size", size, "must be 8 or 16")
    if blocks * size < t.index_topk:
        raise config_error(
            "text_config.candidate_topk_blocks",
            blocks,
            f"candidate_topk_blocks * candidate_block_size ({blocks * size}) must be >= index_topk ({t.index_topk})",
        )
    for layer in range(source, t.num_hidden_layers):
        if t.compress_ratios[layer] != t.compress_ratios[source]:
            raise config_error(
                key,
                source,
                f"every layer from the candidate source on must have its compress ratio "
                f"{t.compress_ratios[source]}; layer {layer} has {t.compress_ratios[layer]}",
            )


def _check_engram(t: TextConfig) -> None:
    if not t.engram_layer_ids:
        return
    _check_layer_ids("text_config.engram_layer_ids", t.engram_layer_ids, t.num_hidden_layers, True, ordered=False)
    assert t.engram_max_ngram_size is not None and t.engram_vocab_size is not None
    assert t.engram_n_heads is not None and t.engram_head_dim is not None
    if t.engram_max_ngram_size < 2:
        raise config_error("text_config.engram_max_ngram_size", t.engram_max_ngram_size, "must be >= 2")
    for key in ("engram_vocab_size", "engram_n_heads", "engram_head_dim"):
        if getattr(t, key) <= 0:
            raise config_error(f"text_config.{key}", getattr(t, key), "must be a positive integer")
    if t.engram_head_dim % _FORMAT_GROUP != 0:
        raise config_error(
            "text_config.engram_head_dim", t.engram_head_dim, f"must be a multiple of {_FORMAT_GROUP} (row scales)"
        )
    if not t.engram_compressed_vocab_size:
        raise config_error(
            "text_config.engram_compressed_vocab_size",
            t.engram_compressed_vocab_size,
            "must be truthy when Engram is enabled (tokenizer compression is mandatory)",
        )
    if t.hc_mult <= 1:
        raise config_error("text_config.hc_mult", t.hc_mult, "must be > 1 when Engram is enabled")


def _check_dspark(t: TextConfig) -> None:
    _check_layer_ids(
        "text_config.dspark_target_layer_ids", t.dspark_target_layer_ids, t.num_hidden_layers, False, ordered=False
    )
    if t.num_nextn_predict_layers == 0:
        return
    if not t.dspark_target_layer_ids:
        raise config_error(
            "text_config.dspark_target_layer_ids", [], "must be non-empty when num_nextn_predict_layers > 0"
        )
    if not t.dspark_target_attn_input:
        raise config_error("text_config.dspark_target_attn_input", False, "must be true when DSpark targets are used")
    if t.dspark_markov_rank <= 0:
        raise config_error(
            "text_config.dspark_markov_rank", t.dspark_markov_rank, "must be > 0 when DSpark blocks exist"
        )
    if not 0 <= t.dspark_noise_token_id < t.vocab_size:
        raise config_error(
            "text_config.dspark_noise_token_id", t.dspark_noise_token_id, f"must be a token id in [0, {t.vocab_size})"
        )


def _validate(t: TextConfig) -> None:
    """Run every ``text_config`` rule; raises ValueError on the first violation."""
    _check_constants(t)
    _check_dimensions(t)
    _check_compress_ratios(t)
    _check_sharing(t)
    _check_candidates(t)
    _check_engram(t)
    _check_dspark(t)
