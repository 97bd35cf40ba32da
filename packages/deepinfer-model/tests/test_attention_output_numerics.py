"""Exact mode rounds the attention output per head count (docs/design/numerics.md, "Attention output rounding"):
with 64 or 128 heads the fused kernel of the reference release FP8-quantizes it for ``wo_a`` straight from FP32; any
other head count leaves the sparse-attention kernel as BF16, and de-rotation and the FP8 quantization read BF16.

The layered model and the single-file reference must both follow this and agree with each other for both kinds.
"""

from __future__ import annotations

import json

import pytest
import torch
from _layered_model_support import prompt, random_weights, tiny_config, tiny_vocab, tiny_weights

from deepinfer_model import reference as ref
from deepinfer_model import reference_attention, reference_blocks
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode


def _config(heads: int) -> ModelConfig:
    data = json.loads(preset_json("tiny"))
    data["text_config"]["num_attention_heads"] = heads
    return ModelConfig.from_dict(data)


@pytest.mark.parametrize(("heads", "dtype"), [(8, torch.bfloat16), (64, torch.float32)])
def test_layered_attention_output_reaches_wo_a_as_bf16_unless_64_or_128_heads(heads: int, dtype: torch.dtype) -> None:
    config = _config(heads)
    weights = random_weights(config, seed=4)
    ids = prompt(20, seed=6)
    model = DeepseekV41ForCausalLM(config, ComputeMode.EXACT, tiny_vocab())
    model.load_weights(weights.items())
    seen: list[torch.dtype] = []
    for block in model.layers:
        block.attn.wo_a.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    state = model.allocate_state(block_size=8, num_blocks=3, num_state_slots=1)
    table = torch.arange(3, dtype=torch.int32)[None, :]
    with torch.no_grad():
        logits = model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state)
    assert seen == [dtype] * len(model.layers)
    # The oracle takes the same path (20 tokens stay clear of a rounding flip; observed: bitwise equal, while the
    # other head-count rule on one side differs by 0.3-0.6 of the largest logit).
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    expected = ref.reference_forward(config, weights, ids, vocabulary, precision="exact")
    assert (logits - expected).abs().max() <= 1e-3 * expected.abs().max()


def test_reference_output_projection_reads_bf16_for_8_heads() -> None:
    """For the tiny preset's 8 heads, an attention output already on the BF16 grid gives the same projection as the
    unrounded one; FP8-quantizing from FP32 would not (about 1 element in 60 rounds differently)."""
    text = tiny_config().text
    generator = torch.Generator().manual_seed(8)
    out = torch.randn(16, text.num_attention_heads, text.head_dim, generator=generator)
    table = reference_blocks._layer_rope_table(text, False, 16)
    weights, numerics = reference_blocks._Weights(tiny_weights()), ref._numerics("exact")

    def project(o: torch.Tensor) -> torch.Tensor:
        return reference_attention._attention_output(text, weights, numerics, "layers.0.attn", o, table.cos, table.sin)

    assert torch.equal(project(out), project(out.bfloat16().float()))
