"""End-to-end checks of the single-file reference model on random stored-format checkpoints.

Covers: the tiny preset forward (finite O(1) logits, determinism, causality, ``model.`` prefix handling, exactly the
catalogued tensors being read), the attention visibility sets of a hand-worked example, the
non-shifted mHC and FP8 compressed-KV variants, and the DSpark draft forward and heads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import pytest
import torch

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import tensor_pair
from deepinfer_model.config import ModelConfig, load_preset, preset_json
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue

# ---- random checkpoints in stored formats, from the checkpoint writer ----------------------------------------------


def random_checkpoint(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The writer's random value of every text-model catalogue tensor (vision tower left out), HF names."""
    weights: dict[str, torch.Tensor] = {}
    for entry in build_catalogue(config):
        if entry.format is not TensorFormat.SCALE and not entry.name.startswith(("vision.", "aligner.")):
            weights.update(tensor_pair(entry, config, seed))
    return weights


def tiny_vocabulary(config: ModelConfig) -> ref.EngramVocabulary:
    """The Engram vocabulary of the synthetic checkpoint's tokenizer (docs/design/model.md, "Compressed vocabulary")."""
    return ref.engram_vocabulary_from_tokenizer(build_tokenizer(config))


class RecordingWeights(Mapping[str, torch.Tensor]):
    """A read-only weight mapping that remembers which names the forward looked up."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return load_preset("tiny")


@pytest.fixture(scope="module")
def tiny_weights(tiny: ModelConfig) -> dict[str, torch.Tensor]:
    return random_checkpoint(tiny, seed=1)


@pytest.fixture(scope="module")
def tiny_tokens(tiny: ModelConfig) -> torch.Tensor:
    text = "Sphinx of black quartz, judge my vow; the five boxing wizards jump quickly. " * 8
    ids = torch.tensor(build_tokenizer(tiny).encode(text).ids, dtype=torch.int64)
    assert ids.shape[0] >= 80
    return ids[:80]


@pytest.fixture(scope="module")
def tiny_output(tiny, tiny_weights, tiny_tokens) -> ref.ReferenceOutput:
    return ref.reference_forward_full(tiny, tiny_weights, tiny_tokens, tiny_vocabulary(tiny))


# ---- tiny preset ----------------------------------------------------------------------------------------------------


def test_tiny_forward_gives_finite_order_one_logits(tiny, tiny_output, tiny_tokens):
    logits = tiny_output.logits
    assert logits.shape == (tiny_tokens.shape[0], tiny.text.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert 0.05 < logits.std().item() < 20.0
    assert tiny_output.hidden.dtype == torch.bfloat16
    assert tiny_output.target_features.shape == (80, tiny.text.dspark_num_targets * tiny.text.hidden_size)


def test_tiny_forward_exercises_sparse_selection(tiny, tiny_output):
    text = tiny.text
    compressed = [layer for layer in range(text.num_hidden_layers) if text.compress_ratios[layer] > 0]
    assert sorted(tiny_output.selected_rows) == compressed
    for layer in compressed:
        rows = tiny_output.selected_rows[layer]
        klen = (torch.arange(80) + 1) // text.compress_ratios[layer]
        count = (rows >= 0).sum(-1)
        assert torch.equal(count, klen.clamp(max=text.index_topk)), layer
        assert bool((rows < klen[:, None]).all()), layer  # never a row the query cannot see yet


def test_tiny_forward_restricts_later_indexers_to_candidate_blocks(tiny, tiny_output):
    """Layer 5 (index source after candidate source 4) selects only rows inside layer 4's candidate blocks."""
    text = tiny.text
    candidates = tiny_output.candidate_rows
    assert candidates is not None and candidates.shape == (80, 80)
    block, kept = text.candidate_block_size, text.candidate_topk_blocks
    klen = torch.arange(80) + 1
    newest_block = klen - block * ((klen - 1) // block)  # rows in the (possibly partial) block of row klen − 1
    expected = torch.where(klen <= block * kept, klen, (kept - 1) * block + newest_block)
    assert torch.equal(candidates.sum(-1), expected)  # `kept` blocks, one of them the newest
    assert bool(candidates[torch.arange(80), klen - 1].all())  # the block of the newest row is always kept
    rows = tiny_output.selected_rows[5]
    picked = candidates.gather(1, rows.clamp(min=0))
    assert bool(picked[rows >= 0].all())
    unrestricted = tiny_output.selected_rows[4]
    assert not bool(candidates.gather(1, unrestricted.clamp(min=0))[unrestricted >= 0].all())


def test_tiny_forward_is_deterministic(tiny, tiny_weights, tiny_tokens, tiny_output):
    again = ref.reference_forward(tiny, tiny_weights, tiny_tokens, tiny_vocabulary(tiny))
    assert torch.equal(again, tiny_output.logits)


def test_tiny_forward_is_causal(tiny, tiny_weights, tiny_tokens, tiny_output):
    changed = tiny_tokens.clone()
    changed[50] = (changed[50] + 1) % tiny.text.vocab_size
    logits = ref.reference_forward(tiny, tiny_weights, changed, tiny_vocabulary(tiny))
    assert torch.equal(logits[:50], tiny_output.logits[:50])
    assert not torch.equal(logits[50], tiny_output.logits[50])


def test_model_prefix_is_accepted_and_duplicates_rejected(tiny, tiny_weights, tiny_tokens, tiny_output):
    prefixed = {f"model.{name}": tensor for name, tensor in tiny_weights.items()}
    logits = ref.reference_forward(tiny, prefixed, tiny_tokens[:20], tiny_vocabulary(tiny))
    assert torch.equal(logits, tiny_output.logits[:20])
    with pytest.raises(ValueError, match="both with and without"):
        ref.reference_forward(tiny, {**tiny_weights, **prefixed}, tiny_tokens[:4], tiny_vocabulary(tiny))


def test_forward_reads_exactly_the_catalogued_text_tensors(tiny, tiny_weights, tiny_tokens, tiny_output):
    recorder = RecordingWeights(tiny_weights)
    ref.reference_forward(tiny, recorder, tiny_tokens[:24], tiny_vocabulary(tiny))
    hidden = ref_dspark.reference_dspark_forward(tiny, recorder, tiny_output.target_features[:24], 5).hidden
    ref_dspark.reference_dspark_heads(tiny, recorder, hidden, torch.tensor([5, 6, 7, 8]))
    # Routed experts are read only when some token selects them.
    unused = {name for name in tiny_weights if name not in recorder.read and ".ffn.experts." not in name}
    # Image vectors and the image-token router bias belong to the multimodal path only.
    expected_unused = {"image_start", "image_end", "image_newline"} | {n for n in tiny_weights if n.endswith("bias_vl")}
    assert unused == expected_unused


def test_bad_token_ids_are_rejected(tiny, tiny_weights):
    with pytest.raises(ValueError, match="outside the text vocabulary"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, tiny.text.vocab_size]), tiny_vocabulary(tiny))
    with pytest.raises(TypeError, match="int64"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, 2], dtype=torch.int32), tiny_vocabulary(tiny))
    with pytest.raises(ValueError, match="engram_vocabulary"):
        ref.reference_forward(tiny, tiny_weights, torch.tensor([1, 2]))


