"""Uniform steps take static-shape paths (CUDA-graph friendly) with the exact results of the general path.

A uniform step (every request computes the same number of tokens: decode steps, verify steps with equal draft counts)
writes every token's ring rows without a mask, forms a fixed number of candidate compressed rows per request (a
provisional one for C2 blocks that are not complete yet), and the MoE runs its experts through grouped GEMMs. These
tests run the same steps through the general path (``max_query_len`` given as a bound one above the real length,
which keeps the step off the uniform paths) and through the static path with the indexer sized by a fixed
context bound, as a captured graph runs it, and require bitwise-equal logits for the real requests. Both runs carry
the same placeholder requests (token 0 at position 0, null block 0, state slot 0) that pad a step to a graph size:
padding itself changes the GEMMs' row count, which on CPU may move logits in the last bit, so it is held equal.
"""

from __future__ import annotations

import torch
from _layered_model_support import prompt, tiny_config, tiny_model

from deepinfer_kernels import moe_combine
from deepinfer_model.deepseek_v41.moe import RoutedExperts, local_expert_dispatch
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.layers.mode import ComputeMode

_BLOCK_SIZE = 8
_NUM_BLOCKS = 40
_MAX_NGRAM = 3


def _prefix(ids: torch.Tensor, start: int) -> list[int]:
    before = ids[max(0, start - (_MAX_NGRAM - 1)) : start].tolist()
    return [-1] * (_MAX_NGRAM - 1 - len(before)) + before


def _step_batch(
    sequences: list[torch.Tensor],
    starts: list[int],
    table: torch.Tensor,
    slots: list[int],
    num_padding: int,
    max_query_len: int,
    max_context_len: int,
    query_len: int = 1,
) -> ForwardBatch:
    """``query_len`` tokens per request from ``starts`` on, then ``num_padding`` placeholder requests of as many
    tokens (token 0 at positions 0, 1, …, null block 0, state slot 0)."""
    q = query_len
    ids = [int(t) for seq, s in zip(sequences, starts, strict=True) for t in seq[s : s + q]] + [0] * (q * num_padding)
    pos = [s + j for s in starts for j in range(q)] + list(range(q)) * num_padding
    count = len(starts) + num_padding
    padded_table = torch.cat([table, torch.zeros((num_padding, table.shape[1]), dtype=torch.int32)])
    prefixes = [_prefix(seq, s) for seq, s in zip(sequences, starts, strict=True)]
    prefixes += [[-1] * (_MAX_NGRAM - 1)] * num_padding
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        cu_query_lens=torch.arange(0, q * count + 1, q, dtype=torch.int32),
        context_lens=torch.tensor([s + q for s in starts] + [q] * num_padding, dtype=torch.int32),
        block_table=padded_table,
        state_slots=torch.tensor(slots + [0] * num_padding, dtype=torch.int32),
        engram_prefix_ids=torch.tensor(prefixes, dtype=torch.int64),
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )


def _compare_decode(num_padding: int, fixed_bound: bool, decode_steps: int, query_len: int = 1) -> None:
    """Prefill three requests, then run steps of ``query_len`` tokens per request (decode steps, or verify steps of
    ``query_len − 1`` drafts) through both paths and require equal real-request logits."""
    assert tiny_config().text.engram_max_ngram_size == _MAX_NGRAM
    model = tiny_model(ComputeMode.EXACT)
    # Block 0 and slot 0 stay unused by the requests (the placeholders' null block and slot).
    lengths = [41, 34, 7]
    q = query_len
    sequences = [prompt(n + q * decode_steps, seed=20 + i) for i, n in enumerate(lengths)]
    table = torch.tensor([[1 + r + 3 * b for b in range(12)] for r in range(3)], dtype=torch.int32)
    slots = [1, 2, 3]
    general = model.allocate_state(_BLOCK_SIZE, _NUM_BLOCKS, num_state_slots=4)
    static = model.allocate_state(_BLOCK_SIZE, _NUM_BLOCKS, num_state_slots=4)
    with torch.no_grad():
        prefill = ForwardBatch.for_requests(
            [seq[:n].tolist() for seq, n in zip(sequences, lengths, strict=True)],
            [0, 0, 0],
            table,
            slots,
            engram_prefix_ids=torch.full((3, _MAX_NGRAM - 1), -1, dtype=torch.int64),
        )
        model(prefill, general)
        model(prefill, static)
        for step in range(decode_steps):
            starts = [n + q * step for n in lengths]
            longest = max(starts) + q
            bound = 12 * _BLOCK_SIZE if fixed_bound else longest
            expected = model(
                _step_batch(
                    sequences,
                    starts,
                    table,
                    slots,
                    num_padding,
                    max_query_len=q + 1,
                    max_context_len=longest,
                    query_len=q,
                ),
                general,
            )
            actual = model(
                _step_batch(
                    sequences, starts, table, slots, num_padding, max_query_len=q, max_context_len=bound, query_len=q
                ),
                static,
            )
            assert actual.shape[0] == q * (3 + num_padding)
            assert torch.equal(actual[: 3 * q], expected[: 3 * q]), f"step {step} differs"


