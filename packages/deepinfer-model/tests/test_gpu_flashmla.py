"""The model with FlashMLA's sparse prefill (``flashmla``; docs/design/kernels.md, "FlashMLA sparse prefill") on an
SM90 GPU with ``flash_mla`` importable: a prompt-sized prefill runs every attention call of the kernel's shape on
FlashMLA, each on the model's own key sources (the window ring and fresh keys, the compressed pool), and each
call's output meets the kernel test's bound against the reference on the same inputs.

The calls are compared one by one, on their own inputs, rather than the logits: past the first layer the two runs'
inputs differ, and a random tiny model turns a BF16 step in one attention output into expert choices that differ.
Tolerance: max |out − ref| ≤ 2^−7 · max |ref| on a call's first and last 64 queries (FlashMLA rounds probabilities
against a running maximum and writes BF16).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from _layered_model_support import random_weights, tiny_vocab

from deepinfer_kernels.testing import FlashMLACalls, watch_flashmla
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

flashmla = pytest.importorskip("deepinfer_kernels.cuda.flashmla")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashmla.available(), reason="needs an SM90 GPU with flash_mla (the sgl-flash-mla wheel)"),
]

BLOCK = 16
PROMPT = flashmla.MIN_QUERIES + 77
CHECK = 64  # queries compared with the reference at each end of a call


def _wide_config() -> ModelConfig:
    """The tiny preset at the kernel's attention shape: 64 query heads of 512."""
    raw = json.loads(preset_json("tiny"))
    text = raw.get("text_config", raw)
    text.update(num_attention_heads=64, head_dim=512)
    return ModelConfig.from_dict(raw)


def test_a_prompt_prefill_runs_on_flashmla_within_the_bound() -> None:
    """Every attention call of the prefill may take FlashMLA once the model asks for it, every one does, and each
    meets the bound."""
    config = _wide_config()
    model = DeepseekV41ForCausalLM(config, ComputeMode.EXACT, tiny_vocab())
    model.load_weights(random_weights(config).items())
    model.cuda()
    ids = torch.randint(0, config.text.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = -(-PROMPT // BLOCK)
    table = torch.arange(1, blocks + 1, dtype=torch.int32)[None, :]
    cpu_batch = ForwardBatch.for_requests([ids], [0], table, [0])
    batch = dataclasses.replace(
        cpu_batch,
        **{
            field.name: value.cuda()
            for field in dataclasses.fields(cpu_batch)
            if isinstance(value := getattr(cpu_batch, field.name), torch.Tensor)
        },
    )

    def prefill(on: bool) -> tuple[FlashMLACalls, torch.Tensor]:
        model.flashmla = on
        state = model.allocate_state(BLOCK, blocks + 1, 1, device="cuda")
        with watch_flashmla(CHECK) as seen, torch.inference_mode():
            logits = model(batch, state).float()
        return seen, logits

    off, _ = prefill(False)
    assert off.calls and not off.taken and not off.errors
    on, logits = prefill(True)
    assert len(on.calls) == len(off.calls) and on.taken == len(on.calls) == len(on.errors)
    assert max(on.errors) <= 2.0**-7, on.errors
    assert bool(logits.isfinite().all())