# ---- hand-worked example: keys attended per query ---------------------------------------------------------------


def worked_example_config() -> ModelConfig:
    """The tiny configuration of the hand-worked attention example (Engram off; one DSpark block)."""
    data = json.loads(preset_json("tiny"))
    text = {k: v for k, v in data["text_config"].items() if not k.startswith("engram_")}
    text.pop("index_k_source_layer_ids")
    text.update(
        num_attention_heads=4,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        sliding_window=16,
        num_hidden_layers=6,
        num_nextn_predict_layers=1,
        compress_ratios=[0, 2, 2, 1, 1, 1, 0],
        index_n_heads=2,
        index_head_dim=128,
        index_topk=4,
        kv_source_layer_ids=[1, 3],
        index_source_layer_ids=[1, 3, 5],
        candidate_source_layer_id=3,
        candidate_block_size=8,
        candidate_topk_blocks=8,
        dspark_target_layer_ids=[1, 2],
        dspark_markov_rank=8,
        dspark_block_size=2,
    )
    data["text_config"] = text
    return ModelConfig.from_dict(data)


@pytest.fixture(scope="module")
def example() -> tuple[ModelConfig, dict[str, torch.Tensor], ref.ReferenceOutput]:
    config = worked_example_config()
    weights = random_checkpoint(config, seed=3)
    tokens = torch.randint(0, config.text.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    return config, weights, ref.reference_forward_full(config, weights, tokens)


def _rows(output: ref.ReferenceOutput, layer: int, t: int) -> set[int]:
    return {int(r) for r in output.selected_rows[layer][t] if r >= 0}


def test_worked_example_swa_sets():
    visible = ref.swa_visibility(40, 16)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 7: set(range(8)), 16: set(range(1, 17)), 36: set(range(21, 37))}
    expected |= {37: set(range(22, 38)), 38: set(range(23, 39)), 39: set(range(24, 40))}
    for t, positions in expected.items():
        assert set(torch.nonzero(visible[t]).flatten().tolist()) == positions, t


