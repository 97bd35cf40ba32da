"""10,000 seeded random operations on the cache manager against a simple model of what each request holds."""

import random

from factories import make_cache_manager

BLOCK_SIZE = 8
BACKTRACKING = 5


def test_random_add_grow_rollback_free_never_leaks():
    rng = random.Random(1234)
    manager = make_cache_manager(
        num_blocks=48, block_size=BLOCK_SIZE, num_state_slots=9, backtracking_tokens=BACKTRACKING
    )
    tokens: dict[str, int] = {}  # the model: positions each request holds
    high: dict[str, int] = {}
    next_id = 0
    for _ in range(10_000):
        op = rng.random()
        live = sorted(tokens)
        if op < 0.25 or not live:  # add
            request_id = f"r{next_id}"
            next_id += 1
            want = rng.randint(1, 60)
            fits = -(-want // BLOCK_SIZE) <= manager.num_free_blocks and len(tokens) < 8
            result = manager.allocate(request_id, want)
            assert (result is not None) == fits
            if result is not None:
                tokens[request_id] = high[request_id] = want
        elif op < 0.55:  # grow by a decode step with drafts
            request_id = rng.choice(live)
            want = tokens[request_id] + rng.randint(1, 1 + BACKTRACKING - 1)
            before_free = manager.num_free_blocks
            result = manager.allocate(request_id, want)
            needed = -(-want // BLOCK_SIZE) - -(-tokens[request_id] // BLOCK_SIZE)
            assert (result is not None) == (needed <= before_free)
            if result is not None:
                assert len(result.new_block_ids) == needed
                tokens[request_id] = want
                high[request_id] = max(high[request_id], want)
        elif op < 0.75:  # roll back rejected drafts, within what the rings allow
            request_id = rng.choice(live)
            deepest = min(tokens[request_id] - 1, BACKTRACKING - (high[request_id] - tokens[request_id]))
            if deepest >= 0:
                count = rng.randint(0, deepest)
                blocks_before = manager.block_ids(request_id)
                released = manager.rollback(request_id, count)
                tokens[request_id] -= count
                assert released == blocks_before[-(-tokens[request_id] // BLOCK_SIZE) :]
        elif op < 0.9:  # finish
            request_id = rng.choice(live)
            manager.free(request_id)
            del tokens[request_id], high[request_id]
        else:  # preempt: everything is released, the request comes back later under the same id
            request_id = rng.choice(live)
            manager.free(request_id)
            del tokens[request_id], high[request_id]
            result = manager.allocate(request_id, 1)
            if result is not None:
                assert result.first_new_block_index == 0
                tokens[request_id] = high[request_id] = 1
        # Invariants: every held block accounted for exactly once, sizes match the model, slots unique.
        held = [block for request_id in tokens for block in manager.block_ids(request_id)]
        assert len(held) == len(set(held))
        assert 0 not in held
        assert len(held) + manager.num_free_blocks == manager.num_usable_blocks
        for request_id, count in tokens.items():
            assert manager.num_tokens(request_id) == count
            assert len(manager.block_ids(request_id)) == -(-count // BLOCK_SIZE)
        slots = [manager.state_slot(request_id) for request_id in tokens]
        assert len(slots) == len(set(slots)) and 0 not in slots
        assert manager.num_free_state_slots == 8 - len(tokens)
    for request_id in list(tokens):
        manager.free(request_id)
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert manager.num_free_state_slots == 8
