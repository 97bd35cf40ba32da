import pytest
from factories import make_cache_manager, make_cache_spec

from deepinfer_engine.cache_manager import CacheManager
from deepinfer_engine.config import CacheConfig


def test_budget_sizing_spends_state_slots_first():
    spec = make_cache_spec(backtracking_tokens=4, window=8)
    config = CacheConfig(block_size=16, num_state_slots=5)
    per_block = spec.bytes_per_block(16)
    per_request = spec.bytes_per_request()
    assert per_block == 8 * 8 + 16 * 8
    assert per_request == 3 * (8 + 4) * 16 + (2 + 3) * 32
    budget = 5 * per_request + 10 * per_block + per_block - 1
    assert CacheManager.num_blocks_for_budget(spec, config, budget) == 10
    manager = CacheManager.from_memory_budget(spec, config, budget)
    assert manager.num_blocks == 10 and manager.num_usable_blocks == 9


def test_budget_too_small():
    spec = make_cache_spec()
    config = CacheConfig(block_size=16, num_state_slots=5)
    with pytest.raises(ValueError, match="too small"):
        CacheManager.num_blocks_for_budget(spec, config, 5 * spec.bytes_per_request() + spec.bytes_per_block(16))


def test_block_size_must_suit_every_ratio():
    with pytest.raises(ValueError, match="block_size 15"):
        CacheManager(make_cache_spec(), CacheConfig(block_size=15, num_state_slots=3), 8)


def test_allocate_grows_by_blocks():
    manager = make_cache_manager(num_blocks=10, block_size=16)
    first = manager.allocate("a", 20)
    assert first is not None
    assert first.first_new_block_index == 0 and len(first.new_block_ids) == 2
    assert manager.num_tokens("a") == 20
    same = manager.allocate("a", 32)  # still inside block 2
    assert same is not None and same.new_block_ids == () and same.first_new_block_index == 2
    assert same.state_slot == first.state_slot
    more = manager.allocate("a", 33)
    assert more is not None and more.first_new_block_index == 2 and len(more.new_block_ids) == 1
    assert manager.block_ids("a") == first.new_block_ids + more.new_block_ids
    assert 0 not in manager.block_ids("a")
    assert manager.num_free_blocks == 9 - 3


def test_allocate_never_shrinks():
    manager = make_cache_manager(block_size=16)
    manager.allocate("a", 40)
    result = manager.allocate("a", 5)
    assert result is not None and result.new_block_ids == ()
    assert manager.num_tokens("a") == 40 and len(manager.block_ids("a")) == 3


def test_allocation_failure_changes_nothing():
    manager = make_cache_manager(num_blocks=4, block_size=16)  # 3 usable
    manager.allocate("a", 16)
    assert not manager.can_allocate("b", 48)
    assert manager.allocate("b", 48) is None
    assert not manager.has_request("b")
    assert manager.num_free_blocks == 2 and manager.num_free_state_slots == manager.config.num_state_slots - 2


def test_state_slots_limit_admission():
    manager = make_cache_manager(num_blocks=64, num_state_slots=3)  # 2 usable slots
    slots = {manager.allocate(name, 1).state_slot for name in ("a", "b")}
    assert slots == {1, 2}
    assert not manager.can_allocate("c", 1)
    assert manager.allocate("c", 1) is None
    assert manager.can_allocate("a", 17)  # a request holding a slot only needs blocks
    manager.free("a")
    assert manager.allocate("c", 1).state_slot == 1


def test_can_ever_fit():
    manager = make_cache_manager(num_blocks=5, block_size=16)  # 4 usable = 64 tokens
    assert manager.can_ever_fit(64)
    assert not manager.can_ever_fit(65)


def test_free_returns_everything():
    manager = make_cache_manager(num_blocks=10)
    manager.allocate("a", 50)
    manager.allocate("b", 3)
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_state_slots == manager.config.num_state_slots - 1
    assert manager.usage == 0.0
    with pytest.raises(KeyError, match="holds no cache"):
        manager.free("a")


def test_rollback_frees_exactly_emptied_blocks():
    manager = make_cache_manager(block_size=16, backtracking_tokens=6)
    manager.allocate("a", 30)
    manager.allocate("a", 34)  # 3 blocks: positions 32, 33 live in the third
    third = manager.block_ids("a")[2]
    assert manager.rollback("a", 1) == ()  # 33 positions still reach the third block
    assert manager.num_tokens("a") == 33
    assert manager.rollback("a", 1) == (third,)  # 32 positions fit in two blocks
    assert len(manager.block_ids("a")) == 2 and manager.num_tokens("a") == 32
    assert manager.rollback("a", 0) == ()
    regrown = manager.allocate("a", 33)
    assert regrown.first_new_block_index == 2 and len(regrown.new_block_ids) == 1


def test_rollback_depth_is_bounded_by_the_rings():
    manager = make_cache_manager(block_size=16, backtracking_tokens=4)
    manager.allocate("a", 20)
    manager.rollback("a", 3)  # 17, 3 below the high-water mark 20
    with pytest.raises(ValueError, match="the rings allow at most 4"):
        manager.rollback("a", 2)  # would be 5 below
    manager.rollback("a", 1)  # exactly 4 below
    manager.allocate("a", 18)  # regrowing below the mark keeps the mark
    with pytest.raises(ValueError, match="at most 4"):
        manager.rollback("a", 3)
    manager.allocate("a", 30)  # a new mark
    manager.rollback("a", 4)
    assert manager.num_tokens("a") == 26


def test_rollback_validation():
    manager = make_cache_manager()
    manager.allocate("a", 3)
    with pytest.raises(ValueError, match="must be >= 0"):
        manager.rollback("a", -1)
    with pytest.raises(ValueError, match="cannot roll back 3 of 3"):
        manager.rollback("a", 3)
    with pytest.raises(KeyError):
        manager.rollback("b", 1)
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        manager.allocate("a", 0)
