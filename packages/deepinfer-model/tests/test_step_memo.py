"""Step-invariant index math built once per step (``StepMemo``; docs/design/attention.md, "Step-invariant index
math"): the memo builds a key once and keys apart what differs, a replaced metadata starts empty, and whole steps
with the memo give bitwise the logits, draft hiddens and cache bytes of steps that build every value per use (per
layer, as before the memo) — on steps where layers differ in what the keys name: YOCO consumer layers with a window
floor beside layers without, two compress ratios, two RoPE tables, window and compressor rings of different sizes,
the ``compact`` consumer half with its own metadata, and a DSpark draft step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from _layered_model_support import prompt, tiny_config, tiny_vocab, tiny_weights

from deepinfer_model.deepseek_v41.context import StepContext
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.truncation import Compaction, PrefillTruncation
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.state import ModelState, StepMemo, StepMetadata

NUM_BLOCKS = 40
BLOCK_SIZE = 8
KEEP = 70  # the least YOCO truncation allows on the tiny preset: window 64 + 6 backtracking tokens


def test_memo_builds_each_key_once_and_forgets_on_clear() -> None:
    memo = StepMemo()
    calls: list[Hashable] = []

    def build(key: Hashable) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            calls.append(key)
            return torch.tensor([len(calls)])

        return run

    first = memo.get(("rows", 4), build(("rows", 4)))
    assert memo.get(("rows", 4), build(("rows", 4))) is first
    other = memo.get(("rows", 8), build(("rows", 8)))
    assert other is not first and calls == [("rows", 4), ("rows", 8)]
    memo.clear()
    assert memo.get(("rows", 4), build(("rows", 4))) is not first and len(calls) == 3


def _chunk_meta() -> StepMetadata:
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    return StepMetadata.from_batch(ForwardBatch.for_requests([[1, 2, 3], [4, 5, 6]], [10, 20], table, [0, 1]))


def test_replaced_metadata_starts_empty() -> None:
    meta = _chunk_meta()
    rows, _ = meta.ring_tail(5)
    assert meta.ring_tail(5)[0] is rows
    replaced = dataclasses.replace(meta, window_floor=meta.q_start)
    assert replaced.ring_tail(5)[0] is not rows and torch.equal(replaced.ring_tail(5)[0], rows)


def test_the_consumer_half_of_a_compact_step_starts_an_empty_context_memo() -> None:
    meta = _chunk_meta()
    kept = dataclasses.replace(meta, floor_stores=True)
    compaction = Compaction(kept, torch.arange(meta.num_tokens), torch.arange(meta.num_tokens))
    state = DeepseekV41ForCausalLM(tiny_config()).allocate_state(block_size=BLOCK_SIZE, num_blocks=6, num_state_slots=2)
    ctx = StepContext.for_step(meta, state, compaction=compaction)
    rows = ctx.memo.get(("window_rows", 5), lambda: meta.positions + 1)
    ctx.enter_consumer_half()
    assert ctx.meta is kept and ctx.memo.get(("window_rows", 5), lambda: kept.positions + 2) is not rows


def test_ring_tail_of_each_ring_size_is_its_own() -> None:
    meta = _chunk_meta()  # 3 tokens per request: rings of 2 keep the last two
    tails = {ring: meta.ring_tail(ring) for ring in (2, 3, 7)}
    for ring in (7, 2, 3):
        rows, keep = meta.ring_tail(ring)
        assert rows is tails[ring][0]
        mask = meta.ring_write_tokens(ring)
        assert torch.equal(rows, meta.ring_rows(meta.token_request[mask], meta.positions[mask], ring))
        if ring < 3:
            assert keep is not None and torch.equal(keep, torch.nonzero(mask).squeeze(1))
        else:
            assert keep is None


def test_ring_write_indices_are_the_mask_s_tokens_on_every_path() -> None:
    """The sync-free indices of a uniform step, and the mask's of a ragged or floored one, name the same tokens."""
    table = torch.arange(9, dtype=torch.int32).view(3, 3)
    uniform = _chunk_meta()
    ragged = StepMetadata.from_batch(
        ForwardBatch.for_requests([[1, 2, 3, 4, 5], [6], [7, 8]], [9, 4, 2], table, [0, 1, 2])
    )
    floored = dataclasses.replace(uniform, window_floor=uniform.q_start + 2, floor_stores=True)
    for meta in (uniform, ragged, floored):
        for ring in (1, 2, 3, 6):
            indices = meta.ring_write_indices(ring)
            assert indices.dtype == torch.int64
            assert torch.equal(indices, torch.nonzero(meta.ring_write_tokens(ring)).squeeze(1)), (meta, ring)