def test_worked_example_compressed_rows(example):
    _, _, output = example
    assert sorted(output.selected_rows) == [1, 2, 3, 4, 5]
    # C2 layers 1 and 2: klen = (t + 1) // 2.
    assert _rows(output, 1, 0) == set()
    assert _rows(output, 1, 1) == {0}
    assert _rows(output, 1, 2) == {0}
    assert _rows(output, 1, 7) == {0, 1, 2, 3}
    # C1 layers 3-5: klen = t + 1.
    assert _rows(output, 3, 0) == {0}
    assert _rows(output, 3, 1) == {0, 1}
    assert _rows(output, 3, 2) == {0, 1, 2}
    for t, c2_rows, c1_rows in [(16, 8, 17), (36, 18, 37), (37, 19, 38), (38, 19, 39), (39, 20, 40)]:
        for layer, num_rows in [(1, c2_rows), (3, c1_rows), (5, c1_rows)]:
            rows = _rows(output, layer, t)
            assert len(rows) == 4 and rows <= set(range(num_rows)), (layer, t)
    # Final state: layer 1 holds rows 0–19 (row 18 completed by token 37), layer 3 rows 0–39.
    assert output.compressed_keys.keys() == output.index_keys.keys() == {1, 3}
    assert output.compressed_keys[1].shape[0] == output.index_keys[1].shape[0] == 20
    assert output.compressed_keys[3].shape[0] == output.index_keys[3].shape[0] == 40
    # Index consumers reuse their source's rows verbatim; layer 5 runs its own indexer.
    assert torch.equal(output.selected_rows[2], output.selected_rows[1])
    assert torch.equal(output.selected_rows[4], output.selected_rows[3])
    assert not torch.equal(output.selected_rows[5], output.selected_rows[3])


def test_worked_example_layer5_is_unrestricted_while_all_blocks_are_candidates(example):
    """With klen ≤ 8 blocks · 8 rows every row is a candidate, so layer 5's top-4 equals its unrestricted top-4."""
    config, _, output = example
    assert config.text.candidate_topk_blocks * config.text.candidate_block_size >= 40
    assert all(len(_rows(output, 5, t)) == min(4, t + 1) for t in range(40))


def test_worked_example_maps():
    text = worked_example_config().text
    assert text.n_prefill_layer == 3
    assert ref.sparse_source_map(text.kv_source_layer_ids, 6) == [0, 1, 1, 3, 3, 3]
    assert ref.sparse_source_map(text.index_source_layer_ids, 6) == [0, 1, 1, 3, 3, 5]
    assert ref.sparse_source_map(text.index_k_source_layer_ids, 6) == [0, 1, 1, 3, 3, 3]


