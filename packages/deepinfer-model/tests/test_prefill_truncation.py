"""YOCO prefill truncation on the tiny preset (window 64, consumer layers 4-6, DSpark targets 5 and 6).

``mask`` equals the reference oracle's mask rule; ``compact`` equals ``mask`` on every kept query, with and without
chunked prefill, and decodes the same tokens afterwards (its consumer window keys and DSpark context keys cover what
later queries read) while its consumer layers compute fewer rows; a prompt within ``KEEP`` is not truncated at all.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from _layered_model_support import chunk_batch, prompt, tiny_config, tiny_vocab, tiny_weights

from deepinfer_model import reference as ref
from deepinfer_model.checkpoint.tokenizer import build_tokenizer
from deepinfer_model.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer_model.deepseek_v41.truncation import PrefillTruncation
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

KEEP = 70  # the least the tiny preset allows: window 64 + 6 backtracking tokens
NUM_BLOCKS = 24
BLOCK_SIZE = 8


def _model(mode: ComputeMode, truncation: str, keep: int = KEEP) -> DeepseekV41ForCausalLM:
    setting = PrefillTruncation(truncation, keep if truncation != "off" else 0)
    model = DeepseekV41ForCausalLM(tiny_config(), mode, tiny_vocab(), prefill_truncation=setting)
    model.load_weights(tiny_weights().items())
    return model


def _run(
    model: DeepseekV41ForCausalLM, ids: torch.Tensor, bounds: list[int], decode: int = 0
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill ``ids`` in the chunks given by ``bounds`` (every row's logits, each chunk's ``[rows, V]``), then
    ``decode`` greedy tokens; returns the chunk logits and the decoded tokens."""
    state = model.allocate_state(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_state_slots=1)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :]
    known = [len(ids)]
    chunks = []
    with torch.no_grad():
        for start, end in itertools.pairwise(bounds):
            batch = dataclasses.replace(
                chunk_batch(ids, start, end, table, 0), known_lens=torch.tensor(known, dtype=torch.int32)
            )
            chunks.append(model(batch, state))
        tokens = ids.tolist()
        for _ in range(decode):
            tokens.append(int(chunks[-1][-1].argmax()))
            position = len(tokens) - 1
            step = dataclasses.replace(
                chunk_batch(torch.tensor(tokens), position, position + 1, table, 0),
                known_lens=torch.tensor([len(tokens)], dtype=torch.int32),
            )
            chunks.append(model(step, state))
    return chunks, tokens[len(ids) :]


def _kept_positions(start: int, end: int, rect_lo: int) -> list[int]:
    """Positions of a chunk ``start … end − 1`` the consumer half computes under ``compact``."""
    return list(range(min(max(start, rect_lo), end - 1), end))


def _max_relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_mask_matches_the_reference_mask_rule() -> None:
    ids = prompt(130, seed=21)
    chunks, _ = _run(_model(ComputeMode.FP32, "mask"), ids, [0, 130])
    vocabulary = ref.engram_vocabulary_from_tokenizer(build_tokenizer(tiny_config()))
    expected = ref.reference_forward_full(
        tiny_config(), tiny_weights(), ids, vocabulary, precision="fp32", yoco_keep_tokens=KEEP
    ).logits
    assert _max_relative(chunks[0], expected) < 1e-5
    off = ref.reference_forward_full(tiny_config(), tiny_weights(), ids, vocabulary, precision="fp32").logits
    # An approximation: windows reaching below rect_lo change, and through later consumer layers' window keys
    # every row after them.
    assert _max_relative(expected, off) > 1e-3


@pytest.mark.parametrize("mode", [ComputeMode.FP32, ComputeMode.EXACT])
@pytest.mark.parametrize("bounds", [[0, 130], [0, 41, 97, 130], [0, 50, 129, 130]])
def test_compact_equals_mask_on_kept_queries(mode: ComputeMode, bounds: list[int]) -> None:
    ids = prompt(130, seed=22)
    masked, masked_tokens = _run(_model(mode, "mask"), ids, bounds, decode=4)
    compact_model = _model(mode, "compact")
    compacted, compact_tokens = _run(compact_model, ids, bounds, decode=4)
    rect_lo = 130 - KEEP
    for (start, end), full, kept in zip(itertools.pairwise(bounds), masked, compacted, strict=False):
        rows = [p - start for p in _kept_positions(start, end, rect_lo)]
        assert kept.shape[0] == len(rows)
        # Row counts differ, so GEMM summation orders may too; FP32 agrees to rounding, exact mode to a rare
        # last-bit flip of a BF16 rounding.
        assert _max_relative(kept, full[rows]) < (1e-5 if mode is ComputeMode.FP32 else 1e-3)
        assert torch.equal(kept.argmax(-1), full[rows].argmax(-1))
    assert compact_tokens == masked_tokens
    for full, kept in zip(masked[-4:], compacted[-4:], strict=True):
        assert _max_relative(kept, full) < (1e-5 if mode is ComputeMode.FP32 else 1e-3)


def test_prompt_within_keep_is_not_truncated() -> None:
    ids = prompt(KEEP, seed=23)
    off, off_tokens = _run(_model(ComputeMode.FP32, "off"), ids, [0, 33, KEEP], decode=2)
    for truncation in ("mask", "compact"):
        logits, tokens = _run(_model(ComputeMode.FP32, truncation), ids, [0, 33, KEEP], decode=2)
        assert all(torch.equal(a, b) for a, b in zip(logits, off, strict=True))
        assert tokens == off_tokens


