"""The writer's initialisation keeps a real forward O(1): tiny checkpoint → loader → single-file reference model."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer_model.checkpoint.tokenizer import corpus_text
from deepinfer_model.checkpoint.writer import write_checkpoint
from deepinfer_model.config import load_preset
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference import engram_vocabulary_from_tokenizer, reference_forward_full


def test_tiny_checkpoint_forward_stays_order_one(tmp_path: Path) -> None:
    directory = write_checkpoint(load_preset("tiny"), tmp_path / "tiny", seed=1)
    checkpoint = load_checkpoint_dir(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    token_ids = torch.tensor(tokenizer.encode(corpus_text()).ids[:256])
    assert token_ids.numel() == 256
    out = reference_forward_full(
        checkpoint.config, checkpoint.tensors, token_ids, engram_vocabulary_from_tokenizer(tokenizer)
    )
    assert out.logits.shape == (256, 1024) and bool(torch.isfinite(out.logits).all())
    assert 0.3 < out.logits.std().item() < 3.0
    assert 0.3 < out.hidden.float().std().item() < 10.0