def test_yoco_consumer_kv_source_compresses_the_shared_hidden(tiny_tokens):
    """Layer 5 (a KV source after the YOCO boundary 4) builds its rows from layer 4's attention input."""
    config = _variant(
        compress_ratios=[0, 2, 2, 0, 1, 1, 1, 0],
        kv_source_layer_ids=[1, 3, 4, 5],
        index_k_source_layer_ids=[1, 3, 4, 5],
    )
    assert config.text.n_prefill_layer == 4
    weights = random_checkpoint(config, seed=6)
    tokens = tiny_tokens[:24]
    base = ref.reference_forward_full(config, weights, tokens, tiny_vocabulary(config))
    own_input_changed = dict(weights)
    own_input_changed["layers.5.attn_norm.weight"] = weights["layers.5.attn_norm.weight"].flip(0)
    changed = ref.reference_forward_full(config, own_input_changed, tokens, tiny_vocabulary(config))
    assert torch.equal(changed.compressed_keys[5], base.compressed_keys[5])
    assert torch.equal(changed.index_keys[5], base.index_keys[5])
    assert not torch.equal(changed.swa_keys[5], base.swa_keys[5])
    producer_changed = dict(weights)
    producer_changed["layers.4.attn_norm.weight"] = weights["layers.4.attn_norm.weight"].flip(0)
    changed = ref.reference_forward_full(config, producer_changed, tokens, tiny_vocabulary(config))
    assert not torch.equal(changed.compressed_keys[5], base.compressed_keys[5])


def test_forward_without_yoco(tiny_tokens):
    """The only ratio-1 entry is the DSpark block's, so YOCO is off and every layer compresses its own input."""
    config = _variant(compress_ratios=[0, 2, 2, 0, 2, 2, 2, 1])
    assert config.text.n_prefill_layer == config.text.num_hidden_layers
    weights = random_checkpoint(config, seed=7)
    output = ref.reference_forward_full(config, weights, tiny_tokens[:24], tiny_vocabulary(config))
    assert torch.isfinite(output.logits).all()
    assert output.compressed_keys[4].shape[0] == 12


def test_cache_contents_have_the_storage_shapes(tiny, tiny_output):
    text = tiny.text
    assert sorted(tiny_output.swa_keys) == list(range(text.num_hidden_layers))
    assert sorted(tiny_output.compressed_keys) == [1, 4]  # compressed KV sources (layer 3 is SWA-only)
    assert sorted(tiny_output.index_keys) == [1, 4]
    assert tiny_output.compressed_keys[1].shape == (40, text.head_dim)
    assert tiny_output.index_keys[4].shape == (80, text.index_head_dim)
    # FP4 (e2m1 × E4M3 scale, groups of 16) rows take at most 8 magnitudes per group up to scale.
    row = tiny_output.compressed_keys[1][7].view(-1, 16)
    assert all(len(set(group.abs().tolist())) <= 8 for group in row)


def test_worked_example_draft_keys(example):
    """DSpark decode step 1: p* = 37, B = 2 → both slots see context 22–37 and draft keys 38–39."""
    config, weights, output = example
    draft = ref_dspark.reference_dspark_forward(config, weights, output.target_features[:38], anchor_token=5)
    assert draft.context_positions.tolist() == list(range(22, 38))
    assert draft.positions.tolist() == [38, 39]


# ---- variants ------------------------------------------------------------------------------------------------------


def _variant(**changes: object) -> ModelConfig:
    data = json.loads(preset_json("tiny"))
    data["text_config"].update(changes)
    return ModelConfig.from_dict(data)


def test_non_shifted_mhc_uses_the_hc_head(tiny, tiny_tokens):
    config = _variant(hc_shifted=False)
    weights = random_checkpoint(config, seed=5)
    assert "hc_head_fn" in weights and "mtp.0.hc_head_fn" in weights
    output = ref.reference_forward_full(config, weights, tiny_tokens[:16], tiny_vocabulary(config))
    assert torch.isfinite(output.logits).all() and 0.05 < output.logits.std().item() < 20.0
    draft = ref_dspark.reference_dspark_forward(config, weights, output.target_features, anchor_token=3)
    assert torch.isfinite(draft.hidden.float()).all()
    del weights["mtp.0.hc_head_fn"]
    with pytest.raises(KeyError, match=r"mtp\.0\.hc_head_fn"):
        ref_dspark.reference_dspark_forward(config, weights, output.target_features, anchor_token=3)
    del weights["hc_head_fn"]
    with pytest.raises(KeyError, match="hc_head_fn"):
        ref.reference_forward(config, weights, tiny_tokens[:16], tiny_vocabulary(config))