def test_compact_computes_fewer_consumer_rows() -> None:
    ids = prompt(130, seed=24)
    counts = {}
    for truncation in ("off", "mask", "compact"):
        model = _model(ComputeMode.FP32, truncation)
        _run(model, ids, [0, 41, 97, 130])
        counts[truncation] = model.consumer_layer_rows
    # Three consumer layers; compact keeps positions 60 … 129 plus the placeholder last token of chunk 0 … 40.
    assert counts["off"] == counts["mask"] == 3 * 130
    assert counts["compact"] == 3 * (1 + 70)


def test_compact_refuses_logits_of_dropped_tokens() -> None:
    model = _model(ComputeMode.FP32, "compact")
    ids = prompt(130, seed=25)
    state = model.allocate_state(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, num_state_slots=1)
    table = torch.arange(NUM_BLOCKS, dtype=torch.int32)[None, :]
    batch = dataclasses.replace(
        ForwardBatch.for_requests([ids.tolist()], [0], table, [0], known_lens=[130]),
        logits_indices=torch.tensor([10, 129]),
    )
    with pytest.raises(ValueError, match=r"logits of tokens \[10\].*dropped"), torch.no_grad():
        model(batch, state)
    with torch.no_grad():  # no known lengths: nothing to truncate, every row computed
        assert model(ForwardBatch.for_requests([ids.tolist()], [0], table, [0]), state).shape[0] == 130


def test_settings_the_model_cannot_run_are_refused() -> None:
    text = tiny_config().text
    with pytest.raises(ValueError, match=r"mode='trim' is not a YOCO prefill truncation mode; allowed: 'off', 'mask'"):
        PrefillTruncation("trim", 100)
    with pytest.raises(ValueError, match=r"keep_tokens=0 must be > 0 when mode='mask'"):
        PrefillTruncation("mask", 0)
    with pytest.raises(
        ValueError, match=r"keep_tokens=69 is below sliding_window \(64\) \+ max backtracking tokens \(6\) = 70"
    ):
        PrefillTruncation("compact", 69).check(text, 6)
    PrefillTruncation("compact", 70).check(text, 6)
    with pytest.raises(ValueError, match=r"= 73"):
        DeepseekV41ForCausalLM(
            tiny_config(), max_backtracking_tokens=9, prefill_truncation=PrefillTruncation("mask", 72)
        )
    no_consumers = dataclasses.replace(text, compress_ratios=(0, 2, 2, 0, 2, 2, 2, 1))
    with pytest.raises(ValueError, match="needs a model with YOCO consumer layers"):
        PrefillTruncation("mask", 100).check(no_consumers, 6)
    straddling = dataclasses.replace(text, dspark_target_layer_ids=(3, 5))
    PrefillTruncation("mask", 100).check(straddling, 6)
    with pytest.raises(ValueError, match=r"DSpark target layers \[3, 5\] on one side"):
        PrefillTruncation("compact", 100).check(straddling, 6)
    with pytest.raises(ValueError, match=r"Engram layers \[5\] are consumers"):
        PrefillTruncation("compact", 100).check(dataclasses.replace(text, engram_layer_ids=(0, 5)), 6)


def test_requests_of_one_step_are_truncated_by_their_own_known_lengths() -> None:
    # Request 0: the middle chunk 41 … 96 of a 130-token prompt (rect_lo 60); request 1: a 40-token prompt (never
    # truncated); request 2: a decode token after a 100-token prompt (never truncated). Each must equal running
    # alone under mask.
    long, short, decoded = prompt(130, seed=26), prompt(40, seed=27), prompt(101, seed=28)
    model = _model(ComputeMode.FP32, "compact")
    alone_long, _ = _run(_model(ComputeMode.FP32, "mask"), long, [0, 41, 97])
    alone_short, _ = _run(_model(ComputeMode.FP32, "mask"), short, [0, 40])
    alone_decoded, _ = _run(_model(ComputeMode.FP32, "mask"), decoded, [0, 100, 101])
    state = model.allocate_state(block_size=BLOCK_SIZE, num_blocks=3 * NUM_BLOCKS, num_state_slots=3)
    table = torch.arange(3 * NUM_BLOCKS, dtype=torch.int32).reshape(3, NUM_BLOCKS)
    with torch.no_grad():
        model(dataclasses.replace(chunk_batch(long, 0, 41, table[:1], 0), known_lens=torch.tensor([130])), state)
        model(dataclasses.replace(chunk_batch(decoded, 0, 100, table[2:], 2), known_lens=torch.tensor([101])), state)
        prefixes = torch.tensor([long[39:41].tolist(), [-1, -1], decoded[98:100].tolist()])
        step = ForwardBatch.for_requests(
            [long[41:97].tolist(), short.tolist(), decoded[100:].tolist()],
            [41, 0, 100],
            table,
            [0, 1, 2],
            prefixes,
            known_lens=[130, 40, 101],
        )
        logits = model(step, state)
    kept = [p - 41 for p in _kept_positions(41, 97, 60)]
    assert logits.shape[0] == len(kept) + 40 + 1
    assert _max_relative(logits[: len(kept)], alone_long[1][kept]) < 1e-5
    assert _max_relative(logits[len(kept) : -1], alone_short[0]) < 1e-5
    assert _max_relative(logits[-1:], alone_decoded[1]) < 1e-5
