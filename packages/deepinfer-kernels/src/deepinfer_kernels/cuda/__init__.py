"""NVIDIA backend: arch-neutral Triton kernels (also runnable on CPU tensors under ``TRITON_INTERPRET=1``).

Imported only when the nvidia backend is selected, so importing ``deepinfer_kernels`` never imports Triton.
"""

from __future__ import annotations

from deepinfer_kernels._registry import Backend, OpRegistry
from deepinfer_kernels.cuda import (
    activation,
    attention,
    bf16_gemm,
    combine,
    engram,
    fp8_gemm_ops,
    gemm,
    grouped_gemm,
    hyper_connection,
    indexer,
    invariant_matmul,
    norm,
    paging,
    quant,
    rope,
    routing,
    row_formats,
)

__all__ = ["register"]


def register(registry: OpRegistry) -> None:
    """Register the Triton implementations (ue8m0_to_float and hc_mix_logits fall back to the reference)."""
    nvidia = Backend.NVIDIA
    registry.register("rms_norm", nvidia, norm.rms_norm)
    registry.register("rms_norm_fp8", nvidia, norm.rms_norm_fp8)
    registry.register("apply_rope", nvidia, rope.apply_rope)
    registry.register("rope_table", nvidia, rope.rope_table)
    registry.register("quantize_fp8_block", nvidia, quant.quantize_fp8_block)
    registry.register("dequantize_fp8_block", nvidia, quant.dequantize_fp8_block)
    registry.register("quantize_fp8_per_token_group", nvidia, quant.quantize_fp8_per_token_group)
    registry.register("dequantize_fp8_per_token_group", nvidia, quant.dequantize_fp8_per_token_group)
    registry.register("quantize_mxfp4", nvidia, quant.quantize_mxfp4)
    registry.register("dequantize_mxfp4", nvidia, quant.dequantize_mxfp4)
    registry.register("bf16_gemm", nvidia, bf16_gemm.bf16_gemm)
    registry.register("fp8_block_gemm", nvidia, gemm.fp8_block_gemm)
    registry.register("mxfp4_gemm", nvidia, gemm.mxfp4_gemm)
    registry.register("fp8_block_grouped_gemm", nvidia, fp8_gemm_ops.fp8_block_grouped_gemm)
    registry.register("rotated_fp8_block_grouped_gemm", nvidia, fp8_gemm_ops.rotated_fp8_block_grouped_gemm)
    registry.register("fp8_block_gemm_quantized", nvidia, fp8_gemm_ops.fp8_block_gemm_quantized)
    registry.register("mxfp4_grouped_gemm", nvidia, grouped_gemm.mxfp4_grouped_gemm)
    registry.register("mxfp4_grouped_code_order", nvidia, grouped_gemm.mxfp4_grouped_code_order)
    registry.register("encode_rows", nvidia, row_formats.encode_rows)
    registry.register("decode_rows", nvidia, row_formats.decode_rows)
    registry.register("store_rows", nvidia, row_formats.store_rows)
    registry.register("sparse_attention", nvidia, attention.sparse_attention)
    registry.register("indexer_select", nvidia, indexer.indexer_select)
    registry.register("hc_mixes", nvidia, hyper_connection.hc_mixes)
    registry.register("hc_read", nvidia, hyper_connection.hc_read)
    registry.register("hc_post", nvidia, hyper_connection.hc_post)
    registry.register("swiglu_clamped", nvidia, activation.swiglu_clamped)
    registry.register("swiglu_clamped_fp8", nvidia, activation.swiglu_clamped_fp8)
    registry.register("router_topk", nvidia, routing.router_topk)
    registry.register("engram_gate", nvidia, engram.engram_gate)
    registry.register("engram_lookup", nvidia, engram.engram_lookup)
    registry.register("engram_ngram_rows", nvidia, engram.engram_ngram_rows)
    registry.register("moe_combine", nvidia, combine.moe_combine)
    registry.register("paged_rows", nvidia, paging.paged_rows)
    registry.register("window_key_rows", nvidia, paging.window_key_rows)
    registry.register("uniform_compressed_rows", nvidia, paging.uniform_compressed_rows)
    registry.register("position_sources", nvidia, paging.position_sources)
    registry.register("invariant_matmul", nvidia, invariant_matmul.invariant_matmul)