def test_padded_static_decode_with_a_fixed_bound_equals_general_path_exact() -> None:
    # What a graph replay computes: placeholders and the indexer sized by a bound (96) above every context (≤ 71).
    # 30 steps cross C2 row boundaries (provisional rows) and grow C1 rows past the 8 candidate blocks of 4 rows.
    _compare_decode(num_padding=5, fixed_bound=True, decode_steps=30)


def test_eager_decode_step_equals_general_path_exact() -> None:
    # What an eager decode step computes (no padding, the step's own longest context).
    _compare_decode(num_padding=0, fixed_bound=False, decode_steps=6)


def test_padded_uniform_verify_steps_equal_general_path_exact() -> None:
    # Verify steps of 5 tokens per request (4 drafts), padded like a graph replay: rows of C2 blocks are touched
    # from odd and even starts, and every step writes the ring tail of 5 tokens without a mask.
    _compare_decode(num_padding=2, fixed_bound=True, decode_steps=7, query_len=5)


def test_uniform_two_token_steps_equal_general_path_exact() -> None:
    _compare_decode(num_padding=0, fixed_bound=False, decode_steps=5, query_len=2)


def test_grouped_expert_sum_equals_per_expert_loop() -> None:
    model = tiny_model(ComputeMode.EXACT)
    layer = model.layers[1]
    moe = layer.ffn
    assert moe.experts.holds_every_expert  # the router's ids are the slots: no lookup, no zero rows
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(37, tiny_config().text.hidden_size, generator=generator) * 2).to(torch.bfloat16)
    topk_ids, topk_weights = moe.gate(x)
    bias = torch.randn(x.shape, generator=generator)
    with torch.no_grad():
        grouped = moe_combine(moe.experts.grouped_rows_of_tokens(x, topk_ids, topk_weights), bias, torch.float32)
        loop = local_expert_dispatch(x, topk_ids, topk_weights, moe.experts, bias)
    assert torch.equal(grouped, loop)


def test_moe_of_zero_tokens_is_empty() -> None:
    """An empty batch (an idle attention-DP rank's step) goes through the grouped experts and the MoE's combine."""
    moe = tiny_model(ComputeMode.EXACT).layers[1].ffn
    x = torch.empty(0, tiny_config().text.hidden_size, dtype=torch.bfloat16)
    topk_ids, topk_weights = moe.gate(x)
    with torch.no_grad():
        assert moe.experts.grouped_rows_of_tokens(x, topk_ids, topk_weights).shape == (0, topk_ids.shape[1], x.shape[1])
        out = moe(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


def test_grouped_expert_sum_maps_logical_experts_to_slots() -> None:
    model = tiny_model(ComputeMode.EXACT)
    experts = model.layers[0].ffn.experts
    experts.set_local_experts([3, 0, 1, 2, 7, 6, 5, 4])  # a permutation: slot i now claims another expert's weights
    assert experts.expert_slot.tolist() == [1, 2, 3, 0, 7, 6, 5, 4] and not experts.holds_every_expert
    x = torch.randn(5, tiny_config().text.hidden_size, generator=torch.Generator().manual_seed(4))
    topk_ids = torch.tensor([[0, 3], [4, 1], [2, 7], [5, 6], [6, 0]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(5))
    bias = torch.zeros(x.shape)
    with torch.no_grad():
        grouped = moe_combine(
            experts.grouped_rows_of_tokens(x.to(torch.bfloat16), topk_ids, weights), bias, torch.float32
        )
        loop = local_expert_dispatch(x.to(torch.bfloat16), topk_ids, weights, experts, bias)
    assert torch.equal(grouped, loop)


def test_expert_slot_table_marks_experts_not_held() -> None:
    text = tiny_config().text
    experts = RoutedExperts(8, text.hidden_size, text.moe_intermediate_size, 10.0, ComputeMode.EXACT, [5, 2, 5])
    assert experts.expert_slot.tolist() == [-1, -1, 1, -1, -1, 0, -1, -1] and not experts.holds_every_expert
