"""Shared pieces of the context-parallel model tests: the step schedule (three requests, two prefill steps with
uneven and short chunks and cached history, then greedy decode steps) and a dump of every cache row."""

from __future__ import annotations

import torch
from _layered_model_support import prompt, tiny_config

from deepinfer_model.cache_spec import CacheGroupKind
from deepinfer_model.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.state import ModelState

# Per step: (request, first position, end position). Lengths 37 / 6 / 2, then 43 more of request 0 past the 64-token
# window, one decode token of request 1 and 11 more of request 2.
PREFILL = [[(0, 0, 37), (1, 0, 6), (2, 0, 2)], [(0, 37, 80), (1, 6, 7), (2, 2, 13)]]
DECODE_STEPS = 3
_PAGES_PER_REQUEST = 16
_BLOCK_SIZE = 8

Schedule = tuple[list[torch.Tensor], list[list[int]], list[int], dict[tuple[str, int], torch.Tensor]]


def _prompts(seed: int) -> list[torch.Tensor]:
    return [prompt(80, seed), prompt(7, seed + 1), prompt(13, seed + 2)]


def _batch(
    tokens: list[list[int]], starts: list[int], history: list[list[int]], device: torch.device, last_only: bool
) -> ForwardBatch:
    """Requests 0..2 computing ``tokens[r]`` from ``starts[r]`` (``history[r]``: their earlier tokens); logits of
    every token, or of each request's last token."""
    keep = (tiny_config().text.engram_max_ngram_size or 1) - 1
    prefix = [[-1] * (keep - len(h[-keep:])) + h[-keep:] for h in history]
    table = torch.arange(3 * _PAGES_PER_REQUEST, dtype=torch.int32).view(3, _PAGES_PER_REQUEST)
    batch = ForwardBatch.for_requests(tokens, starts, table, [0, 1, 2], engram_prefix_ids=torch.tensor(prefix))
    assert batch.engram_prefix_ids is not None
    return ForwardBatch(
        input_ids=batch.input_ids.to(device),
        positions=batch.positions.to(device),
        cu_query_lens=batch.cu_query_lens.to(device),
        context_lens=batch.context_lens.to(device),
        block_table=batch.block_table.to(device),
        state_slots=batch.state_slots.to(device),
        engram_prefix_ids=batch.engram_prefix_ids.to(device),
        logits_indices=(batch.cu_query_lens[1:].long() - 1).to(device) if last_only else None,
        max_query_len=batch.max_query_len,
        max_context_len=batch.max_context_len,
    )


def _cache_contents(state: ModelState, device: torch.device) -> dict[tuple[str, int], torch.Tensor]:
    """Every row of every cache pool, decoded: (group, layer) → [rows, width] fp32 on the CPU."""
    contents = {}
    for group in state.spec.groups:
        if group.kind is CacheGroupKind.PAGED:
            num_rows = 3 * _PAGES_PER_REQUEST * state.rows_per_block(group.name)
        else:
            num_rows = 3 * state.ring_size(group.name)
        for layer in group.layer_ids:
            contents[group.name, layer] = state.read(group.name, layer, torch.arange(num_rows, device=device)).cpu()
    return contents


def run_schedule(model: DeepseekV41ForCausalLM, seed: int, device: str = "cpu") -> Schedule:
    """Run the schedule on ``device`` (the model must be there).

    Returns:
        (logits of every step on the CPU — every token of a prefill step, the last token of each request in a
        decode step —, greedy tokens of each request, rows the first layer's attention computed in each step, every
        cache row after the prefill steps).
    """
    where = torch.device(device)
    prompts = _prompts(seed)
    state = model.allocate_state(_BLOCK_SIZE, 3 * _PAGES_PER_REQUEST, 3, where)
    rows: list[int] = []
    handle = model.layers[0].attn.register_forward_hook(lambda _m, args, _o: rows.append(int(args[0].shape[0])))
    sequences: list[list[int]] = [[], [], []]
    outputs: list[torch.Tensor] = []
    greedy: list[list[int]] = [[], [], []]
    with torch.no_grad():
        for step in PREFILL:
            tokens = [prompts[r][start:end].tolist() for r, start, end in step]
            batch = _batch(tokens, [start for _, start, _ in step], sequences, where, last_only=False)
            outputs.append(model(batch, state).cpu())
            for r, _, end in step:
                sequences[r] = prompts[r][:end].tolist()
        contents = _cache_contents(state, where)
        last = batch.cu_query_lens[1:].long().cpu() - 1
        for _ in range(DECODE_STEPS):
            picks = outputs[-1][last].argmax(dim=-1).tolist()
            batch = _batch([[t] for t in picks], [len(s) for s in sequences], sequences, where, last_only=True)
            outputs.append(model(batch, state).cpu())
            last = torch.arange(3)
            for r, token in enumerate(picks):
                greedy[r].append(token)
                sequences[r].append(token)
    handle.remove()
    return outputs, greedy, rows, contents
