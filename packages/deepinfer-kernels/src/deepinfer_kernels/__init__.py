"""deepinfer-kernels: device ops for DeepSeek-V4.1-Flash inference.

Every op is a public wrapper (validation, output allocation) → the registry → one implementation:
the PyTorch reference (always present, the numerical truth), Triton on NVIDIA, or torch_npu on Ascend.
The backend is chosen once per op from ``DEEPINFER_ACCELERATOR`` (see ``deepinfer_kernels.platform``).
Importing this package touches neither the device nor the environment.
"""

from deepinfer_kernels.activation import swiglu_clamped, swiglu_clamped_fp8
from deepinfer_kernels.attention import KeySource, sparse_attention
from deepinfer_kernels.combine import moe_combine
from deepinfer_kernels.engram import engram_gate, engram_lookup, engram_ngram_rows
from deepinfer_kernels.gemm import (
    bf16_gemm,
    dequantized_gemm,
    fp8_block_gemm,
    fp8_block_gemm_quantized,
    fp8_block_grouped_gemm,
    mxfp4_gemm,
    rotated_fp8_block_grouped_gemm,
)
from deepinfer_kernels.grouped_gemm import (
    CodeOrder,
    ExpertRows,
    GroupCodes,
    dequantized_grouped_gemm,
    mxfp4_grouped_code_order,
    mxfp4_grouped_gemm,
)
from deepinfer_kernels.hyper_connection import hc_mix_logits, hc_mixes, hc_post, hc_read
from deepinfer_kernels.indexer import indexer_select
from deepinfer_kernels.kv_cache import store_rows
from deepinfer_kernels.norm import rms_norm, rms_norm_fp8
from deepinfer_kernels.paging import paged_rows, position_sources, uniform_compressed_rows, window_key_rows
from deepinfer_kernels.platform import Accelerator, current_accelerator
from deepinfer_kernels.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    dequantize_mxfp4,
    quantize_fp8_block,
    quantize_fp8_per_token_group,
    quantize_mxfp4,
    ue8m0_to_float,
)
from deepinfer_kernels.rope import (
    apply_rope,
    apply_rope_,
    rope_cos_sin,
    rope_inverse_frequencies,
    rope_table,
    yarn_inverse_frequencies,
)
from deepinfer_kernels.routing import router_topk
from deepinfer_kernels.row_formats import RowFormat, bytes_per_row, decode_rows, encode_rows

__all__ = [
    "Accelerator",
    "CodeOrder",
    "ExpertRows",
    "GroupCodes",
    "KeySource",
    "RowFormat",
    "apply_rope",
    "apply_rope_",
    "bf16_gemm",
    "bytes_per_row",
    "current_accelerator",
    "decode_rows",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "dequantize_mxfp4",
    "dequantized_gemm",
    "dequantized_grouped_gemm",
    "encode_rows",
    "engram_gate",
    "engram_lookup",
    "engram_ngram_rows",
    "fp8_block_gemm",
    "fp8_block_gemm_quantized",
    "fp8_block_grouped_gemm",
    "hc_mix_logits",
    "hc_mixes",
    "hc_post",
    "hc_read",
    "indexer_select",
    "moe_combine",
    "mxfp4_gemm",
    "mxfp4_grouped_code_order",
    "mxfp4_grouped_gemm",
    "paged_rows",
    "position_sources",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_mxfp4",
    "rms_norm",
    "rms_norm_fp8",
    "rope_cos_sin",
    "rope_inverse_frequencies",
    "rope_table",
    "rotated_fp8_block_grouped_gemm",
    "router_topk",
    "sparse_attention",
    "store_rows",
    "swiglu_clamped",
    "swiglu_clamped_fp8",
    "ue8m0_to_float",
    "uniform_compressed_rows",
    "window_key_rows",
    "yarn_inverse_frequencies",
]
