"""The tensor catalogue: every checkpoint tensor (HF name, shape, safetensors dtype) a configuration implies.

Owns the tensor list of a checkpoint (global, per-block, conditional attention, Engram, DSpark and vision tensors)
together with their number formats (docs/design/numerics.md, "Weight formats"). The loader checks a checkpoint against
this list; the writer produces exactly this list.
Entries are ordered: global tensors, backbone blocks ``layers.0 …``, DSpark blocks ``mtp.0 …``, then the vision tower
and projector (only when the configuration has a ``vision_config``). An FP8 or MXFP4 weight is directly followed by its
UE8M0 ``.scale`` companion.

Glossary:
    format: how a tensor's bytes are to be read: BF16, F32, FP8 with 32×32 block scales, FP8 with per-row 1×32 scales
        (Engram tables), MXFP4 (two e2m1 codes per byte, 1×32 scales) or a UE8M0 scale.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer_model.config import VIT_WIDTH, ModelConfig, TextConfig

# Stored element size of every accepted safetensors header dtype.
DTYPE_BYTES: dict[str, int] = {
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}
BLOCK = 32  # FP8 weight block edge and every scale group width (docs/design/numerics.md, "Number formats")
VIT_PATCH_INPUT = 14 * 14 * 3  # flattened RGB patch (docs/design/model.md, "Vision tensors")
VIT_DEPTH = 32
VIT_MLP_HIDDEN = 2816


class TensorFormat(enum.Enum):
    """Storage format of one catalogue entry (docs/design/numerics.md, "Weight formats")."""

    BF16 = "bf16"
    F32 = "f32"
    FP8_BLOCK = "fp8_block"  # e4m3 weight, scale [⌈out/32⌉, ⌈in/32⌉]
    FP8_ROW = "fp8_row"  # e4m3 Engram table, scale [rows, cols/32]
    MXFP4 = "mxfp4"  # I8 bytes [out, in/2], low nibble = even column; scale [out, in/32]
    SCALE = "scale"  # F8_E8M0 companion of the preceding weight


_FORMAT_DTYPE = {
    TensorFormat.BF16: "BF16",
    TensorFormat.F32: "F32",
    TensorFormat.FP8_BLOCK: "F8_E4M3",
    TensorFormat.FP8_ROW: "F8_E4M3",
    TensorFormat.MXFP4: "I8",
    TensorFormat.SCALE: "F8_E8M0",
}


@dataclass(frozen=True)
class CatalogueEntry:
    """One checkpoint tensor.

    Attributes:
        name: HF tensor name without the ``model.`` prefix.
        shape: stored shape (packed bytes for MXFP4).
        format: storage format; ``dtype`` follows from it.
        logical_shape: the unpacked ``[out, in]`` weight shape for FP8/MXFP4 weights, else equal to ``shape``.
    """

    name: str
    shape: tuple[int, ...]
    format: TensorFormat
    logical_shape: tuple[int, ...]

    @property
    def dtype(self) -> str:
        """Safetensors dtype string (``BF16``, ``F32``, ``F8_E4M3``, ``F8_E8M0``, ``I8``)."""
        return _FORMAT_DTYPE[self.format]

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def num_bytes(self) -> int:
        return self.num_elements * DTYPE_BYTES[self.dtype]

    @property
    def num_parameters(self) -> int:
        """Logical weights held (0 for scales; two per byte for MXFP4)."""
        return 0 if self.format is TensorFormat.SCALE else math.prod(self.logical_shape)


def _plain(name: str, shape: Iterable[int], fmt: TensorFormat) -> CatalogueEntry:
    dims = tuple(shape)
    return CatalogueEntry(name, dims, fmt, dims)


def _fp8_block(stem: str, out_dim: int, in_dim: int) -> list[CatalogueEntry]:
    scale = (math.ceil(out_dim / BLOCK), math.ceil(in_dim / BLOCK))
    return [
        CatalogueEntry(f"{stem}.weight", (out_dim, in_dim), TensorFormat.FP8_BLOCK, (out_dim, in_dim)),
        CatalogueEntry(f"{stem}.scale", scale, TensorFormat.SCALE, scale),
    ]


def _mxfp4(stem: str, out_dim: int, in_dim: int) -> list[CatalogueEntry]:
    scale = (out_dim, in_dim // BLOCK)
    return [
        CatalogueEntry(f"{stem}.weight", (out_dim, in_dim // 2), TensorFormat.MXFP4, (out_dim, in_dim)),
        CatalogueEntry(f"{stem}.scale", scale, TensorFormat.SCALE, scale),
    ]


def _hc_head(prefix: str, t: TextConfig) -> list[CatalogueEntry]:
    m = t.hc_mult
    return [
        _plain(f"{prefix}hc_head_base", (m,), TensorFormat.F32),
        _plain(f"{prefix}hc_head_fn", (m, t.hc_norm_group_size), TensorFormat.F32),
        _plain(f"{prefix}hc_head_scale", (1,), TensorFormat.F32),
    ]


def _decoder_block(prefix: str, t: TextConfig, num_experts: int) -> list[CatalogueEntry]:
    """Tensors every backbone and DSpark block has (docs/design/model.md, "Layer stack and runtime layer ids")."""
    h, mix = t.hidden_size, t.hc_mix_size
    heads, d, q_r = t.num_attention_heads, t.head_dim, t.q_lora_rank
    out: list[CatalogueEntry] = []
    for side in ("attn", "ffn"):
        out += [
            _plain(f"{prefix}hc_{side}_base", (mix,), TensorFormat.F32),
            _plain(f"{prefix}hc_{side}_fn", (mix, t.hc_norm_group_size), TensorFormat.F32),
            _plain(f"{prefix}hc_{side}_scale", (3,), TensorFormat.F32),
        ]
    out += [
        _plain(f"{prefix}attn_norm.weight", (h,), TensorFormat.BF16),
        _plain(f"{prefix}ffn_norm.weight", (h,), TensorFormat.BF16),
        _plain(f"{prefix}attn.attn_sink", (heads,), TensorFormat.F32),
        *_fp8_block(f"{prefix}attn.wq_a", q_r, h),
        _plain(f"{prefix}attn.q_norm.weight", (q_r,), TensorFormat.BF16),
        *_fp8_block(f"{prefix}attn.wq_b", heads * d, q_r),
        *_fp8_block(f"{prefix}attn.wkv", d, h),
        _plain(f"{prefix}attn.kv_norm.weight", (d,), TensorFormat.BF16),
        *_fp8_block(f"{prefix}attn.wo_a", t.o_groups * t.o_lora_rank, (heads // t.o_groups) * d),
        *_fp8_block(f"{prefix}attn.wo_b", h, t.o_groups * t.o_lora_rank),
        _plain(f"{prefix}ffn.gate.weight", (num_experts, h), TensorFormat.BF16),
        _plain(f"{prefix}ffn.gate.bias", (num_experts,), TensorFormat.F32),
        _plain(f"{prefix}ffn.gate.bias_vl", (num_experts,), TensorFormat.F32),
    ]
    shared = t.shared_intermediate_size
    if shared > 0:
        out += _fp8_block(f"{prefix}ffn.shared_experts.w1", shared, h)
        out += _fp8_block(f"{prefix}ffn.shared_experts.w3", shared, h)
        out += _fp8_block(f"{prefix}ffn.shared_experts.w2", h, shared)
    inter = t.moe_intermediate_size
    for e in range(num_experts):
        out += _mxfp4(f"{prefix}ffn.experts.{e}.w1", inter, h)
        out += _mxfp4(f"{prefix}ffn.experts.{e}.w3", inter, h)
        out += _mxfp4(f"{prefix}ffn.experts.{e}.w2", h, inter)
    return out


def _backbone_extras(layer: int, t: TextConfig) -> list[CatalogueEntry]:
    """Conditional attention tensors (docs/design/model.md, "Layer roles") and Engram tensors
    (docs/design/model.md, "Engram") of backbone layer ``layer``."""
    prefix = f"layers.{layer}."
    spec = t.layers[layer]
    h, d = t.hidden_size, t.head_dim
    out: list[CatalogueEntry] = []
    if spec.owns_compressor:
        out.append(_plain(f"{prefix}attn.compressor.wkv.weight", (d, h), TensorFormat.BF16))
        if spec.owns_compressor_gate:
            out.append(_plain(f"{prefix}attn.compressor.wgate.weight", (d, h), TensorFormat.BF16))
        out.append(_plain(f"{prefix}attn.compressor.norm.weight", (d,), TensorFormat.BF16))
    if spec.owns_indexer:
        out += _fp8_block(f"{prefix}attn.indexer.wq_b", t.index_n_heads * t.index_head_dim, t.q_lora_rank)
        out.append(_plain(f"{prefix}attn.indexer.weights_proj.weight", (t.index_n_heads, h), TensorFormat.BF16))
    if spec.owns_index_k:
        out.append(_plain(f"{prefix}attn.indexer.wk.weight", (t.index_head_dim, d), TensorFormat.BF16))
        out.append(_plain(f"{prefix}attn.indexer.k_norm.weight", (t.index_head_dim,), TensorFormat.BF16))
    if spec.has_engram:
        assert t.engram_head_dim is not None
        rows, width = t.engram_num_rows(layer), t.engram_head_dim
        row_scale = (rows, width // BLOCK)
        out += [
            CatalogueEntry(f"{prefix}engram.embed.weight", (rows, width), TensorFormat.FP8_ROW, (rows, width)),
            CatalogueEntry(f"{prefix}engram.embed.scale", row_scale, TensorFormat.SCALE, row_scale),
            *_fp8_block(f"{prefix}engram.wkv", (t.hc_mult + 1) * h, t.engram_input_width),
            _plain(f"{prefix}engram.q_weight", (t.hc_mult, h), TensorFormat.BF16),
            _plain(f"{prefix}engram.k_weight", (t.hc_mult, h), TensorFormat.BF16),
        ]
    return out


def _dspark_extras(index: int, t: TextConfig) -> list[CatalogueEntry]:
    """DSpark-only tensors of block ``mtp.{index}`` (docs/design/model.md, "DSpark blocks")."""
    prefix = f"mtp.{index}."
    h, v, rank = t.hidden_size, t.vocab_size, t.dspark_markov_rank
    out: list[CatalogueEntry] = []
    if index == 0:
        out += _fp8_block(f"{prefix}main_proj", h, t.dspark_num_targets * h)
        out.append(_plain(f"{prefix}main_norm.weight", (h,), TensorFormat.BF16))
    if index == t.num_nextn_predict_layers - 1:
        out += [
            _plain(f"{prefix}norm.weight", (h,), TensorFormat.BF16),
            _plain(f"{prefix}markov_head.embed.weight", (v, rank), TensorFormat.BF16),
            _plain(f"{prefix}markov_head.head.weight", (v, rank), TensorFormat.BF16),
            _plain(f"{prefix}confidence_head.proj.weight", (1, h + rank), TensorFormat.BF16),
        ]
        if not t.hc_shifted:
            out += _hc_head(prefix, t)
    return out


def _vision(config: ModelConfig) -> list[CatalogueEntry]:
    """Vision tower and projector (docs/design/model.md, "Vision tensors"); the tower is fixed, the projector follows
    ``H`` and ``downsample_ratio``."""
    assert config.vision is not None
    h, w, ratio = config.text.hidden_size, VIT_WIDTH, config.vision.downsample_ratio
    bf16 = TensorFormat.BF16
    out = [
        _plain("vision.patch_embed.proj.weight", (w, VIT_PATCH_INPUT), bf16),
        _plain("vision.patch_embed.proj.bias", (w,), bf16),
    ]
    for b in range(VIT_DEPTH):
        p = f"vision.blocks.{b}."
        out += [
            _plain(f"{p}norm1.weight", (w,), bf16),
            _plain(f"{p}norm2.weight", (w,), bf16),
            _plain(f"{p}attn.wqkv.weight", (3 * w, w), bf16),
            _plain(f"{p}attn.wqkv.bias", (3 * w,), bf16),
            _plain(f"{p}attn.wo.weight", (w, w), bf16),
            _plain(f"{p}attn.wo.bias", (w,), bf16),
            _plain(f"{p}mlp.w1.weight", (2 * VIT_MLP_HIDDEN, w), bf16),
            _plain(f"{p}mlp.w2.weight", (w, VIT_MLP_HIDDEN), bf16),
        ]
    out += [
        _plain("vision.norm.weight", (w,), bf16),
        _plain("aligner.w1.weight", (h, w * ratio * ratio), bf16),
        _plain("aligner.w1.bias", (h,), bf16),
        _plain("aligner.w2.weight", (h, h), bf16),
        _plain("aligner.w2.bias", (h,), bf16),
    ]
    return out


def build_catalogue(config: ModelConfig) -> tuple[CatalogueEntry, ...]:
    """Every tensor a checkpoint of ``config`` holds, in writing order (see the module docstring)."""
    t = config.text
    h, v = t.hidden_size, t.vocab_size
    out = [
        _plain("embed.weight", (v, h), TensorFormat.BF16),
        _plain("head.weight", (v, h), TensorFormat.BF16),
        _plain("norm.weight", (h,), TensorFormat.BF16),
        _plain("image_start", (h,), TensorFormat.BF16),
        _plain("image_end", (h,), TensorFormat.BF16),
        _plain("image_newline", (h,), TensorFormat.BF16),
    ]
    if not t.hc_shifted:
        out += _hc_head("", t)
    for layer in range(t.num_hidden_layers):
        out += _decoder_block(f"layers.{layer}.", t, t.n_routed_experts)
        out += _backbone_extras(layer, t)
    for index in range(t.num_nextn_predict_layers):
        out += _decoder_block(f"mtp.{index}.", t, t.dspark_n_routed_experts)
        out += _dspark_extras(index, t)
    if config.vision is not None:
        out += _vision(config)
    return tuple(out)


@dataclass(frozen=True)
class CatalogueSummary:
    """Totals of a catalogue: tensors and bytes per dtype, logical parameters per format."""

    num_tensors: int
    num_bytes: int
    tensors_by_dtype: dict[str, int]
    bytes_by_dtype: dict[str, int]
    parameters_by_format: dict[str, int]


def summarize(entries: Iterable[CatalogueEntry]) -> CatalogueSummary:
    tensors: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    params: Counter[str] = Counter()
    for entry in entries:
        tensors[entry.dtype] += 1
        nbytes[entry.dtype] += entry.num_bytes
        params[entry.format.value] += entry.num_parameters
    return CatalogueSummary(
        num_tensors=sum(tensors.values()),
        num_bytes=sum(nbytes.values()),
        tensors_by_dtype=dict(tensors),
        bytes_by_dtype=dict(nbytes),
        parameters_by_format={k: v for k, v in params.items() if v},
    )
