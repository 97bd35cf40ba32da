"""Model construction (tiny and the released config on the meta device), cache groups, strict weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _layered_model_support import (
    tiny_config,
    tiny_vocab,
    tiny_weights,
)

from deepinfer_model.cache_spec import CacheGroupKind
from deepinfer_model.config import ModelConfig, load_preset
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.loading.catalogue import build_catalogue


def _text_catalogue_elements(config: ModelConfig) -> int:
    return sum(
        entry.num_elements
        for entry in build_catalogue(config)
        if not entry.name.startswith(("vision.", "aligner.", "image_"))
    )


def test_tiny_parameters_cover_the_catalogue_exactly() -> None:
    model = DeepseekV41ForCausalLM(tiny_config(), engram_vocab=tiny_vocab())
    assert sum(p.numel() for p in model.parameters()) == _text_catalogue_elements(tiny_config())


def test_released_config_builds_on_meta() -> None:
    config = load_preset("v41-flash")
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == _text_catalogue_elements(config)
    spec = model.cache_spec()
    swa = spec.group("swa")
    assert swa.kind is CacheGroupKind.SLIDING_WINDOW and swa.bytes_per_row == 528 and swa.window == 128
    assert spec.group("compressed_c2").bytes_per_row == 288 and spec.group("index_k_c1").bytes_per_row == 68
    assert spec.group("compressor_c2").bytes_per_row == 4096
    assert spec.group("compressed_c2").layer_ids == (2, 8, 14) and spec.group("compressed_c1").layer_ids == (20,)
    assert spec.group("dspark_swa").layer_ids == (40, 41, 42)


def test_tiny_cache_groups_follow_the_layer_roles() -> None:
    model = DeepseekV41ForCausalLM(tiny_config(), engram_vocab=tiny_vocab(), max_backtracking_tokens=3)
    spec = model.cache_spec()
    assert spec.group("swa").layer_ids == tuple(range(7))
    assert spec.group("compressed_c2").layer_ids == (1,)
    assert spec.group("index_k_c2").layer_ids == (1,)
    assert spec.group("compressor_c2").rows_per_request() == 2 + 3 - 1
    assert spec.group("compressed_c1").layer_ids == (4,)
    assert spec.max_backtracking_tokens == 3
    fp32 = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.FP32, tiny_vocab()).cache_spec()
    assert fp32.group("swa").bytes_per_row == 4 * tiny_config().text.head_dim


def test_load_weights_is_strict() -> None:
    weights = tiny_weights()
    model = DeepseekV41ForCausalLM(tiny_config(), engram_vocab=tiny_vocab())
    model.load_weights((f"model.{name}", tensor) for name, tensor in weights.items())
    assert torch.equal(
        model.layers[1].attn.wq_a.weight.view(torch.uint8), weights["layers.1.attn.wq_a.weight"].view(torch.uint8)
    )
    missing = {k: v for k, v in weights.items() if k != "layers.2.ffn.experts.3.w3.scale"}
    with pytest.raises(ValueError, match=r"not loaded.*experts\.w13\.scale shard \(3, 1\)"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match="match no parameter"):
        model.load_weights([*weights.items(), ("layers.0.attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="given twice"):
        model.load_weights([*weights.items(), ("norm.weight", weights["norm.weight"])])
    with pytest.raises(TypeError, match="dtype"):
        model.load_weights([(k, v.float() if k == "norm.weight" else v) for k, v in weights.items()])
    with pytest.raises(ValueError, match="folded"):
        model.load_weights([("layers.0.hc_attn_norm.weight", torch.zeros(1))])
    skipped = [
        ("vision.norm.weight", torch.zeros(1)),
        ("image_start", torch.zeros(1)),
        ("mtp.0.head.weight", torch.zeros(1)),
    ]
    model.load_weights([*weights.items(), *skipped])


def test_rejects_unsupported_settings() -> None:
    with pytest.raises(ValueError, match="max_backtracking_tokens"):
        DeepseekV41ForCausalLM(tiny_config(), max_backtracking_tokens=0)


def test_checkpoint_directory_to_model_end_to_end(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from deepinfer_model import reference as ref
    from deepinfer_model.checkpoint.writer import write_checkpoint
    from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
    from deepinfer_model.forward_batch import ForwardBatch
    from deepinfer_model.loading.load import load_checkpoint_dir

    directory = write_checkpoint(tiny_config(), tmp_path, seed=4, max_shard_bytes=5_000_000)
    checkpoint = load_checkpoint_dir(directory)
    vocab = engram_vocab_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    model = DeepseekV41ForCausalLM(checkpoint.config, ComputeMode.FP32, vocab)
    model.load_weights(checkpoint.tensors.items())
    ids = torch.arange(3, 40) * 7 % checkpoint.config.text.vocab_size
    state = model.allocate_state(block_size=16, num_blocks=3, num_state_slots=1)
    batch = ForwardBatch.for_requests([ids.tolist()], [0], torch.arange(3, dtype=torch.int32)[None, :], [0])
    batch = ForwardBatch(**{**batch.__dict__, "logits_indices": torch.tensor([0, 36])})
    with torch.no_grad():
        logits = model(batch, state)
    vocabulary = ref.EngramVocabulary(vocab.old_to_new, vocab.num_compressed, vocab.pad_id)
    expected = ref.reference_forward(checkpoint.config, checkpoint.tensors, ids, vocabulary, precision="fp32")
    assert logits.shape == (2, checkpoint.config.text.vocab_size)
    assert (logits - expected[[0, 36]]).abs().max() <= 1e-5 * expected.abs().max()