def _model(truncation: str) -> DeepseekV41ForCausalLM:
    setting = PrefillTruncation(truncation, KEEP)
    model = DeepseekV41ForCausalLM(tiny_config(), ComputeMode.EXACT, tiny_vocab(), prefill_truncation=setting)
    model.load_weights(tiny_weights().items())
    return model


def _pools(state: ModelState) -> dict[tuple[str, int], torch.Tensor]:
    return {
        (group.name, layer): state.pool(group.name, layer).clone()
        for group in state.spec.groups
        for layer in group.layer_ids
    }


def _steps(model: DeepseekV41ForCausalLM) -> tuple[list[torch.Tensor], dict[tuple[str, int], torch.Tensor]]:
    """Two requests: one truncated prefill step, two decode steps, a draft step; every output and the cache bytes."""
    text = tiny_config().text
    tokens = [prompt(90, seed=3).tolist(), prompt(77, seed=4).tolist()]
    state = model.allocate_state(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_state_slots=2)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32).view(2, -1)
    lengths = [len(ids) for ids in tokens]
    prefill = ForwardBatch.for_requests(tokens, [0, 0], table, [0, 1], known_lens=lengths)
    batch = dataclasses.replace(prefill, logits_indices=torch.cumsum(torch.tensor(lengths), 0) - 1)
    outputs = []
    with torch.no_grad():
        for _ in range(3):
            logits = model(batch, state)
            outputs.append(logits)
            for ids, token in zip(tokens, logits.argmax(dim=-1).tolist(), strict=True):
                ids.append(token)
            batch = ForwardBatch.for_requests(
                [ids[-1:] for ids in tokens],
                [len(ids) - 1 for ids in tokens],
                table,
                [0, 1],
                engram_prefix_ids=torch.tensor([ids[-3:-1] for ids in tokens]),
            )
        noise = [text.dspark_noise_token_id] * (text.dspark_block_size - 1)
        draft = ForwardBatch.for_requests(
            [[ids[-1], *noise] for ids in tokens], [len(ids) for ids in tokens], table, [0, 1]
        )
        outputs.append(model.draft_forward(draft, state))
    return outputs, _pools(state)


@pytest.mark.parametrize("truncation", ["mask", "compact"])
def test_memoized_steps_equal_per_use_index_math_bitwise(truncation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(truncation)
    asked, built = [0], [0]
    memoized_get = StepMemo.get

    def counting_get(self: StepMemo, key: Hashable, build: Callable[[], Any]) -> Any:
        def counted_build() -> Any:
            built[0] += 1
            return build()

        asked[0] += 1
        return memoized_get(self, key, counted_build)

    monkeypatch.setattr(StepMemo, "get", counting_get)
    shared_outputs, shared_pools = _steps(model)
    assert built[0] < asked[0] / 2  # the layers do share

    def build_every_time(self: StepMemo, key: Hashable, build: Callable[[], Any]) -> Any:
        return build()

    monkeypatch.setattr(StepMemo, "get", build_every_time)
    own_outputs, own_pools = _steps(model)
    for shared, own in zip(shared_outputs, own_outputs, strict=True):
        assert torch.equal(shared, own)
    assert shared_pools.keys() == own_pools.keys()
    for name, pool in shared_pools.items():
        assert torch.equal(pool, own_pools[name]), name
