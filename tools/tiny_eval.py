"""Teacher-forced checks of a tiny checkpoint during training (the engine-level evaluation is ``benchmarks/eval.py``).

Greedy generation of a prompt returns its answer exactly when, feeding prompt + answer + "\\n" once, the argmax at
every answer position is the next answer token; one forward per item therefore gives the greedy exact match. The
DSpark estimate walks each answer as the engine would at temperature 0 with ``num_slots`` drafts a step: from the
last accepted position, draft greedily (Markov head fed the previous draft), accept the prefix that matches the
target's tokens, emit one more token; the mean tokens per step is the acceptance length.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from deepinfer_model import reference as ref
from deepinfer_model import reference_dspark as ref_dspark
from deepinfer_model.config import ModelConfig
from deepinfer_model.loading.load import load_checkpoint_dir
from deepinfer_model.reference import Precision, WeightSource


def _item_ids(tokenizer: Tokenizer, bos: int, prompt: str, answer: str) -> tuple[list[int], int]:
    prompt_ids = [bos, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    return prompt_ids + tokenizer.encode(answer + "\n", add_special_tokens=False).ids, len(prompt_ids)


def _accepted_walk(drafts: torch.Tensor, truth: torch.Tensor, first: int, end: int) -> list[int]:
    """Tokens emitted per step: drafts ``[n, B]`` made after each position, ``truth[t]`` = token at ``t``."""
    emitted = []
    position = first  # last accepted position p*; the token at p* + 1 is emitted by the step before
    while position + 1 < end:
        accepted = 0
        for k in range(drafts.shape[1]):
            target_position = position + 2 + k
            if target_position >= end or int(drafts[position, k]) != int(truth[target_position]):
                break
            accepted += 1
        emitted.append(1 + accepted)
        position += 1 + accepted
    return emitted


def _greedy_drafts(
    config: ModelConfig,
    weights: WeightSource | Mapping[str, torch.Tensor],
    features: torch.Tensor,
    ids: torch.Tensor,
    first: int,
    num_slots: int,
    precision: Precision,
) -> torch.Tensor:
    """Greedy drafts ``[n, B]`` after every position ``p* ≥ first`` (rows before ``first`` are −1)."""
    n = ids.shape[0]
    last = torch.arange(first, n - 1)
    hidden = ref_dspark.reference_dspark_forward_anchors(
        config, weights, features, last, ids[last + 1], num_slots, precision=precision
    )
    previous = ids[last + 1]
    drafts = torch.full((n, num_slots), -1, dtype=torch.int64)
    for k in range(num_slots):
        logits, _ = ref_dspark.reference_dspark_heads(config, weights, hidden[:, k], previous, precision=precision)
        previous = logits.argmax(-1)
        drafts[last, k] = previous
    return drafts


def evaluate(
    config: ModelConfig,
    weights: WeightSource | Mapping[str, torch.Tensor],
    tokenizer: Tokenizer,
    vocab: ref.EngramVocabulary,
    samples: Sequence,
    per_task: int,
    precision: Precision,
    num_slots: int = 4,
) -> dict[str, float]:
    """Greedy exact match per task and the DSpark acceptance length on up to ``per_task`` items of each task."""
    correct: dict[str, list[bool]] = defaultdict(list)
    emitted: list[int] = []
    with torch.no_grad():
        for sample in samples:
            if len(correct[sample.task]) >= per_task:
                continue
            ids_list, prompt_len = _item_ids(tokenizer, config.bos_token_id, sample.prompt, sample.answer)
            ids = torch.tensor(ids_list)
            out = ref.reference_forward_full(config, weights, ids, vocab, precision=precision)
            greedy = out.logits.argmax(-1)
            correct[sample.task].append(bool((greedy[prompt_len - 1 : -1] == ids[prompt_len:]).all()))
            if config.text.num_nextn_predict_layers > 0:
                truth = torch.cat([ids[:1], greedy[:-1]])  # truth[t]: the target's greedy token for position t
                drafts = _greedy_drafts(config, weights, out.target_features, ids, prompt_len - 1, num_slots, precision)
                emitted += _accepted_walk(drafts, truth, prompt_len - 1, ids.shape[0])
    report = {task: sum(v) / len(v) for task, v in sorted(correct.items())}
    report["dspark_tokens_per_step"] = sum(emitted) / max(1, len(emitted))
    return report


def evaluate_values(
    config: ModelConfig,
    weights: WeightSource,
    tokenizer: Tokenizer,
    vocab: ref.EngramVocabulary,
    samples: Sequence,
    per_task: int,
) -> dict[str, float]:
    """``evaluate`` on FP32 values in fp32 precision."""
    return evaluate(config, weights, tokenizer, vocab, samples, per_task, "fp32")


def evaluate_checkpoint(
    directory: Path, tokenizer: Tokenizer, samples: Sequence, per_task: int, device: str
) -> dict[str, float]:
    """``evaluate`` on a written checkpoint's stored tensors with the release numerics (exact precision)."""
    with torch.device("cpu"):  # the loader reads into CPU tensors
        checkpoint = load_checkpoint_dir(directory)
    tensors = {name: tensor.to(device) for name, tensor in checkpoint.tensors.items()}
    vocab = ref.engram_vocabulary_from_tokenizer(tokenizer)
    return evaluate(checkpoint.config, tensors, tokenizer, vocab, samples, per_task, "exact")
