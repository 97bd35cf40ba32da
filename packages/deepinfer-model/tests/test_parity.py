"""Layered model vs the single-file reference on the tiny preset (random stored-format weights).

Acceptance: FP32 mode equals the reference's ``precision="fp32"`` within 1e-5 of the largest |logit| (observed
~1e-6: only the FP32 summation order differs). Exact mode follows the same rounding points, but its GEMMs run through
the kernels' ``fp8_block_gemm`` / ``mxfp4_gemm`` (FP64-accumulated reference emulation here) while the oracle
accumulates in FP32; a one-ulp difference can flip a later BF16/FP8 rounding or a router near-tie and grow, so exact
mode is checked for agreement up to the first such flip and for close rows overall. The prompts pass the sliding
window (64), make the indexer select (more rows than ``index_topk``) and activate the candidate-block restriction.
"""

from __future__ import annotations

import json

import pytest
import torch
from _layered_model_support import (
    prompt,
    random_weights,
    tiny_config,
    tiny_model,
    tiny_vocab,
    tiny_weights,
)

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.config import ModelConfig, preset_json
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

RELATIVE_TOLERANCE = 1e-5


def _reference(ids: torch.Tensor, precision: ref.Precision = "exact") -> torch.Tensor:
    config = tiny_config()
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    return ref.reference_forward(config, tiny_weights(), ids, vocabulary, precision=precision)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max()
    assert (actual - expected).abs().max() <= RELATIVE_TOLERANCE * scale
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_full_prompt_agrees_with_reference_in_exact_mode() -> None:
    ids = prompt(130)
    model = tiny_model(ComputeMode.EXACT)
    state = model.allocate_state(block_size=16, num_blocks=9, num_state_slots=1)
    table = torch.arange(9, dtype=torch.int32)[None, :]
    with torch.no_grad():
        logits = model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state)
    expected = _reference(ids)
    scale = expected.abs().max()
    # Observed: rows 0–30 within 1e-3 (before the first rounding flip), mean row cosine 0.994.
    assert (logits[:24] - expected[:24]).abs().max() <= 1e-3 * scale
    assert torch.nn.functional.cosine_similarity(logits, expected, dim=-1).mean() > 0.98


def test_full_prompt_matches_reference_in_fp32_mode() -> None:
    ids = prompt(130, seed=11)
    model = tiny_model(ComputeMode.FP32)
    state = model.allocate_state(block_size=16, num_blocks=9, num_state_slots=1)
    table = torch.arange(9, dtype=torch.int32)[None, :]
    with torch.no_grad():
        logits = model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state)
    _close(logits, _reference(ids, precision="fp32"))


def test_two_requests_in_one_step_match_their_own_references() -> None:
    first, second = prompt(70, seed=2), prompt(23, seed=3)
    model = tiny_model(ComputeMode.FP32)
    state = model.allocate_state(block_size=8, num_blocks=20, num_state_slots=3)
    # Interleaved pages and non-contiguous slots: addressing must follow the tables, not request order.
    table = torch.tensor([[1, 3, 5, 7, 9, 11, 13, 15, 17, 19], [0, 2, 4, 6, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)
    batch = ForwardBatch.for_requests([first.tolist(), second.tolist()], [0, 0], table, [2, 0])
    with torch.no_grad():
        logits = model(batch, state)
    _close(logits[:70], _reference(first, "fp32"))
    _close(logits[70:], _reference(second, "fp32"))


@pytest.mark.parametrize(
    "changes", [{"hc_shifted": False}, {"use_fp4_sparse_kv": False}, {"candidate_source_layer_id": None}]
)
def test_config_variants_match_reference(changes: dict[str, object]) -> None:
    data = json.loads(preset_json("tiny"))
    data["text_config"].update(changes)
    config = ModelConfig.from_dict(data)
    weights = random_weights(config, seed=3)
    ids = prompt(70, seed=13)
    model = DeepseekV41ForCausalLM(config, ComputeMode.FP32, tiny_vocab())
    model.load_weights(weights.items())
    state = model.allocate_state(block_size=16, num_blocks=5, num_state_slots=1)
    table = torch.arange(5, dtype=torch.int32)[None, :]
    with torch.no_grad():
        logits = model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state)
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    full = ref.reference_forward_full(config, weights, ids, vocabulary, precision="fp32")
    _close(logits, full.logits)
    anchor = 9
    with torch.no_grad():
        draft = ForwardBatch.for_requests([[anchor] + [3] * 3], [70], table, [0])
        hidden = model.draft_forward(draft, state)
    expected = ref_dspark.reference_dspark_forward(config, weights, full.target_features, anchor, precision="fp32")
    assert (
        hidden.float() - expected.hidden.float()
    ).abs().max() <= RELATIVE_TOLERANCE * expected.hidden.float().abs().max()
