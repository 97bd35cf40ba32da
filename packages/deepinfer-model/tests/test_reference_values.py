"""FP32 values as the reference model's weight source (what a trainer hands it) against the stored-format path, and
the batched-anchor draft forward against the per-anchor oracle."""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_weights

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import logical_value, stored_pair
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.reference_values import ValueWeights, bf16_weight_names, values_from_stored


@pytest.fixture(scope="module")
def vocabulary() -> ref.EngramVocabulary:
    return ref.engram_vocabulary_from_tokenizer(build_tokenizer(tiny_config()))


@pytest.mark.parametrize("precision", ["exact", "fp32"])
def test_value_weights_give_the_stored_path_logits(precision: ref.Precision, vocabulary: ref.EngramVocabulary) -> None:
    config, weights, ids = tiny_config(), tiny_weights(), prompt(90, seed=3)
    stored = ref.reference_forward_full(config, weights, ids, vocabulary, precision=precision)
    values = ref.reference_forward_full(
        config, ValueWeights(values_from_stored(config, weights)), ids, vocabulary, precision=precision
    )
    assert torch.equal(stored.logits, values.logits)
    assert torch.equal(stored.target_features, values.target_features)


@pytest.mark.parametrize("source", ["writer", "hand-made codes"])
def test_values_from_stored_write_back_to_the_same_values(source: str) -> None:
    # A trainer continuing from a written checkpoint must not move its weights: values -> stored -> values is the
    # identity. The bytes may differ: a block whose largest code rounds to the bottom of its scale's range (or
    # hand-made codes that do not use the range) is stored again with half the scale and doubled codes.
    config = tiny_config()
    entries = [e for e in build_catalogue(config) if e.format is not TensorFormat.SCALE]
    if source == "writer":
        stored = dict(pair for e in entries for pair in stored_pair(e, logical_value(e, config, seed=5)))
    else:
        stored = tiny_weights()
    values = values_from_stored(config, stored)
    again = values_from_stored(config, dict(pair for e in entries for pair in stored_pair(e, values[e.name])))
    assert values.keys() == {e.name for e in entries}
    assert all(torch.equal(again[name], value) for name, value in values.items())


def test_values_from_stored_names_a_missing_scale() -> None:
    stored = dict(tiny_weights())
    name = next(e.name for e in build_catalogue(tiny_config()) if e.format is TensorFormat.MXFP4)
    del stored[name.removesuffix(".weight") + ".scale"]
    with pytest.raises(KeyError, match="scale"):
        values_from_stored(tiny_config(), stored)


def test_fake_quant_reads_what_the_writer_stores(vocabulary: ref.EngramVocabulary) -> None:
    """Raw FP32 values through fake quantization equal the checkpoint the writer makes of them."""
    config, ids = tiny_config(), prompt(40, seed=5)
    entries = [e for e in build_catalogue(config) if e.format is not TensorFormat.SCALE]
    raw = {e.name: logical_value(e, config, seed=9) for e in entries}
    stored = dict(pair for e in entries for pair in stored_pair(e, raw[e.name]))
    expected = ref.reference_forward_full(config, stored, ids, vocabulary, precision="fp32").logits
    source = ValueWeights(raw, fake_quant=True, bf16_names=bf16_weight_names(config))
    got = ref.reference_forward_full(config, source, ids, vocabulary, precision="fp32")
    assert torch.equal(expected, got.logits)


def test_gradients_reach_every_kind_of_weight(vocabulary: ref.EngramVocabulary) -> None:
    config, ids = tiny_config(), prompt(48, seed=7)
    values = {k: v.clone().requires_grad_(True) for k, v in values_from_stored(tiny_config(), tiny_weights()).items()}
    logits = ref.reference_forward_full(
        config, ValueWeights(values, fake_quant=True), ids, vocabulary, precision="fp32"
    )
    torch.nn.functional.cross_entropy(logits.logits[:-1], ids[1:]).backward()
    for name in (
        "embed.weight",
        "layers.0.engram.embed.weight",
        "layers.1.attn.wq_a.weight",
        "layers.2.ffn.shared_experts.w2.weight",
        "layers.3.hc_attn_fn",
        "head.weight",
    ):
        grad = values[name].grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0, name
    assert any(values[f"layers.4.ffn.experts.{e}.w1.weight"].grad is not None for e in range(8))


@pytest.mark.parametrize(("precision", "tolerance"), [("exact", 0.0), ("fp32", 1e-5)])
def test_batched_anchor_draft_forward_matches_the_oracle(precision: ref.Precision, tolerance: float) -> None:
    config, weights = tiny_config(), tiny_weights()
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))
    ids = prompt(100, seed=2)
    features = ref.reference_forward_full(config, weights, ids, vocabulary, precision=precision).target_features
    last = torch.tensor([0, 5, 63, 64, 90])
    anchors = ids[last + 1]
    batched = ref_dspark.reference_dspark_forward_anchors(
        config, weights, features, last, anchors, 3, precision=precision
    )
    assert batched.shape == (5, 3, config.text.hidden_size)
    for row, (p, token) in enumerate(zip(last.tolist(), anchors.tolist(), strict=True)):
        one = ref_dspark.reference_dspark_forward(
            config, weights, features[: p + 1], token, 3, precision=precision
        ).hidden
        scale = one.float().abs().max()
        assert (batched[row].float() - one.float()).abs().max() <= tolerance * scale, p


def test_batched_anchor_draft_forward_rejects_bad_positions() -> None:
    config, weights = tiny_config(), tiny_weights()
    features = torch.zeros(10, config.text.dspark_num_targets * config.text.hidden_size)
    with pytest.raises(ValueError, match="last_positions must lie in"):
        ref_dspark.reference_dspark_forward_anchors(config, weights, features, torch.tensor([10]), torch.tensor([4]))
    with pytest.raises(ValueError, match="equal non-empty 1-D"):
        ref_dspark.reference_dspark_forward_anchors(config, weights, features, torch.tensor([1, 2]), torch.tensor([4]))
