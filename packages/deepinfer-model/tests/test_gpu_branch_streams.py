"""The model's branch streams on CUDA (``branch_streams``; docs/design/kernels.md, "Branch streams"): the shared
expert, the window keys and the next block's Engram projection run on the side stream, and the logits are bitwise
those of the model without it — an eager prefill of mixed prompts, an eager decode step, a decode step captured
in a CUDA graph and replayed, and the DSpark drafter's forward."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_model

from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = 16
LENGTHS = (5, 19, 33)


def _cuda(batch: ForwardBatch) -> ForwardBatch:
    moved = {
        field.name: value.cuda()
        for field in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, field.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)


def _steps(model: DeepseekV41ForCausalLM) -> tuple[ForwardBatch, ForwardBatch]:
    """A prefill of three prompts, then one decode step of the three requests."""
    ngram = model.config.text.engram_max_ngram_size or 1
    prompts = [prompt(length + 1, seed=length) for length in LENGTHS]
    width = -(-(max(LENGTHS) + 2) // BLOCK)
    table = torch.arange(1, len(LENGTHS) * width + 1, dtype=torch.int32).view(len(LENGTHS), width)
    slots = list(range(len(LENGTHS)))
    prefill = ForwardBatch.for_requests([p[:-1].tolist() for p in prompts], [0] * len(LENGTHS), table, slots)
    prefix = torch.stack([p[-ngram:-1] for p in prompts])
    decode = ForwardBatch.for_requests([[int(p[-1])] for p in prompts], list(LENGTHS), table, slots, prefix)
    return _cuda(prefill), _cuda(decode)


@contextmanager
def _streams_seen(model: DeepseekV41ForCausalLM) -> Iterator[dict[str, set[int]]]:
    """Record the CUDA stream each forked branch kind ran on."""
    seen: dict[str, set[int]] = {"shared expert": set(), "window keys": set(), "engram": set()}
    block = next(b for b in model.layers if b.engram is not None and b.ffn.shared_experts is not None)
    targets: list[tuple[Any, str, str]] = [
        (block.ffn.shared_experts, "forward", "shared expert"),
        (block.attn, "_window_kv", "window keys"),
        (block.engram, "project", "engram"),
    ]

    def observed(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen[kind].add(torch.cuda.current_stream().cuda_stream)
            return fn(*args, **kwargs)

        return wrapped

    for owner, name, kind in targets:
        setattr(owner, name, observed(getattr(owner, name), kind))
    try:
        yield seen
    finally:
        for owner, name, _ in targets:
            delattr(owner, name)


def _run(model: DeepseekV41ForCausalLM, streams: bool, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model.branch_streams = streams
    prefill, decode = _steps(model)
    width = prefill.block_table.shape[1]
    state = model.allocate_state(BLOCK, len(LENGTHS) * width + 1, len(LENGTHS), device="cuda")
    with torch.inference_mode():
        prefilled = model(prefill, state).clone()
        if not graph:
            return prefilled, model(decode, state).clone()
        model(decode, state)  # warm-up: the decode step writes the same rows each time
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            logits = model(decode, state)
        captured.replay()
        torch.cuda.synchronize()
        return prefilled, logits.clone()


def test_branch_streams_run_on_the_side_stream_and_keep_the_bits() -> None:
    model = tiny_model(ComputeMode.EXACT).cuda()
    main = torch.cuda.current_stream().cuda_stream
    off = _run(model, False, graph=False)
    assert torch.equal(_run(model, False, graph=False)[1], off[1])  # a run repeats bit for bit
    with _streams_seen(model) as seen:
        on = _run(model, True, graph=False)
    for kind, streams in seen.items():
        assert streams and main not in streams, kind
    assert torch.equal(on[0], off[0])
    assert torch.equal(on[1], off[1])


def test_a_captured_decode_step_with_branch_streams_keeps_the_bits() -> None:
    model = tiny_model(ComputeMode.EXACT).cuda()
    _, off = _run(model, False, graph=True)
    _, on = _run(model, True, graph=True)
    assert torch.equal(on, off)


def test_the_drafter_with_branch_streams_keeps_the_bits() -> None:
    """The DSpark draft forward runs the same sites in its blocks: its hidden states and draft logits are bitwise
    those without branch streams."""
    text = tiny_config().text
    model = tiny_model(ComputeMode.EXACT).cuda()
    ids = prompt(40, seed=12).tolist()
    table = torch.arange(11, dtype=torch.int32)[None, :]
    anchor_block = [17] + [text.dspark_noise_token_id] * (text.dspark_block_size - 1)

    def draft(streams: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.branch_streams = streams
        state = model.allocate_state(block_size=8, num_blocks=11, num_state_slots=2, device="cuda")
        with torch.inference_mode():
            model(_cuda(ForwardBatch.for_requests([ids], [0], table, [1])), state)  # writes the context keys
            hidden = model.draft_forward(
                _cuda(ForwardBatch.for_requests([anchor_block], [len(ids)], table, [1])), state
            )
            return hidden.clone(), model.draft_logits(hidden).clone()

    off, on = draft(False), draft(True)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
