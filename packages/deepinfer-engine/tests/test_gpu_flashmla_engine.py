"""FlashMLA's sparse prefill inside the engine (``EngineArgs.flashmla``; docs/design/kernels.md, "FlashMLA sparse
prefill"), on an SM90 GPU with ``flash_mla`` importable: through ``LLM.generate`` with CUDA graphs for decode, the
prompt chunks of at least ``MIN_QUERIES`` tokens run attention on FlashMLA and every other call (short chunks, decode
steps and their graph captures) on the package's kernels; each FlashMLA call meets the kernel test's bound against
the reference on its own inputs (2^−7 · max |ref| on its first and last 64 queries).

The checkpoint is the tiny preset at the kernel's attention shape (64 query heads of 512), written by the project's
checkpoint writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer_engine import LLM, SamplingParams
from deepinfer_kernels.testing import watch_flashmla
from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.config import ModelConfig, preset_json

flashmla = pytest.importorskip("deepinfer_kernels.cuda.flashmla")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashmla.available(), reason="needs an SM90 GPU with flash_mla (the sgl-flash-mla wheel)"),
]

CHECK = 64
LONG, SHORT = flashmla.MIN_QUERIES + 300, 200


def _wide_checkpoint(root: Path) -> Path:
    raw = json.loads(preset_json("tiny"))
    text = raw.get("text_config", raw)
    text.update(num_attention_heads=64, head_dim=512)
    return write_checkpoint(ModelConfig.from_dict(raw), root / "tiny-wide", seed=2)


def test_prompt_chunks_run_on_flashmla_and_decode_steps_do_not(tmp_path: Path) -> None:
    llm = LLM(
        str(_wide_checkpoint(tmp_path)),
        device="cuda",
        nextn=0,
        flashmla=True,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        block_size=16,
        num_cache_blocks=256,
    )
    try:
        generator = torch.Generator().manual_seed(5)
        vocab = llm.model.config.text.vocab_size
        prompts = [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in (LONG, SHORT)]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        with watch_flashmla(CHECK) as seen:
            outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.close()
    assert all(output.ok and len(output.token_ids) == 6 for output in outputs)
    # Every call of a prompt-sized chunk took FlashMLA (at least one a layer), and no other call did.
    assert all(took == (tokens >= flashmla.MIN_QUERIES) for tokens, took in seen.calls)
    assert seen.taken >= llm.model.config.text.num_hidden_layers and len(seen.errors) == seen.taken
    assert max(seen.errors) <= 2.0**-7, seen.errors
