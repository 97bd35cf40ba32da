"""Shared helpers of the layered-model tests: random stored-format tiny checkpoints and step builders."""

from __future__ import annotations

import itertools
from functools import cache

import torch
from torch import nn

from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.checkpoint.writer import tensor_pair
from deepinfer_model.config import ModelConfig, load_preset
from deepinfer_model.deepseek_v41.engram import EngramVocab
from deepinfer_model.deepseek_v41.engram_vocab import engram_vocab_from_tokenizer
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.loading.catalogue import TensorFormat, build_catalogue


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint writer's random value of every text-model tensor, by HF name, stored formats."""
    weights: dict[str, torch.Tensor] = {}
    for entry in build_catalogue(config):
        if entry.format is not TensorFormat.SCALE and not entry.name.startswith(("vision.", "aligner.")):
            weights.update(tensor_pair(entry, config, seed))
    return weights


@cache
def tiny_config() -> ModelConfig:
    return load_preset("tiny")


@cache
def tiny_weights() -> dict[str, torch.Tensor]:
    return random_weights(tiny_config())


@cache
def tiny_vocab() -> EngramVocab:
    return engram_vocab_from_tokenizer(build_tokenizer(tiny_config()))


def tiny_model(mode: ComputeMode, max_backtracking_tokens: int = 6) -> DeepseekV41ForCausalLM:
    model = DeepseekV41ForCausalLM(tiny_config(), mode, tiny_vocab(), max_backtracking_tokens=max_backtracking_tokens)
    model.load_weights(tiny_weights().items())
    return model


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    """Random token ids ``[length]`` int64 of the tiny vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny_config().text.vocab_size, (length,), generator=generator)


def chunk_batch(
    ids: torch.Tensor, start: int, end: int, block_table: torch.Tensor, slot: int, max_ngram: int = 3
) -> ForwardBatch:
    """One request computing positions ``start … end − 1`` of ``ids``, with its Engram prefix."""
    before = ids[max(0, start - (max_ngram - 1)) : start].tolist()
    prefix = [-1] * (max_ngram - 1 - len(before)) + before
    return ForwardBatch.for_requests(
        [ids[start:end].tolist()], [start], block_table, [slot], engram_prefix_ids=torch.tensor([prefix])
    )


def run_chunks(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor, bounds: list[int], block_size: int = 8, num_blocks: int = 32
) -> torch.Tensor:
    """Feed ``ids`` in the chunks ``bounds[i] … bounds[i+1]`` into a fresh state; returns all logits ``[n, V]``."""
    state = model.allocate_state(block_size=block_size, num_blocks=num_blocks, num_state_slots=1)
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    outs = []
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            outs.append(model(chunk_batch(ids, start, end, table, 0), state))
    return torch.cat(outs)


PREFIX = "layers.0.ffn."


def layer0_moe(local_experts: tuple[int, ...], mode: ComputeMode = ComputeMode.EXACT) -> nn.Module:
    """A module tree whose only block is ``layers.0.ffn``, so checkpoint names map onto it unchanged."""
    t = tiny_config().text
    moe = MoE(
        t.hidden_size,
        t.moe_intermediate_size,
        t.n_routed_experts,
        t.num_experts_per_tok,
        t.n_shared_experts,
        t.routed_scaling_factor,
        t.swiglu_limit,
        mode,
        local_experts=local_experts,
    )
    block = nn.Module()
    block.ffn = moe
    root = nn.Module()
    root.layers = nn.ModuleList([block])
    return root


def layer0_weights() -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in tiny_weights().items() if name.startswith(PREFIX)}