def test_fp8_compressed_kv_is_a_small_perturbation(tiny, tiny_weights, tiny_tokens, tiny_output):
    config = _variant(use_fp4_sparse_kv=False)
    logits = ref.reference_forward(config, tiny_weights, tiny_tokens[:40], tiny_vocabulary(config))
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, tiny_output.logits[:40])
    cosine = torch.nn.functional.cosine_similarity(logits.flatten(), tiny_output.logits[:40].flatten(), dim=0)
    assert cosine > 0.9


# ---- DSpark ---------------------------------------------------------------------------------------------------------


def test_dspark_forward_and_heads(tiny, tiny_weights, tiny_output):
    text = tiny.text
    draft = ref_dspark.reference_dspark_forward(tiny, tiny_weights, tiny_output.target_features[:70], anchor_token=7)
    assert draft.hidden.shape == (text.dspark_block_size, text.hidden_size) and draft.hidden.dtype == torch.bfloat16
    assert draft.positions.tolist() == [70, 71, 72, 73]
    logits, confidence = ref_dspark.reference_dspark_heads(tiny, tiny_weights, draft.hidden, torch.tensor([7, 1, 2, 3]))
    assert logits.shape == (4, text.vocab_size) and torch.isfinite(logits).all()
    assert bool(((confidence > 0) & (confidence < 1)).all())
    other, _ = ref_dspark.reference_dspark_heads(tiny, tiny_weights, draft.hidden, torch.tensor([7, 1, 2, 9]))
    assert torch.equal(other[:3], logits[:3]) and not torch.equal(other[3], logits[3])  # Markov term: own prev only
    sharp, _ = ref_dspark.reference_dspark_heads(
        tiny, tiny_weights, draft.hidden, torch.tensor([7, 1, 2, 3]), [1, 1, 1, 0.5]
    )
    with pytest.raises(ValueError, match="temperatures"):
        ref_dspark.reference_dspark_heads(tiny, tiny_weights, draft.hidden, torch.tensor([7, 1, 2, 3]), [1.0, 2.0])
    assert torch.equal(sharp, logits)


def test_dspark_reads_only_the_last_window_of_context(tiny, tiny_weights, tiny_output):
    """Slots see context positions p*−W+1 … p* only, and are non-causal among themselves."""
    features = tiny_output.target_features[:70]
    base = ref_dspark.reference_dspark_forward(tiny, tiny_weights, features, anchor_token=7).hidden
    old_changed = features.clone()
    old_changed[: 70 - tiny.text.sliding_window] = 0
    assert torch.equal(
        ref_dspark.reference_dspark_forward(tiny, tiny_weights, old_changed, anchor_token=7).hidden, base
    )
    recent_changed = features.clone()
    recent_changed[-1] = 0
    assert not torch.equal(
        ref_dspark.reference_dspark_forward(tiny, tiny_weights, recent_changed, anchor_token=7).hidden, base
    )
    other_anchor = ref_dspark.reference_dspark_forward(tiny, tiny_weights, features, anchor_token=8).hidden
    assert all(not torch.equal(other_anchor[k], base[k]) for k in range(4))  # the anchor reaches every slot


def test_dspark_short_context_and_slot_override(tiny, tiny_weights, tiny_output):
    draft = ref_dspark.reference_dspark_forward(tiny, tiny_weights, tiny_output.target_features[:1], 7, num_slots=2)
    assert draft.positions.tolist() == [1, 2] and torch.isfinite(draft.hidden.float()).all()
    with pytest.raises(ValueError, match="target features"):
        ref_dspark.reference_dspark_forward(tiny, tiny_weights, tiny_output.target_features[:, :10], 7)
