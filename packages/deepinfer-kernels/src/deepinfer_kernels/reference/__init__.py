"""Plain-PyTorch implementation of every op: runs on any device and defines the numerical truth."""

from __future__ import annotations

from deepinfer_kernels._registry import Backend, OpRegistry
from deepinfer_kernels.reference import (
    activation,
    attention,
    combine,
    engram,
    gemm,
    grouped_gemm,
    hyper_connection,
    indexer,
    matmul,
    norm,
    paging,
    quant,
    rope,
    routing,
    row_formats,
)

__all__ = ["register"]


def register(registry: OpRegistry) -> None:
    """Register the reference implementation of every op."""
    ref = Backend.REFERENCE
    registry.register("rms_norm", ref, norm.rms_norm)
    registry.register("rms_norm_fp8", ref, norm.rms_norm_fp8)
    registry.register("apply_rope", ref, rope.apply_rope)
    registry.register("rope_table", ref, rope.rope_table)
    registry.register("ue8m0_to_float", ref, quant.ue8m0_to_float)
    registry.register("quantize_fp8_block", ref, quant.quantize_fp8_block)
    registry.register("dequantize_fp8_block", ref, quant.dequantize_fp8_block)
    registry.register("quantize_fp8_per_token_group", ref, quant.quantize_fp8_per_token_group)
    registry.register("dequantize_fp8_per_token_group", ref, quant.dequantize_fp8_per_token_group)
    registry.register("quantize_mxfp4", ref, quant.quantize_mxfp4)
    registry.register("dequantize_mxfp4", ref, quant.dequantize_mxfp4)
    registry.register("bf16_gemm", ref, gemm.bf16_gemm)
    registry.register("fp8_block_gemm", ref, gemm.fp8_block_gemm)
    registry.register("mxfp4_gemm", ref, gemm.mxfp4_gemm)
    registry.register("fp8_block_grouped_gemm", ref, gemm.fp8_block_grouped_gemm)
    registry.register("rotated_fp8_block_grouped_gemm", ref, gemm.rotated_fp8_block_grouped_gemm)
    registry.register("fp8_block_gemm_quantized", ref, gemm.fp8_block_gemm_quantized)
    registry.register("mxfp4_grouped_gemm", ref, grouped_gemm.mxfp4_grouped_gemm)
    registry.register("mxfp4_grouped_code_order", ref, grouped_gemm.mxfp4_grouped_code_order)
    registry.register("dequantized_gemm", ref, gemm.dequantized_gemm)
    registry.register("dequantized_grouped_gemm", ref, grouped_gemm.dequantized_grouped_gemm)
    registry.register("invariant_matmul", ref, matmul.invariant_matmul)
    registry.register("encode_rows", ref, row_formats.encode_rows)
    registry.register("decode_rows", ref, row_formats.decode_rows)
    registry.register("store_rows", ref, row_formats.store_rows)
    registry.register("sparse_attention", ref, attention.sparse_attention)
    registry.register("indexer_select", ref, indexer.indexer_select)
    registry.register("hc_mix_logits", ref, hyper_connection.hc_mix_logits)
    registry.register("hc_mixes", ref, hyper_connection.hc_mixes)
    registry.register("hc_read", ref, hyper_connection.hc_read)
    registry.register("hc_post", ref, hyper_connection.hc_post)
    registry.register("swiglu_clamped", ref, activation.swiglu_clamped)
    registry.register("swiglu_clamped_fp8", ref, activation.swiglu_clamped_fp8)
    registry.register("router_topk", ref, routing.router_topk)
    registry.register("engram_gate", ref, engram.engram_gate)
    registry.register("engram_lookup", ref, engram.engram_lookup)
    registry.register("engram_ngram_rows", ref, engram.engram_ngram_rows)
    registry.register("moe_combine", ref, combine.moe_combine)
    registry.register("paged_rows", ref, paging.paged_rows)
    registry.register("window_key_rows", ref, paging.window_key_rows)
    registry.register("uniform_compressed_rows", ref, paging.uniform_compressed_rows)
    registry.register("position_sources", ref, paging.position_sources)
