"""DSpark drafter: context keys written by the main forward, the draft forward over the drafter rings and the heads,
against the reference's draft forward (both precisions)."""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import (
    prompt,
    tiny_config,
    tiny_model,
    tiny_vocab,
    tiny_weights,
)

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

# FP32 mode: summation order only. Exact mode: the kernels' GEMMs accumulate differently from the oracle, which can
# flip a BF16/FP8 rounding (observed equal here; the bound allows a flip). The reference drafts from the layered
# model's own target features: a flip in the 7 backbone layers (a routing or top-k decision at one position) would
# otherwise change every later position's features, and this test is about the drafter.
MODES = [(ComputeMode.EXACT, "exact", 1e-2), (ComputeMode.FP32, "fp32", 1e-5)]


@pytest.mark.parametrize(("mode", "precision", "tolerance"), MODES)
def test_draft_forward_and_heads_match_reference(mode: ComputeMode, precision: ref.Precision, tolerance: float) -> None:
    config = tiny_config()
    text = config.text
    ids = prompt(75, seed=12)
    anchor, block = 17, text.dspark_block_size
    model = tiny_model(mode)
    state = model.allocate_state(block_size=8, num_blocks=11, num_state_slots=2)
    table = torch.arange(11, dtype=torch.int32)[None, :]
    features: dict[int, torch.Tensor] = {}
    hooks = [
        model.layers[layer].register_forward_pre_hook(
            lambda _m, args, layer=layer: features.__setitem__(
                layer, args[0].float().mean(dim=1).to(mode.activation_dtype)
            )
        )
        for layer in text.dspark_target_layer_ids
    ]
    with torch.no_grad():
        model(ForwardBatch.for_requests([ids.tolist()], [0], table, [1]), state)
        draft = ForwardBatch.for_requests([[anchor] + [text.dspark_noise_token_id] * (block - 1)], [75], table, [1])
        hidden = model.draft_forward(draft, state)
        previous = torch.tensor([anchor, 5, 9, 11])
        temperature = torch.tensor([1.0, 2.0, 0.5, 1.0])
        logits, confidence = model.draft_heads(model.draft_logits(hidden), hidden, previous, temperature)

    for hook in hooks:
        hook.remove()
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    full = ref.reference_forward_full(config, tiny_weights(), ids, vocabulary, precision=precision)
    target = torch.cat([features[layer] for layer in text.dspark_target_layer_ids], dim=-1)
    if mode is ComputeMode.FP32:  # exact mode: see the note on MODES
        assert (target - full.target_features).abs().max() <= tolerance * target.abs().max()
    expected = ref_dspark.reference_dspark_forward(config, tiny_weights(), target, anchor, precision=precision)
    ref_logits, ref_confidence = ref_dspark.reference_dspark_heads(
        config, tiny_weights(), expected.hidden, previous, temperature.tolist(), precision=precision
    )
    scale = expected.hidden.float().abs().max()
    assert (hidden.float() - expected.hidden.float()).abs().max() <= tolerance * scale
    assert (logits - ref_logits).abs().max() <= tolerance * ref_logits.abs().max()
    torch.testing.assert_close(confidence, ref_confidence, rtol=tolerance, atol=tolerance / 10)


def test_draft_forward_needs_dspark_blocks() -> None:
    from deepinfer_model.config import ModelConfig
    from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM

    data = tiny_config().to_dict()
    data["text_config"]["num_nextn_predict_layers"] = 0
    data["text_config"]["compress_ratios"] = data["text_config"]["compress_ratios"][:-1]
    model = DeepseekV41ForCausalLM(ModelConfig.from_dict(data), engram_vocab=tiny_vocab())
    assert "dspark_swa" not in {group.name for group in model.cache_spec().groups}
    state = model.allocate_state(block_size=8, num_blocks=1, num_state_slots=1)
    batch = ForwardBatch.for_requests([[1]], [0], torch.zeros(1, 1, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="no DSpark blocks"):
        model.draft_forward(batch, state)


def test_draft_blocks_of_two_requests_are_independent() -> None:
    text = tiny_config().text
    model = tiny_model(ComputeMode.FP32)
    first, second = prompt(30, seed=16), prompt(12, seed=17)
    table = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=torch.int32)
    noise = [text.dspark_noise_token_id] * 3

    def drafts(requests: list[int]) -> list[torch.Tensor]:
        state = model.allocate_state(block_size=8, num_blocks=8, num_state_slots=2)
        prompts = [first, second]
        with torch.no_grad():
            model(
                ForwardBatch.for_requests(
                    [prompts[r].tolist() for r in requests], [0] * len(requests), table[requests], requests
                ),
                state,
            )
            batch = ForwardBatch.for_requests(
                [[5 + r, *noise] for r in requests], [len(prompts[r]) for r in requests], table[requests], requests
            )
            hidden = model.draft_forward(batch, state)
        return list(hidden.split(4))

    both = drafts([0, 1])
    torch.testing.assert_close(both[0], drafts([0])[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1], drafts([1])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_draft_logits_of_all_slots_at_once_are_each_slots_own(batch_invariant: bool) -> None:
    """The drafter passes every slot of its blocks to ``draft_logits`` in one call: each row's logits are those of the
    row alone (bit for bit under ``batch_invariant``; within FP32 summation order otherwise), and ``draft_heads``
    adds the Markov bias of the row's previous token."""
    model = tiny_model(ComputeMode.EXACT)
    model.batch_invariant = batch_invariant
    hidden = torch.randn(12, tiny_config().text.hidden_size, generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        together = model.draft_logits(hidden)
        alone = torch.cat([model.draft_logits(hidden[i : i + 1]) for i in range(hidden.shape[0])])
        previous = torch.arange(hidden.shape[0]) * 7
        temperature = torch.ones(hidden.shape[0])
        logits, confidence = model.draft_heads(together, hidden, previous, temperature)
        markov = model.mtp[-1].markov_head
        bias = markov.bias(markov.previous_embedding(previous))
    assert together.shape == (hidden.shape[0], tiny_config().text.vocab_size) and together.dtype == torch.float32
    if batch_invariant:  # the bias above was computed outside the mode's FP64 products: equal up to its rounding
        assert torch.equal(together, alone)
        torch.testing.assert_close(logits, together + bias, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits, together + bias)
    assert confidence.shape == (hidden.shape[0],) and bool(((confidence > 0) & (confidence < 1)).all())
