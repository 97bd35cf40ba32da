"""The reference forward and the DSpark anchor forward over a batch of sequences (what the tiny-checkpoint trainer
runs) against one forward per sequence: same logits, features, selected rows and keys per sequence, and gradients
that are the sum of the per-sequence ones.

Tolerance: in fp32 precision a batch changes only the FP32 summation order (GEMM shapes), so values agree to
1e-5 of the largest magnitude of the compared tensor; discrete choices (selected rows, candidate blocks) are equal.
"""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_weights

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import logical_value
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue
from deepinfer_model.reference_values import ValueWeights

TOLERANCE = 1e-5  # of the largest magnitude (fp32 precision)
LENGTH = 90  # beyond the 64-token window, with compressed rows and candidate blocks in play


@pytest.fixture(scope="module")
def vocabulary() -> ref.EngramVocabulary:
    return ref.engram_vocabulary_from_tokenizer(build_tokenizer(tiny_config()))


def _batch() -> torch.Tensor:
    """Three different sequences; the third repeats the first's start so equal prefixes meet different suffixes."""
    ids = torch.stack([prompt(LENGTH, seed=11), prompt(LENGTH, seed=12), prompt(LENGTH, seed=11)])
    ids[2, 40:] = prompt(LENGTH - 40, seed=13)
    return ids


def _assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape, what
    scale = expected.float().abs().max().clamp_min(1e-30)
    assert (got.float() - expected.float()).abs().max() <= TOLERANCE * scale, what


@pytest.mark.parametrize("keep", [None, 30])
def test_batched_forward_gives_each_sequence_its_own_forward(vocabulary: ref.EngramVocabulary, keep: int | None):
    config, weights, ids = tiny_config(), tiny_weights(), _batch()
    batched = ref.reference_forward_full(config, weights, ids, vocabulary, precision="fp32", yoco_keep_tokens=keep)
    assert batched.logits.shape == (3, LENGTH, config.text.vocab_size)
    for b in range(ids.shape[0]):
        one = ref.reference_forward_full(config, weights, ids[b], vocabulary, precision="fp32", yoco_keep_tokens=keep)
        got = batched.sequence(b)
        _assert_close(got.logits, one.logits, "logits")
        _assert_close(got.hidden, one.hidden, "hidden")
        _assert_close(got.target_features, one.target_features, "target features")
        for layer, rows in one.selected_rows.items():
            assert torch.equal(got.selected_rows[layer], rows), layer
        for name in ("swa_keys", "compressed_keys", "index_keys"):
            for layer, keys in getattr(one, name).items():
                _assert_close(getattr(got, name)[layer], keys, f"{name} {layer}")
        assert one.candidate_rows is not None and got.candidate_rows is not None
        assert torch.equal(got.candidate_rows, one.candidate_rows)
    assert not torch.equal(batched.logits[0, 50:], batched.logits[2, 50:])  # different content, different logits


def test_a_batch_of_one_is_the_unbatched_forward_bit_for_bit(vocabulary: ref.EngramVocabulary) -> None:
    config, weights, ids = tiny_config(), tiny_weights(), prompt(70, seed=4)
    one = ref.reference_forward_full(config, weights, ids, vocabulary)
    batched = ref.reference_forward_full(config, weights, ids[None], vocabulary).sequence(0)
    assert torch.equal(batched.logits, one.logits)
    assert torch.equal(batched.target_features, one.target_features)


def test_batched_gradients_are_the_sum_of_the_per_sequence_gradients(vocabulary: ref.EngramVocabulary) -> None:
    config, ids = tiny_config(), _batch()[:, :72]
    entries = [e for e in build_catalogue(config) if e.format is not TensorFormat.SCALE]
    values = {e.name: logical_value(e, config, seed=9).requires_grad_(True) for e in entries}

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        logits = ref.reference_forward_full(config, ValueWeights(values), tokens, vocabulary, precision="fp32").logits
        return torch.nn.functional.cross_entropy(logits[..., :-1, :].flatten(0, -2), tokens[..., 1:].flatten())

    loss(ids).backward()
    batched = {k: v.grad.clone() for k, v in values.items() if v.grad is not None}
    for v in values.values():
        v.grad = None
    for b in range(ids.shape[0]):
        (loss(ids[b]) / ids.shape[0]).backward()  # the batched loss is the mean over the same tokens
    separate = {k: v.grad for k, v in values.items() if v.grad is not None}
    assert batched.keys() == separate.keys()
    assert {"embed.weight", "layers.0.engram.embed.weight", "layers.1.attn.wq_a.weight", "head.weight"} <= set(batched)
    for name, grad in separate.items():
        scale = grad.abs().max().clamp_min(1e-30)
        assert (batched[name] - grad).abs().max() <= 1e-4 * scale, name


def test_batched_anchor_forward_gives_each_sequence_its_own_anchors(vocabulary: ref.EngramVocabulary) -> None:
    config, weights, ids = tiny_config(), tiny_weights(), _batch()
    features = ref.reference_forward_full(config, weights, ids, vocabulary, precision="fp32").target_features
    last = torch.tensor([[0, 5, 63, 70], [3, 64, 80, 86], [1, 2, 40, 85]])
    anchors = ids.gather(1, last + 1)
    batched = ref_dspark.reference_dspark_forward_anchors(config, weights, features, last, anchors, 3, precision="fp32")
    assert batched.shape == (3, 4, 3, config.text.hidden_size)
    for b in range(3):
        one = ref_dspark.reference_dspark_forward_anchors(
            config, weights, features[b], last[b], anchors[b], 3, precision="fp32"
        )
        _assert_close(batched[b], one, f"sequence {b}")
    with pytest.raises(ValueError, match=r"\[S, A\] for a batch"):
        ref_dspark.reference_dspark_forward_anchors(config, weights, features, last[0], anchors[0])
    with pytest.raises(ValueError, match="anchors for 2 sequences"):
        ref_dspark.reference_dspark_forward_anchors(config, weights, features, last[:2], anchors[:2])


def test_token_ids_of_three_dims_are_rejected(vocabulary: ref.EngramVocabulary) -> None:
    with pytest.raises(TypeError, match="1-D or 2-D int64"):
        ref.reference_forward_full(tiny_config(), tiny_weights(), prompt(8)[None, None], vocabulary)


@pytest.mark.parametrize("precision", ["exact", "fp32"])
def test_key_sets_attend_like_their_union_per_query(precision: ref.Precision) -> None:
    """Shared window keys plus per-query rows give the softmax over each query's concatenated keys."""
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 5, 4, 32, generator=gen)
    shared, own = torch.randn(2, 7, 32, generator=gen), torch.randn(2, 5, 3, 32, generator=gen)
    shared_mask, own_mask = torch.rand(5, 7, generator=gen) < 0.6, torch.rand(2, 5, 3, generator=gen) < 0.5
    own_mask[0, 1] = False
    shared_mask[1] = False  # query 1 of sequence 0 sees no key: zeros
    sink = torch.randn(4, generator=gen)
    got = ref.attention_over_key_sets(query, [(shared, shared_mask), (own, own_mask)], sink, 0.2, precision=precision)
    union = torch.cat([shared[:, None].expand(-1, 5, -1, -1), own], 2)
    mask = torch.cat([shared_mask.expand(2, -1, -1), own_mask], 2)
    expected = ref.attention_core(query, union, mask, sink, 0.2, precision=precision)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert bool((got[0, 1] == 0).all())
