import random

import pytest

from deepinfer_engine.block_pool import NULL_BLOCK_ID, BlockPool


def test_fresh_pool():
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_usable_blocks == 4
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in pool.allocate(0)
    assert not pool.can_allocate(1)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.allocate(1)


def test_fifo_reuse_order():
    pool = BlockPool(6)
    a = pool.allocate(3)  # 1, 2, 3
    pool.free([a[1]])  # 2 goes to the tail, behind 4 and 5
    assert pool.allocate(3) == [4, 5, 2]


def test_ref_counts_and_sharing():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.share([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 2
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 3


def test_double_free_rejected_atomically():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="freed more times than it is referenced"):
        pool.free([blocks[0], blocks[1], blocks[1]])
    assert pool.num_free_blocks == 1  # nothing was freed
    pool.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        pool.free([blocks[0]])


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_bad_ids(bad):
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([bad])


def test_share_needs_block_in_use():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="not in use"):
        pool.share([2])


def test_constructor_and_argument_validation():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
    with pytest.raises(ValueError, match="must be >= 0"):
        BlockPool(3).allocate(-1)


def test_random_operations_never_leak():
    rng = random.Random(0)
    pool = BlockPool(33)
    held: list[int] = []  # one entry per reference
    for _ in range(5000):
        op = rng.random()
        if op < 0.45 and pool.num_free_blocks:
            held.extend(pool.allocate(rng.randint(1, pool.num_free_blocks)))
        elif op < 0.6 and held:
            block = rng.choice(held)
            pool.share([block])
            held.append(block)
        elif held:
            rng.shuffle(held)
            count = rng.randint(1, len(held))
            pool.free(held[:count])
            del held[:count]
        assert pool.num_used_blocks == len(set(held))
        for block in set(held):
            assert pool.ref_count(block) == held.count(block)
    pool.free(held)
    assert pool.num_free_blocks == pool.num_usable_blocks
