"""Shared helpers of the LLM tests: the tiny checkpoint in a per-session directory, engines, random prompts and the
token-by-token greedy decoding of the single-file reference model."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model_source import tiny_checkpoint_dir
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference import engram_vocabulary_from_tokenizer, reference_forward

VOCAB_SIZE = 1024  # the tiny preset's vocabulary
EOS = 1


def tiny_dir(root: Path) -> Path:
    """The tiny checkpoint written under `root` (once per root)."""
    return tiny_checkpoint_dir(root)


def make_llm(root: Path, **kwargs: Any) -> LLM:
    """A CPU engine over the random tiny checkpoint (or `model=`); small defaults keep each step cheap, and no drafting
    unless `nextn` is given (the tiny checkpoint has DSpark blocks, so `LLM` alone would draft 5 tokens per step)."""
    settings: dict[str, Any] = {
        "device": "cpu",
        "max_num_seqs": 8,
        "block_size": 16,
        "num_cache_blocks": 256,
        "nextn": 0,
    }
    settings.update(kwargs)
    model = settings.pop("model", "tiny")  # default: the random tiny checkpoint in `root`
    return LLM(model, cache_dir=str(root), **settings)


def tokens_by_params(
    llm: LLM, prompts: list[list[int]], params: dict[str, SamplingParams]
) -> dict[str, list[tuple[int, ...]]]:
    """Each named sampling setting's generated tokens for `prompts` (one `generate` call per setting, in order)."""
    tokens = {}
    for name, setting in params.items():
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=setting, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == [tuple(p) for p in prompts]
        tokens[name] = [tuple(o.token_ids) for o in outputs]
    return tokens


def random_prompts(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Token-id prompts of random lengths (ids >= 3 keep BOS/EOS/PAD out)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


def reference_greedy(root: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by re-running the FP32 reference on the growing sequence (no EOS stop)."""
    directory = tiny_dir(root)
    checkpoint = load_checkpoint_dir(directory)
    vocabulary = engram_vocabulary_from_tokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
    results = []
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(max_tokens):
            logits = reference_forward(
                checkpoint.config, checkpoint.tensors, torch.tensor(sequence), vocabulary, precision="fp32"
            )
            sequence.append(int(logits[-1].argmax()))
        results.append(sequence[len(prompt) :])
    return results
