"""Roofline accounting shared by the benchmarks: the bytes a decode step must read and the FLOPs of a prefill, from a
model configuration (`deepinfer_model.ModelConfig`). Nothing here runs the model; `roofline.py` measures.

Symbols: `B` requests in a decode step, `C` context (tokens cached before the step; the step's query is at position
`C`), `P` prompt tokens of a prefill, `H` hidden size, `V` vocabulary, `D` head_dim, `n_h` attention heads, `q_r`
q_lora_rank, `G` o_groups, `o_r` o_lora_rank, `m` hc_mult, `mix = (2 + m)·m`, `E` routed experts, `k` experts per
token, `I` moe_intermediate_size, `S·I` shared-expert width, `W` sliding window, `K` index_topk, `n_i`/`d_i` indexer
heads/width, `c` a layer's compress ratio, `klen(t) = ⌊(t + 1)/c⌋` (docs/design/attention.md, "Row visibility").

Weights are counted in their stored formats from the tensor catalogue (`deepinfer_model.loading.catalogue`, the list
a checkpoint holds): FP8 weights with their UE8M0 32×32 block scales, MXFP4 experts (two codes a byte plus 1×32
scales), BF16 and FP32 tensors. Cached rows are counted in their row formats (docs/design/cache.md, "Row byte
layouts"). A decode step is a plain backbone step without drafting: it also projects the drafter's context keys
(docs/design/model.md, "Context keys"), so those weights count; the drafter's other weights do not. Writes (new
window keys, compressed rows) are not counted: the floor is the bytes read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_kernels import RowFormat, bytes_per_row
from deepinfer_model.config import ModelConfig, TextConfig
from deepinfer_model.loading.catalogue import build_catalogue

__all__ = [
    "ROLES",
    "DecodeBytes",
    "WeightBytes",
    "decode_bytes",
    "expected_distinct_experts",
    "prefill_flops",
    "tensor_role",
    "weight_bytes",
]

# What a decode step does with a stored tensor (see `tensor_role`).
ROLES = ("dense", "head", "shared_expert", "drafter_keys", "routed_expert", "embed", "engram_table", "unread")
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.\d+\.")
_DRAFTER_KEYS = re.compile(r"^mtp\.(0\.main_proj\.|0\.main_norm\.|\d+\.attn\.wkv\.|\d+\.attn\.kv_norm\.)")
_UNREAD_GLOBAL = ("image_start", "image_end", "image_newline")


def tensor_role(name: str) -> str:
    """The role of checkpoint tensor `name` (catalogue name, no ``model.`` prefix) in a decode step:

    - ``head``: the LM head, read whole; ``dense``: every other backbone tensor read whole (attention, mHC, norms,
      router, compressor, indexer, Engram projections, the final norm); ``shared_expert``: read whole;
    - ``drafter_keys``: ``mtp.0.main_proj``/``main_norm`` and each DSpark block's ``attn.wkv``/``kv_norm``, read whole
      to write the drafter's context keys;
    - ``routed_expert``: read for the experts the step's tokens chose; ``embed`` and ``engram_table``: read for the
      rows the step looks up;
    - ``unread``: the image-token embeddings, ``gate.bias_vl`` (image tokens), the rest of the drafter, the vision
      tower.
    """
    if name == "head.weight":
        return "head"
    if name == "embed.weight":
        return "embed"
    if name in _UNREAD_GLOBAL or name.startswith(("vision.", "aligner.")) or name.endswith(".gate.bias_vl"):
        return "unread"
    if name.startswith("mtp."):
        return "drafter_keys" if _DRAFTER_KEYS.match(name) else "unread"
    if _EXPERT.match(name):
        return "routed_expert"
    if ".ffn.shared_experts." in name:
        return "shared_expert"
    if ".engram.embed." in name:
        return "engram_table"
    return "dense"


@dataclass(frozen=True)
class WeightBytes:
    """Stored bytes of a checkpoint's tensors by role (`tensor_role`).

    Attributes:
        by_role: bytes of every role in `ROLES` (sum of shape × element size over the role's tensors, scales
            included).
        routed_expert: bytes of ONE routed expert of each backbone layer (``w1``, ``w3``, ``w2`` and their scales:
            ``3·(I·H/2 + I·H/32)``), in layer order.
    """

    by_role: dict[str, int]
    routed_expert: tuple[int, ...]

    @property
    def step_dense(self) -> int:
        """Bytes every decode step reads whole: ``dense + head + shared_expert + drafter_keys``."""
        return sum(self.by_role[role] for role in ("dense", "head", "shared_expert", "drafter_keys"))

    @property
    def total(self) -> int:
        return sum(self.by_role.values())


def weight_bytes(config: ModelConfig) -> WeightBytes:
    """Stored bytes of every catalogue tensor of `config`, by role, and of one routed expert per layer."""
    t = config.text
    roles: Counter[str] = Counter(dict.fromkeys(ROLES, 0))
    experts = [0] * t.num_hidden_layers
    for entry in build_catalogue(config):
        role = tensor_role(entry.name)
        roles[role] += entry.num_bytes
        match = _EXPERT.match(entry.name)
        if match:
            experts[int(match.group(1))] += entry.num_bytes
    return WeightBytes(dict(roles), tuple(total // t.n_routed_experts for total in experts))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts chosen by `tokens` tokens that each pick `top_k` of `num_experts` uniformly at random
    and independently: ``E·(1 − (1 − k/E)^B)`` (an expert is missed by one token with probability ``1 − k/E``)."""
    if not 0 < top_k <= num_experts or tokens < 0:
        raise ValueError(f"need 0 < top_k <= num_experts and tokens >= 0, got {top_k}, {num_experts}, {tokens}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _compressed_format(t: TextConfig) -> RowFormat:
    return RowFormat.FP4_E4M3 if t.use_fp4_sparse_kv else RowFormat.FP8


def _candidate_rows(t: TextConfig, layer: int) -> int | None:
    """The most index-key rows index source `layer` scores for one query: the rows of its candidate blocks when it
    comes after the candidate source (docs/design/attention.md, "Candidate blocks"), else None (every visible row)."""
    spec = t.layers[layer]
    if spec.candidate_source is None or spec.is_candidate_source:
        return None
    assert t.candidate_topk_blocks is not None and t.candidate_block_size is not None
    return t.candidate_topk_blocks * t.candidate_block_size


def cache_bytes_per_request(t: TextConfig, context: int) -> dict[str, int]:
    """Cached bytes one request's decode step at context `context` reads, by kind, summed over backbone layers:

    - ``window``: every layer, its ring rows of positions ``C − W + 1 … C − 1``: ``min(C, W − 1)`` FP8 rows of width
      ``D`` (the step's own key comes fresh);
    - ``compressed``: every C1/C2 layer, the ``min(K, klen(C))`` selected rows of its KV source, FP4 (``e4m3``
      scales) or FP8 rows of width ``D``;
    - ``index_k``: every index source, the index-key rows it scores (``klen(C)``, or its candidate blocks' rows),
      FP4 (UE8M0 scales) rows of width ``d_i``;
    - ``compressor_state``: every C2 KV source, the ``c − 1`` earlier ``(score, latent)`` FP32 pairs of the block the
      step completes (``2·D`` floats each; an upper bound on steps that complete no block).
    """
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    out = dict.fromkeys(("window", "compressed", "index_k", "compressor_state"), 0)
    window_row = bytes_per_row(RowFormat.FP8, t.head_dim)
    for spec in t.layers[: t.num_hidden_layers]:
        out["window"] += min(context, t.sliding_window - 1) * window_row
        if not spec.is_compressed:
            continue
        klen = (context + 1) // spec.compress_ratio
        out["compressed"] += min(t.index_topk, klen) * bytes_per_row(_compressed_format(t), t.head_dim)
        if spec.owns_indexer:
            cap = _candidate_rows(t, spec.layer_id)
            scored = klen if cap is None else min(klen, cap)
            out["index_k"] += scored * bytes_per_row(RowFormat.FP4_UE8M0, t.index_head_dim)
        if spec.owns_compressor_gate:
            out["compressor_state"] += (spec.compress_ratio - 1) * bytes_per_row(RowFormat.RAW_FP32, 2 * t.head_dim)
    return out


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step of `batch` requests at context `context` must read (`decode_bytes`), by part."""

    batch: int
    context: int
    step_dense: int
    routed_experts: int
    distinct_experts: tuple[float, ...]
    embed_rows: int
    engram_rows: int
    cache: dict[str, int]

    @property
    def total(self) -> int:
        return self.step_dense + self.routed_experts + self.embed_rows + self.engram_rows + sum(self.cache.values())


def decode_bytes(
    config: ModelConfig, batch: int, context: int, distinct_experts: Sequence[float] | None = None
) -> DecodeBytes:
    """The bytes a decode step of `batch` requests, each at context `context`, must read:

    - ``step_dense``: `WeightBytes.step_dense` (every backbone tensor but the routed experts, the LM head, the
      drafter's context-key weights);
    - ``routed_experts``: ``Σ_ℓ n_ℓ · expert_bytes_ℓ``, ``n_ℓ`` the distinct experts layer ℓ's tokens chose:
      `distinct_experts` (one count per backbone layer, e.g. measured from the routing) or, when None, the
      expectation of uniform routing, `expected_distinct_experts`;
    - ``embed_rows``: ``B·H·2`` (one BF16 embedding row per token);
    - ``engram_rows``: per Engram layer ``B·(N_g − 1)·h_e`` looked-up rows of ``d_e`` FP8 bytes plus ``d_e/32``
      scales (docs/design/model.md, "Engram lookup and gate");
    - ``cache``: ``B ×`` `cache_bytes_per_request`.
    """
    t = config.text
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    weights = weight_bytes(config)
    if distinct_experts is None:
        distinct_experts = [expected_distinct_experts(t.n_routed_experts, t.num_experts_per_tok, batch)] * len(
            weights.routed_expert
        )
    if len(distinct_experts) != t.num_hidden_layers:
        raise ValueError(
            f"distinct_experts needs one count per backbone layer ({t.num_hidden_layers}), got {len(distinct_experts)}"
        )
    routed = sum(n * per for n, per in zip(distinct_experts, weights.routed_expert, strict=True))
    engram = 0
    if t.engram_enabled:
        assert t.engram_max_ngram_size is not None and t.engram_n_heads is not None and t.engram_head_dim is not None
        rows = (t.engram_max_ngram_size - 1) * t.engram_n_heads
        engram = len(t.engram_layer_ids) * batch * rows * (t.engram_head_dim + t.engram_head_dim // 32)
    cache = {kind: batch * value for kind, value in cache_bytes_per_request(t, context).items()}
    return DecodeBytes(
        batch=batch,
        context=context,
        step_dense=weights.step_dense,
        routed_experts=round(routed),
        distinct_experts=tuple(distinct_experts),
        embed_rows=batch * t.hidden_size * 2,
        engram_rows=engram,
        cache=cache,
    )


def gemm_params_per_token(t: TextConfig, layer: int) -> int:
    """Weights (logical ``out × in`` elements) one token multiplies in backbone layer `layer`:

    attention ``q_r·H + n_h·D·q_r + D·H + (G·o_r)·(n_h/G·D) + H·G·o_r``; mHC mix logits ``2·mix·m·H``; router ``E·H``;
    shared expert ``3·S·I·H``; routed experts ``k·3·I·H``; Engram ``(m + 1)·H·(N_g − 1)·h_e·d_e`` on Engram layers;
    compressor ``D·H`` (twice on a C2 KV source: ``wkv`` and ``wgate``); indexer ``n_i·d_i·q_r + n_i·H`` on index
    sources. Index keys are per compressed row, not per token (`prefill_flops`).
    """
    spec = t.layers[layer]
    h, d, heads = t.hidden_size, t.head_dim, t.num_attention_heads
    params = t.q_lora_rank * h + heads * d * t.q_lora_rank + d * h
    params += t.o_groups * t.o_lora_rank * (heads // t.o_groups) * d + h * t.o_groups * t.o_lora_rank
    params += 2 * t.hc_mix_size * t.hc_norm_group_size + t.n_routed_experts * h
    params += 3 * t.shared_intermediate_size * h + t.num_experts_per_tok * 3 * t.moe_intermediate_size * h
    if spec.has_engram:
        params += (t.hc_mult + 1) * h * t.engram_input_width
    if spec.owns_compressor:
        params += d * h * (2 if spec.owns_compressor_gate else 1)
    if spec.owns_indexer:
        params += t.index_n_heads * t.index_head_dim * t.q_lora_rank + t.index_n_heads * h
    return params


def _sum_min(prompt: int, cap: int | None, ratio: int) -> int:
    """``Σ_{t=0}^{P−1} min(cap, ⌊(t + 1)/ratio⌋)`` (no cap when None)."""
    if cap is None:
        return sum((t + 1) // ratio for t in range(prompt))
    return sum(min(cap, (t + 1) // ratio) for t in range(prompt))


def prefill_flops(config: ModelConfig, prompt: int) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of a prefill of one `prompt`-token request from position 0, logits of its last
    token only, no YOCO truncation, by part:

    - ``gemm``: ``2·P·Σ_ℓ gemm_params_per_token(ℓ)``, plus index keys ``2·⌊P/c⌋·d_i·D`` per index-K source, plus the
      drafter's context keys ``2·P·(n_t·H·H + N_mtp·D·H)`` (``main_proj``, each DSpark ``wkv``);
    - ``head``: ``2·V·H`` (one logits row);
    - ``attention``: per layer ``Σ_t 4·n_h·D·keys(t)`` (scores and weighted sum), ``keys(t) = min(t + 1, W)`` plus
      ``min(K, klen(t))`` selected rows on C1/C2 layers;
    - ``indexer``: per index source ``Σ_t 2·n_i·d_i·scored(t)``, ``scored(t)`` = ``klen(t)`` or its candidate blocks'
      rows.
    """
    t = config.text
    if prompt < 1:
        raise ValueError(f"prompt must be >= 1, got {prompt}")
    h, d = t.hidden_size, t.head_dim
    gemm = 2 * prompt * sum(gemm_params_per_token(t, layer) for layer in range(t.num_hidden_layers))
    window_keys = _sum_min(prompt, t.sliding_window, 1)
    attention = indexer = 0
    for spec in t.layers[: t.num_hidden_layers]:
        keys = window_keys
        if spec.is_compressed:
            keys += _sum_min(prompt, t.index_topk, spec.compress_ratio)
            if spec.owns_index_k:
                gemm += 2 * (prompt // spec.compress_ratio) * t.index_head_dim * d
            if spec.owns_indexer:
                scored = _sum_min(prompt, _candidate_rows(t, spec.layer_id), spec.compress_ratio)
                indexer += 2 * t.index_n_heads * t.index_head_dim * scored
        attention += 4 * t.num_attention_heads * d * keys
    if t.num_nextn_predict_layers:
        gemm += 2 * prompt * (t.dspark_num_targets * h * h + t.num_nextn_predict_layers * d * h)
    return {"gemm": gemm, "head": 2 * t.vocab_size * h, "attention": attention, "indexer": indexer}
