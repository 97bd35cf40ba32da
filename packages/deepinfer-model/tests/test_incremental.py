"""Chunked prefill and token-by-token decode equal one full prefill; rollback of up to ``BT`` positions is exact.

The tiny preset covers every layer kind (SWA, C2 source/consumer, C1 source/consumers with candidate blocks, YOCO,
Engram, DSpark context keys). Sequences cross the window (64), odd chunk boundaries split C2 blocks, and decode
positions wrap the SWA ring (``W + BT`` rows) and the C2 state ring.
"""

from __future__ import annotations

import torch
from _layered_model_support import (
    chunk_batch,
    prompt,
    run_chunks,
    tiny_model,
)

from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode


def _max_relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_chunked_prefill_and_decode_equal_full_prefill_fp32() -> None:
    ids = prompt(78, seed=5)
    model = tiny_model(ComputeMode.FP32)
    full = run_chunks(model, ids, [0, 78])
    incremental = run_chunks(model, ids, [0, 29, 52, 67, *range(68, 79)])
    assert _max_relative(incremental, full) < 1e-5


def test_chunked_prefill_and_decode_equal_full_prefill_exact() -> None:
    # Exact mode rounds to BF16 after FP32 GEMMs whose summation order depends on the chunk size, so a rare
    # last-bit flip is allowed; the observed difference is ~1e-7 relative.
    ids = prompt(74, seed=6)
    model = tiny_model(ComputeMode.EXACT)
    full = run_chunks(model, ids, [0, 74])
    incremental = run_chunks(model, ids, [0, 33, 65, *range(66, 75)])
    assert _max_relative(incremental, full) < 1e-3
    assert torch.equal(incremental.argmax(-1), full.argmax(-1))


def test_rollback_then_redecode_equals_never_decoding() -> None:
    backtracking = 3
    model = tiny_model(ComputeMode.FP32, max_backtracking_tokens=backtracking)
    ids = prompt(69, seed=7)
    junk = prompt(backtracking, seed=8)
    table = torch.arange(12, dtype=torch.int32)[None, :]

    def decode_tail(rollback: bool) -> torch.Tensor:
        state = model.allocate_state(block_size=8, num_blocks=12, num_state_slots=1)
        outs = []
        with torch.no_grad():
            model(chunk_batch(ids, 0, 61, table, 0), state)
            if rollback:
                # BT wrong tokens at positions 61 … 63 (a verify batch), then all of them are rolled back.
                wrong = torch.cat([ids[:61], junk])
                model(chunk_batch(wrong, 61, 61 + backtracking, table, 0), state)
            # Re-decode 61 … 68: the SWA ring (64 + 3 rows) and the C2 state ring (2 + 3 − 1 rows) wrap.
            for position in range(61, 69):
                outs.append(model(chunk_batch(ids, position, position + 1, table, 0), state))
        return torch.cat(outs)

    assert torch.equal(decode_tail(rollback=True), decode_tail(rollback=False))


def test_two_requests_decode_independently() -> None:
    model = tiny_model(ComputeMode.FP32)
    first, second = prompt(40, seed=9), prompt(21, seed=10)
    alone_first = run_chunks(model, first, [0, 39, 40])[-1]
    alone_second = run_chunks(model, second, [0, 20, 21])[-1]
    state = model.allocate_state(block_size=8, num_blocks=12, num_state_slots=2)
    table = torch.tensor([[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]], dtype=torch.int32)
    with torch.no_grad():
        model(ForwardBatch.for_requests([first[:39].tolist(), second[:20].tolist()], [0, 0], table, [1, 0]), state)
        prefix = torch.tensor([first[37:39].tolist(), second[18:20].tolist()])
        step = ForwardBatch.for_requests([[int(first[39])], [int(second[20])]], [39, 20], table, [1, 0], prefix)
        both = model(step, state)
    assert _max_relative(both[0], alone_first) < 1e-5
    assert _max_relative(both[1], alone_second) < 1e-5
