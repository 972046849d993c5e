"""The block pool's bookkeeping, and the events a router rebuilds its index from."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.hashing import block_key
from kvpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvpool.worker.block_pool import BlockPool, NoFreeBlocks


def digest(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def replay(events: list[KVCacheEvent], index: set[int]) -> None:
    """What a router does with the events; like a radix-tree index, it refuses a stored
    block whose parent it does not hold."""
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            assert parent is None or parent in index, f"BlockStored with unknown parent {parent}"
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            index.clear()


def test_a_freed_cached_block_stays_findable_until_evicted() -> None:
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(2)
    pool.cache_blocks(a, [digest(1), digest(2)], [[1, 2], [3, 4]], None)
    pool.free(list(reversed(a)))
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored]
    assert pool.lookup([digest(1), digest(2), digest(3)]) == a  # stops at the first miss
    assert not pool.take_events()  # ref count zero is not a removal
    pool.allocate(2)  # the two never-used blocks go first
    assert pool.lookup([digest(1)]) == a[:1]
    pool.allocate(1)  # now the least recently freed cached block: the tail, freed first
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == [block_key(digest(2))]
    assert pool.lookup([digest(1), digest(2)]) == a[:1]


def test_touch_takes_a_cached_block_off_the_eviction_queue() -> None:
    pool = BlockPool(2, block_size=1)
    a = pool.allocate(1)
    pool.cache_blocks(a, [digest(7)], [[7]], None)
    pool.free(a)
    pool.touch(pool.lookup([digest(7)]))
    assert pool.num_free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.check()


def test_block_stored_events_carry_the_chain_parent_and_tokens() -> None:
    pool = BlockPool(4, block_size=2)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:1], [digest(1)], [[1, 2]], None)
    pool.cache_blocks(blocks[1:], [digest(2), digest(3)], [[3, 4], [5, 6]], digest(1))
    first, second = pool.take_events()
    assert first.parent_block_hash is None
    assert second.parent_block_hash == block_key(digest(1))
    assert second.block_hashes == [block_key(digest(2)), block_key(digest(3))]
    assert second.token_ids == [3, 4, 5, 6]
    assert second.block_size == 2


def test_a_request_that_computed_a_cached_block_again_switches_to_the_cached_one() -> None:
    pool = BlockPool(4, block_size=1)
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.cache_blocks(a, [digest(1), digest(2)], [[1], [2]], None) == a
    # b computed the same first block, then a different second one
    held = pool.cache_blocks(b, [digest(1), digest(3)], [[1], [3]], None)
    assert held == [a[0], b[1]]
    assert pool.blocks[a[0]].ref_count == 2
    assert pool.blocks[b[0]].ref_count == 0 and pool.blocks[b[0]].digest is None
    first, second = pool.take_events()
    assert first.block_hashes == [block_key(digest(1)), block_key(digest(2))]
    assert second.block_hashes == [block_key(digest(3))]
    assert second.parent_block_hash == block_key(digest(1))  # held, so never evicted first
    pool.check()


def test_reset_is_refused_while_blocks_are_in_use_then_clears_everything() -> None:
    pool = BlockPool(3, block_size=1)
    a = pool.allocate(1)
    pool.cache_blocks(a, [digest(1)], [[1]], None)
    assert not pool.reset_prefix_cache()
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)
    assert pool.lookup([digest(1)]) == [] and pool.num_free == 3


def test_double_free_is_an_error_not_a_corruption() -> None:
    pool = BlockPool(2, block_size=1)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(a)
    pool.check()


class PoolMachine(RuleBasedStateMachine):
    """Requests take, share, cache and free blocks in any order; the pool stays consistent
    and the emitted events always rebuild exactly its set of cached hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, block_size=1)
        self.held: list[list[int]] = []  # each entry: one request's blocks
        self.index: set[int] = set()
        self.next_hash = 0

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        if n > self.pool.num_free:
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(n)
            return
        self.held.append(self.pool.allocate(n))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), reuse=st.booleans())
    def cache(self, data: st.DataObject, reuse: bool) -> None:
        blocks = data.draw(st.sampled_from(self.held))
        if reuse and self.next_hash:
            digests = [digest(data.draw(st.integers(0, self.next_hash - 1))) for _ in blocks]
        else:
            digests = [digest(self.next_hash + i) for i in range(len(blocks))]
            self.next_hash += len(blocks)
        i = self.held.index(blocks)
        self.held[i] = self.pool.cache_blocks(blocks, digests, [[0]] * len(blocks), None)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        blocks = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(list(reversed(blocks)))

    @rule(data=st.data())
    def share_a_cached_prefix(self, data: st.DataObject) -> None:
        if not self.next_hash:
            return
        start = data.draw(st.integers(0, self.next_hash - 1))
        found = self.pool.lookup([digest(start + i) for i in range(3)])
        if found:
            self.pool.touch(found)
            self.held.append(found)

    @rule()
    def reset(self) -> None:
        done = self.pool.reset_prefix_cache()
        assert done == (not self.held)

    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        for blocks in self.held:
            for b in blocks:
                refs[b] += 1
        assert refs == [b.ref_count for b in self.pool.blocks]
        replay(self.pool.take_events(), self.index)
        assert self.index == {block_key(d) for d in self.pool.cached_digests}


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
