"""The model with FlashMLA's sparse prefill (``flashmla``; docs/design/kernels.md, "FlashMLA sparse prefill") on an
SM90 GPU with ``flash_mla`` importable: a prompt-sized prefill runs every attention call of the kernel's shape on
FlashMLA, and its logits stay within the bound of the package's kernels' logits.

Not the same bits: FlashMLA rounds probabilities against a running maximum and writes BF16 (about 2.5e-3 of the
attention output's scale, against the package's 6e-4). Tolerance: max |Δ logits| ≤ 2^−5 · max |logits| after the
tiny preset's seven layers at 64 heads of 512.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from _layered_model_support import random_weights, tiny_vocab

from deepinfer_kernels.cuda import flashmla
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode


def _flash_mla_on_sm90() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _flash_mla_on_sm90(), reason="needs an SM90 GPU with flash_mla (the sgl-flash-mla wheel)"),
]

BLOCK = 16
PROMPT = flashmla.MIN_QUERIES + 77


def _wide_config() -> ModelConfig:
    """The tiny preset at the kernel's attention shape: 64 query heads of 512."""
    raw = json.loads(preset_json("tiny"))
    text = raw.get("text_config", raw)
    text.update(num_attention_heads=64, head_dim=512)
    return ModelConfig.from_dict(raw)


def test_a_prompt_prefill_runs_on_flashmla_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention call of the prefill may take FlashMLA once the model asks for it, and every one does."""
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
    verdicts: list[bool] = []
    runs: list[int] = []
    fits, run = flashmla.fits, flashmla.sparse_attention

    def fits_seen(*args: Any) -> bool:
        verdicts.append(fits(*args))
        return verdicts[-1]

    def run_seen(*args: Any) -> None:
        runs.append(1)
        run(*args)

    monkeypatch.setattr(flashmla, "fits", fits_seen)
    monkeypatch.setattr(flashmla, "sparse_attention", run_seen)

    def prefill(on: bool) -> torch.Tensor:
        verdicts.clear()
        runs.clear()
        model.flashmla = on
        state = model.allocate_state(BLOCK, blocks + 1, 1, device="cuda")
        with torch.inference_mode():
            return model(batch, state).float()

    off = prefill(False)
    calls = len(verdicts)
    assert calls > 0 and not any(verdicts) and not runs
    on = prefill(True)
    assert len(verdicts) == calls and all(verdicts) and len(runs) == calls
    assert float((on - off).abs().max()) <= 2.0**-5 * float(off.abs().max())
