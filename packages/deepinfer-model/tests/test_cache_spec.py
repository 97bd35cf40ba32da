import pytest
import torch

from deepinfer_model.cache_spec import CacheGroupKind, CacheGroupSpec, CacheSpec

BT = 6  # nextn 5 + 1
W = 128


def v41_like_spec(fp4: bool = True) -> CacheSpec:
    """Groups of a small V4.1-shaped model: layers 0..5, ratio [0, 2, 2, 1, 1, 1], sources 1 and 3."""
    main_row = 288 if fp4 else 528
    return CacheSpec(
        (
            CacheGroupSpec.sliding_window("swa", (0, 1, 2, 3, 4, 5), 528, W, BT, torch.uint8),
            CacheGroupSpec.paged("compressed_c2", (1,), main_row, 2, torch.uint8),
            CacheGroupSpec.paged("index_k_c2", (1,), 68, 2, torch.uint8),
            CacheGroupSpec.state("compressor_c2", (1,), 4096, 2, BT, torch.float32),
            CacheGroupSpec.paged("compressed_c1", (3,), main_row, 1, torch.uint8),
            CacheGroupSpec.paged("index_k_c1", (3,), 68, 1, torch.uint8),
        )
    )


def test_rows_per_block_and_request():
    spec = v41_like_spec()
    assert spec.group("compressed_c2").rows_per_block(128) == 64
    assert spec.group("compressed_c1").rows_per_block(128) == 128
    assert spec.group("swa").rows_per_block(128) == 0
    assert spec.group("swa").rows_per_request() == W + BT
    # Compressor ring R = c + BT - 1 (docs/design/attention.md, "Compressor state").
    assert spec.group("compressor_c2").rows_per_request() == 2 + BT - 1
    assert spec.group("compressed_c1").rows_per_request() == 0


def test_bytes_per_block_sums_paged_groups_only():
    spec = v41_like_spec()
    expected = 64 * 288 + 64 * 68 + 128 * 288 + 128 * 68
    assert spec.bytes_per_block(128) == expected
    spec_fp8 = v41_like_spec(fp4=False)
    assert spec_fp8.bytes_per_block(128) == 64 * 528 + 64 * 68 + 128 * 528 + 128 * 68


def test_bytes_per_request_sums_rings_over_layers():
    spec = v41_like_spec()
    assert spec.bytes_per_request() == 6 * (W + BT) * 528 + (2 + BT - 1) * 4096


def test_bytes_scale_with_layer_count():
    one = CacheGroupSpec.paged("p", (0,), 100, 1, torch.uint8)
    three = CacheGroupSpec.paged("p", (0, 4, 7), 100, 1, torch.uint8)
    assert three.bytes_per_block(16) == 3 * one.bytes_per_block(16) == 3 * 16 * 100


def test_max_backtracking_is_min_over_rings():
    spec = CacheSpec(
        (
            CacheGroupSpec.sliding_window("a", (0,), 8, 4, 3, torch.uint8),
            CacheGroupSpec.state("b", (0,), 8, 2, 5, torch.float32),
            CacheGroupSpec.paged("c", (0,), 8, 1, torch.uint8),
        )
    )
    assert spec.max_backtracking_tokens == 3
    paged_only = CacheSpec((CacheGroupSpec.paged("c", (0,), 8, 1, torch.uint8),))
    assert paged_only.max_backtracking_tokens is None
    assert paged_only.bytes_per_request() == 0


def test_state_ring_with_zero_backtracking_is_one_block():
    group = CacheGroupSpec.state("s", (0,), 8, 2, 0, torch.float32)
    assert group.rows_per_request() == 2


def test_kind_partitions():
    spec = v41_like_spec()
    assert {g.name for g in spec.paged_groups} == {"compressed_c2", "index_k_c2", "compressed_c1", "index_k_c1"}
    assert {g.kind for g in spec.per_request_groups} == {CacheGroupKind.SLIDING_WINDOW, CacheGroupKind.STATE}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_ids": ()}, "layer_ids must be non-empty"),
        ({"layer_ids": (1, 1)}, "duplicate layer ids"),
        ({"layer_ids": (-1,)}, "layer ids must be >= 0"),
        ({"bytes_per_row": 0}, "bytes_per_row must be > 0"),
        ({"bytes_per_row": 6, "dtype": torch.float32}, "not a multiple"),
        ({"tokens_per_row": 0}, "tokens_per_row must be >= 1"),
        ({"window": 4}, "window is only used"),
        ({"backtracking_tokens": 2}, "PAGED groups need no backtracking"),
        ({"name": ""}, "name must be non-empty"),
    ],
)
def test_paged_group_validation(kwargs, message):
    base = {
        "name": "g",
        "kind": CacheGroupKind.PAGED,
        "layer_ids": (0,),
        "bytes_per_row": 8,
        "dtype": torch.uint8,
        "tokens_per_row": 2,
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        CacheGroupSpec(**base)


def test_ring_validation():
    with pytest.raises(ValueError, match="window must be >= 1"):
        CacheGroupSpec.sliding_window("s", (0,), 8, 0, 1, torch.uint8)
    with pytest.raises(ValueError, match="backtracking_tokens must be >= 0"):
        CacheGroupSpec.sliding_window("s", (0,), 8, 4, -1, torch.uint8)
    with pytest.raises(ValueError, match="tokens_per_row is only used"):
        CacheGroupSpec("s", CacheGroupKind.SLIDING_WINDOW, (0,), 8, torch.uint8, tokens_per_row=2, window=4)
    with pytest.raises(TypeError, match="kind must be a CacheGroupKind"):
        CacheGroupSpec("s", "paged", (0,), 8, torch.uint8, tokens_per_row=1)  # type: ignore[arg-type]


def test_block_size_must_divide_by_ratio():
    group = CacheGroupSpec.paged("p", (0,), 8, 2, torch.uint8)
    with pytest.raises(ValueError, match="block_size 127"):
        group.rows_per_block(127)


def test_spec_validation_and_lookup():
    group = CacheGroupSpec.paged("p", (0,), 8, 1, torch.uint8)
    with pytest.raises(ValueError, match="unique"):
        CacheSpec((group, group))
    with pytest.raises(ValueError, match="at least one"):
        CacheSpec(())
    with pytest.raises(KeyError, match="no cache group named 'x'"):
        CacheSpec((group,)).group("x")


def test_frozen():
    group = CacheGroupSpec.paged("p", (0,), 8, 1, torch.uint8)
    with pytest.raises(AttributeError):
        group.bytes_per_row = 9  # type: ignore[misc]
