"""Cache row codecs, pool allocation and the per-step addressing math."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import position_sources
from deepinfer_model import reference as ref
from deepinfer_model.cache_spec import CacheGroupSpec, CacheSpec
from deepinfer_model.forward_batch import ForwardBatch
from deepinfer_model.state import ModelState, StepMetadata
from deepinfer_model.state.codecs import Fp4E4m3RowCodec, Fp4Ue8m0RowCodec, Fp8RowCodec, RawFp32RowCodec


def _rows(seed: int, width: int = 512) -> torch.Tensor:
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(seed)) * 3
    x[1] = 0.0
    x[2, :16] = 1e-9
    return x.to(torch.bfloat16)


@pytest.mark.parametrize(
    ("codec", "expected_bytes", "reference"),
    [
        (Fp8RowCodec(512), 528, ref.fp8_quant_dequant),
        (Fp4E4m3RowCodec(512), 288, ref.fp4_e4m3_quant_dequant),
        (Fp4Ue8m0RowCodec(128), 68, ref.fp4_ue8m0_quant_dequant),
    ],
)
def test_codecs_store_the_reference_formats(codec, expected_bytes, reference) -> None:  # type: ignore[no-untyped-def]
    x = _rows(0, codec.width)
    encoded = codec.encode(x)
    assert encoded.dtype == torch.uint8 and encoded.shape == (6, expected_bytes) == (6, codec.bytes_per_row)
    assert torch.equal(codec.decode(encoded), reference(x))
    assert torch.equal(codec.decode(encoded[None]), reference(x)[None])


def test_raw_codec_round_trips_fp32() -> None:
    codec = RawFp32RowCodec(8)
    x = torch.randn(3, 8)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def _spec() -> CacheSpec:
    return CacheSpec(
        (
            CacheGroupSpec.sliding_window("swa", (0, 1), 4 * 8, window=4, backtracking_tokens=2, dtype=torch.uint8),
            CacheGroupSpec.paged("compressed_c2", (1,), 4 * 8, tokens_per_row=2, dtype=torch.uint8),
        )
    )


def test_allocate_and_validate_pools() -> None:
    codecs = {"swa": RawFp32RowCodec(8), "compressed_c2": RawFp32RowCodec(8)}
    state = ModelState.allocate(_spec(), codecs, block_size=4, num_blocks=5, num_state_slots=3)
    assert state.ring_size("swa") == 6 and state.rows_per_block("compressed_c2") == 2
    rows = torch.tensor([3, 7])
    values = torch.randn(2, 8)
    state.write("compressed_c2", 1, rows, values)
    assert torch.equal(state.read("compressed_c2", 1, rows), values)
    with pytest.raises(KeyError, match="owns no pool"):
        state.read("compressed_c2", 0, rows)
    with pytest.raises(ValueError, match="codec"):
        ModelState.allocate(_spec(), {"swa": RawFp32RowCodec(4), "compressed_c2": codecs["swa"]}, 4, 5, 3)
    bad = {"swa": {0: torch.zeros(3, 6, 32, dtype=torch.uint8), 1: torch.zeros(3, 5, 32, dtype=torch.uint8)}}
    with pytest.raises(ValueError, match="rows per page/slot"):
        ModelState(_spec(), codecs, 4, {**bad, "compressed_c2": {1: torch.zeros(5, 2, 32, dtype=torch.uint8)}})


def test_step_metadata_addressing() -> None:
    # Request 0 decodes position 9; request 1 prefills positions 0..4.
    batch = ForwardBatch.for_requests(
        [[11], [1, 2, 3, 4, 5]], [9, 0], torch.tensor([[4, 2, 7], [0, 1, -1]], dtype=torch.int32), [1, 0]
    )
    meta = StepMetadata.from_batch(batch)
    assert meta.token_request.tolist() == [0, 1, 1, 1, 1, 1]
    assert meta.q_start.tolist() == [9, 0]
    # Compressed rows of ratio 2 (request 0's row 4: positions 8, 9; request 1's row 1: positions 2, 3): in the
    # chunk or not, their step tokens and their rows in a ring of 6 (deepinfer_kernels.position_sources).
    request, row = torch.tensor([0, 1]), torch.tensor([4, 1])
    sources = position_sources(
        request, row, 2, meta.q_start, meta.cu_query_lens, meta.context_lens, meta.state_slots, 6, meta.num_tokens
    )
    token, ring_row, in_chunk = (t.tolist() for t in sources)
    assert in_chunk == [[False, True], [True, True]] and token[0][1] == 0 and token[1] == [3, 4]
    assert ring_row[0] == [1 * 6 + 2, 1 * 6 + 3]
    # Ring of 6 rows per slot: position 9 of the request in slot 1 is row 1·6 + 3.
    assert meta.ring_rows(torch.tensor([0]), torch.tensor([9]), 6).tolist() == [9]
    # 2 rows per page: logical row 3 of request 0 lies in its page 1 → physical page 2, offset 1.
    assert meta.paged_rows(torch.tensor([0]), torch.tensor([3]), 2).tolist() == [5]
    # Per request a row of logical rows; −1 (none) stays −1.
    assert meta.paged_rows(torch.tensor([0, 1]), torch.tensor([[3, -1], [0, 1]]), 2).tolist() == [[5, -1], [0, 1]]
    # Ring of 3: request 1 writes only its last 3 tokens; request 0 its only one.
    assert meta.ring_write_tokens(3).tolist() == [True, False, False, True, True, True]


def test_forward_batch_validates_shapes() -> None:
    with pytest.raises(ValueError, match="cu_query_lens"):
        ForwardBatch(
            input_ids=torch.zeros(3, dtype=torch.int64),
            positions=torch.zeros(3, dtype=torch.int64),
            cu_query_lens=torch.tensor([0, 3], dtype=torch.int32),
            context_lens=torch.tensor([3, 1], dtype=torch.int32),
            block_table=torch.zeros(2, 1, dtype=torch.int32),
            state_slots=torch.zeros(2, dtype=torch.int32),
        )
