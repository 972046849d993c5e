from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    UnknownEvent,
)
from kvpool.router.state.index import BlockIndex


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def stored(hashes: list[int], medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        medium=medium,
    )


def removed(hashes: list[int], medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


def batch(*events: KVCacheEvent | UnknownEvent) -> EventBatch:
    return EventBatch(events=list(events), ts=0.0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def index(clock: FakeClock) -> BlockIndex:
    return BlockIndex(clock=clock)


# ---- behaviour ----


def test_match_stops_at_first_missing_block(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("b")
    index.store("a", [1, 2, 4, 5])
    index.store("b", [1, 2, 3])
    consumed: list[int] = []

    def chain() -> Iterator[int]:
        for h in [1, 2, 3, 4, 5, 6, 7]:
            consumed.append(h)
            yield h

    # a lacks block 3, so its later blocks do not count; b stops at 4; nothing is read past 4.
    assert index.match(chain()) == {"a": 2, "b": 3}
    assert consumed == [1, 2, 3, 4]


def test_match_omits_workers_without_the_first_block(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("b")
    index.store("a", [1, 2])
    index.store("b", [2])  # a later block alone is no prefix
    assert index.match([1, 2]) == {"a": 2}
    assert index.match([9, 1]) == {}
    assert index.match([]) == {}


def test_speculative_entry_expires_unless_confirmed(index: BlockIndex, clock: FakeClock) -> None:
    index.add_worker("a")
    index.speculate("a", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"a": 3}
    assert index.num_speculative("a") == 3 and index.num_blocks("a") == 0
    clock.advance(1.0)
    index.store("a", [1, 2])  # the worker's event confirms two of them
    assert index.num_speculative("a") == 1 and index.num_blocks("a") == 2
    clock.advance(0.999)
    assert index.match([1, 2, 3]) == {"a": 3}
    clock.advance(0.001)  # speculative_ttl (2 s) after routing: the guess for 3 is gone
    assert index.match([1, 2, 3]) == {"a": 2}
    assert index.num_speculative("a") == 0
    clock.advance(100)
    assert index.match([1, 2, 3]) == {"a": 2}  # confirmed entries do not expire


def test_each_speculative_entry_expires_on_time_across_workers(
    index: BlockIndex, clock: FakeClock
) -> None:
    index.add_worker("a")  # tracked: 2 s
    index.add_worker("u", tracked=False)  # untracked: 120 s
    index.speculate("a", [1])
    index.speculate("u", [2])
    clock.advance(1)
    index.speculate("a", [3])
    clock.advance(1)
    assert index.match([1]) == {}  # expired, while 3 and 2 live on
    assert index.match([3]) == {"a": 1}
    clock.advance(1)
    assert index.match([3]) == {}
    assert index.match([2]) == {"u": 1}


def test_speculate_skips_blocks_already_confirmed(index: BlockIndex) -> None:
    index.add_worker("a")
    index.store("a", [1])
    index.speculate("a", [1, 2])
    assert index.num_speculative("a") == 1
    assert len(index) == 1


def test_remove_drops_the_speculative_entry_too(index: BlockIndex) -> None:
    index.add_worker("a")
    index.speculate("a", [1, 2, 3])
    index.remove("a", [2])
    assert index.match([1, 2, 3]) == {"a": 1}
    index.remove("a", [42])  # not held: nothing happens
    assert index.num_speculative("a") == 2


def test_speculate_returns_only_the_keys_it_added(index: BlockIndex, clock: FakeClock) -> None:
    index.add_worker("a")
    index.store("a", [1])
    assert index.speculate("a", [1, 2, 3]) == [2, 3]
    assert index.speculate("a", [1, 2, 3, 4]) == [4]  # 2 and 3 only refreshed
    clock.advance(10)
    assert index.speculate("a", [1, 2]) == [2]  # expired: added again


def test_withdrawn_speculation_gives_no_credit_and_leaves_confirmed_blocks(
    index: BlockIndex,
) -> None:
    index.add_worker("a", tracked=False)
    index.add_worker("b", tracked=False)
    index.store("a", [1])
    index.speculate("b", [1, 2])
    added = index.speculate("a", [1, 2, 3])
    assert added == [2, 3]
    assert index.match([1, 2, 3]) == {"a": 3, "b": 2}

    index.withdraw("a", [1, *added])  # the request failed: 429, connection refused
    assert index.match([1, 2, 3]) == {"a": 1, "b": 2}
    assert (index.num_blocks("a"), index.num_speculative("a")) == (1, 0)
    index.withdraw("a", [7])  # nothing of the worker's: nothing happens
    with pytest.raises(KeyError):
        index.withdraw("c", [1])


def test_untracked_worker_evicts_least_recently_routed(clock: FakeClock) -> None:
    index = BlockIndex(clock=clock, approx_capacity_blocks=6)
    index.add_worker("u", tracked=False)
    a, b = [11, 12, 13, 14], [21, 22, 23, 24]
    index.speculate("u", a)
    clock.advance(1)
    index.speculate("u", b)
    # 8 blocks for 6 places: a is older; its tail goes first, so its prefix only shortens.
    assert index.num_speculative("u") == 6
    assert index.match(a) == {"u": 2}
    assert index.match(b) == {"u": 4}
    clock.advance(1)
    index.speculate("u", a)  # routed again: now b is the least recently routed
    assert index.match(a) == {"u": 4}
    assert index.match(b) == {"u": 2}


def test_untracked_entries_live_approx_ttl_refreshed_when_routed_again(clock: FakeClock) -> None:
    index = BlockIndex(clock=clock, approx_ttl=120.0)
    index.add_worker("u", tracked=False)
    index.speculate("u", [1, 2])
    clock.advance(100)
    assert index.match([1, 2]) == {"u": 2}  # far past the tracked TTL: no events will come
    index.speculate("u", [1])
    clock.advance(20)
    assert index.match([1, 2]) == {"u": 1}  # block 2 was routed 120 s ago, block 1 20 s ago
    clock.advance(100)
    assert index.match([1, 2]) == {}
    assert index.summary()["workers"]["u"] == {"tracked": False, "blocks": 0, "speculative": 0}


def test_untracked_capacity_can_be_set_per_worker(index: BlockIndex) -> None:
    index.add_worker("u", tracked=False, approx_capacity_blocks=2)
    index.speculate("u", [1, 2, 3])
    assert index.match([1, 2, 3]) == {"u": 2}


def test_cpu_medium_events_are_not_indexed(index: BlockIndex) -> None:
    index.add_worker("a")
    applied = index.apply("a", batch(stored([1, 2], medium="CPU"), stored([7], medium="disk")))
    assert applied == 0
    assert index.match([1, 2]) == {} and len(index) == 0
    applied = index.apply("a", batch(stored([1, 2]), stored([3], medium="gpu"), stored([4], None)))
    assert applied == 3
    # Offloading a block to CPU does not take it out of GPU memory.
    assert index.apply("a", batch(removed([1, 2, 3, 4], medium="cpu"))) == 0
    assert index.match([1, 2, 3, 4]) == {"a": 4}
    assert index.apply("a", batch(removed([3], medium="GPU"))) == 1
    assert index.match([1, 2, 3, 4]) == {"a": 2}


def test_all_blocks_cleared_drops_only_that_worker(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("b")
    index.apply("a", batch(stored([1, 2, 3])))
    index.apply("b", batch(stored([1, 2])))
    index.speculate("a", [1, 2, 3, 4])
    assert index.apply("a", batch(AllBlocksCleared(), stored([1]))) == 2
    assert index.match([1, 2, 3, 4]) == {"a": 1, "b": 2}
    assert index.num_speculative("a") == 0
    assert index.workers() == ["a", "b"]
    assert len(index) == 3


def test_unknown_events_are_skipped(index: BlockIndex) -> None:
    index.add_worker("a")
    future = UnknownEvent(tag="BlockMoved", raw=["BlockMoved", [1]])
    assert index.apply("a", batch(future, stored([1]), future)) == 1
    assert index.match([1]) == {"a": 1}


def test_unknown_worker_is_a_key_error(index: BlockIndex) -> None:
    with pytest.raises(KeyError):
        index.apply("ghost", batch(stored([1])))
    with pytest.raises(KeyError):
        index.apply("ghost", batch())
    with pytest.raises(KeyError):
        index.speculate("ghost", [1])
    with pytest.raises(KeyError):
        index.remove_worker("ghost")
    index.add_worker("a")
    with pytest.raises(ValueError):
        index.add_worker("a")


def test_removed_worker_bit_is_reused_without_its_entries(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("b")
    index.store("a", [1, 2])
    index.speculate("a", [1, 2, 3])
    index.store("b", [1])
    index.remove_worker("a")
    index.add_worker("c")  # a's bit is not swept yet: c gets another
    assert index.match([1, 2, 3]) == {"b": 1}
    assert "a" not in index and "c" in index
    assert index.sweep() == 0
    assert index.summary()["distinct_blocks"] == 1
    index.add_worker("d")  # takes a's bit, swept clean
    index.store("c", [1, 2])
    assert index.match([1, 2, 3]) == {"b": 1, "c": 2}
    index.store("d", [1])
    assert index.match([1, 2, 3]) == {"b": 1, "c": 2, "d": 1}
    assert_table_is_exact(index)


def test_summary_counts_per_worker(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("u", tracked=False)
    index.store("a", [1, 2, 3])
    index.speculate("a", [1, 2, 3, 4])
    index.speculate("u", [1, 5])
    summary = index.summary()
    assert summary["workers"] == {
        "a": {"tracked": True, "blocks": 3, "speculative": 1},
        "u": {"tracked": False, "blocks": 0, "speculative": 2},
    }
    assert summary["entries"] == 3 == index.num_entries()
    assert summary["speculative_entries"] == 3
    assert summary["distinct_blocks"] == 5  # keys confirmed or speculative: 1 to 5
    assert summary["pending_sweep"] == 0
    assert summary["approx_bytes"] > 0


def test_a_key_outside_64_bits_is_refused_and_changes_nothing(index: BlockIndex) -> None:
    index.add_worker("a")
    with pytest.raises(ValueError, match="64-bit"):
        index.store("a", [1, 2, -3, 4])
    with pytest.raises(ValueError, match="64-bit"):
        index.store("a", [1 << 64])
    assert index.num_blocks("a") == 2 == len(index)
    assert index.match([1, 2, 4]) == {"a": 2}


# ---- clears cost O(1); sweeps do the rest in bounded slices ----


def holders(index: BlockIndex) -> dict[int, frozenset[str]]:
    """Key -> the registered workers whose bit the index's own table has for it."""
    out: dict[int, frozenset[str]] = {}
    for table in index._shards:
        for h, mask in table.items():
            live = mask & index._all_bits
            ids = frozenset(
                index._by_bit[1 << p] for p in range(live.bit_length()) if live >> p & 1
            )
            if ids:
                out[h] = ids
    return out


def assert_no_stray_bits(index: BlockIndex) -> None:
    """No key has a bit at a free position or one never handed out: a worker given such a
    bit would inherit entries that are not its own. (Retired bits, awaiting a sweep, may
    be anywhere.)"""
    free = sum(1 << p for p in index._free_positions)
    for table in index._shards:
        for mask in table.values():
            assert mask & free == 0 and mask >> index._next_position == 0


def assert_table_is_exact(index: BlockIndex) -> None:
    """With nothing left to sweep, the table has registered workers' bits only (and the
    mark of a compaction under way), and no key without a holder."""
    assert index.pending_sweep() == 0
    mark = index._compaction.mark if index._compaction is not None else 0
    allowed = index._all_bits | mark
    for table in index._shards:
        for mask in table.values():
            assert mask & ~allowed == 0, "a retired bit was left behind"
            assert mask & allowed, "a key nobody holds was left behind"
    assert_no_stray_bits(index)


class CountingDict(dict):  # type: ignore[type-arg]
    """A shard of the table that counts the index's reads and writes of it."""

    ops = 0

    def get(self, key: Any, default: Any = None) -> Any:
        CountingDict.ops += 1
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        CountingDict.ops += 1
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        CountingDict.ops += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        CountingDict.ops += 1
        super().__delitem__(key)


def test_clearing_a_big_worker_is_constant_work_and_sweeps_are_bounded() -> None:
    rng = random.Random(5)
    index = BlockIndex()
    index.add_worker("a")
    index.add_worker("b")
    keys = [rng.getrandbits(64) for _ in range(200_000)]
    for i in range(0, len(keys), 16):  # as KV events bring them
        index.store("a", keys[i : i + 16])
    shared, own = keys[::2], [rng.getrandbits(64) for _ in range(1000)]
    index.store("b", shared)
    index.store("b", own)
    index.speculate("a", own[:3])
    index._shards[:] = [CountingDict(t) for t in index._shards]

    CountingDict.ops = 0
    index.clear_worker("a")
    assert CountingDict.ops == 0  # not one key touched
    assert index.pending_sweep() == 200_003
    assert index.match(keys[:4]) == {"b": 1}  # a's entries are gone from every answer at once
    assert index.match(own[:3]) == {"b": 3}
    assert (index.num_blocks("a"), index.num_speculative("a"), len(index)) == (0, 0, 101_000)

    left = index.pending_sweep()
    while left:
        before = CountingDict.ops
        now = index.sweep(1000)
        assert now == left - min(1000, left)
        assert CountingDict.ops - before <= 2 * 1000  # a read, at most one write, a key
        left = now
    fresh = BlockIndex()
    fresh.add_worker("b")
    fresh.store("b", shared)
    fresh.store("b", own)
    assert holders(index) == holders(fresh)
    assert_table_is_exact(index)
    assert index.summary()["distinct_blocks"] == fresh.summary()["distinct_blocks"]


def test_clears_and_removals_pile_up_before_a_sweep(index: BlockIndex) -> None:
    index.add_worker("a")
    index.add_worker("b")
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2])
    index.clear_worker("a")
    index.store("a", [1, 5])
    index.speculate("a", [1, 5, 7])
    index.clear_worker("a")  # twice before a sweep: two of a's bits retired
    index.store("a", [1, 6])
    index.remove_worker("b")  # while a's old bits are still retired
    index.add_worker("b")  # back: a bit that was neither its own nor a's
    index.add_worker("c")
    assert index.pending_sweep() == 3 + 2 + 1 + 2
    assert index.match([1, 2, 3]) == {"a": 1}
    assert index.match([1, 5, 7]) == {"a": 1}
    assert index.match([1, 6]) == {"a": 2}
    assert (index.num_blocks("a"), index.num_blocks("b"), len(index)) == (2, 0, 2)
    assert_no_stray_bits(index)
    bits = {index._workers[w].bit for w in ("a", "b", "c")}
    assert len(bits) == 3 and max(bits).bit_length() == 6  # 3 retired below them

    while index.sweep(2):
        assert_no_stray_bits(index)
    assert holders(index) == {1: {"a"}, 6: {"a"}}
    assert_table_is_exact(index)
    index.add_worker("d")  # takes a swept bit: inherits nothing
    assert index.match([1, 2, 3]) == {"a": 1}
    assert index.match([1, 5]) == {"a": 1}
    index.store("d", [1, 2])
    assert index.match([1, 2, 3]) == {"a": 1, "d": 2}


def test_churn_keeps_a_worker_log_bounded(index: BlockIndex) -> None:
    """The same blocks evicted and stored again and again (a popular prefix under memory
    pressure) leave the worker's log a few times its size, not growing with the churn."""
    index.add_worker("a")
    index.add_worker("b")
    keys = list(range(10_000, 11_000))
    index.store("b", keys[:500])
    longest = 0
    for _ in range(50):
        for i in range(0, len(keys), 16):
            index.store("a", keys[i : i + 16])
        w, job = index._workers["a"], index._compaction
        backlog = len(job.src) - job.pos if job is not None and job.src is not None else 0
        longest = max(longest, len(w.log) + backlog)
        assert set(keys) <= set(w.log) | set(job.src[job.pos :] if backlog else [])
        index.remove("a", keys)
        assert index.match(keys) == {"b": 500}
    assert longest <= 3 * len(keys) + index._compact_slack
    assert index.num_blocks("a") == 0
    index.store("a", keys[:10])
    assert index.num_blocks("a") == 10 and index.match(keys) == {"a": 10, "b": 500}


@pytest.mark.parametrize(("n_holders", "limit"), [(1, 100), (2, 60)])
def test_memory_per_entry(n_holders: int, limit: int) -> None:
    """Bytes per (block, worker) entry: a key with one holder costs its int, its dict slot
    and 8 bytes of log; a second holder adds little more than its own log entry."""
    rng = random.Random(7)
    workers = [f"w{i}" for i in range(8)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex()
        for w in workers:
            index.add_worker(w)
        # 200k distinct 64-bit keys (top bit set: the widest ints), each on `n_holders` of 8
        # workers; the keys are created inside the trace, since in service the index keeps
        # them alive.
        for _ in range(200):
            chunk = [rng.getrandbits(63) | (1 << 63) for _ in range(1000)]
            for h in chunk:
                for w in rng.sample(workers, n_holders):
                    index.store(w, (h,))
            del chunk
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 200_000 * n_holders
    per_entry = used / len(index)
    assert per_entry <= limit, f"{per_entry:.0f} bytes per entry"
    # The debug figure is a rough estimate of the same thing.
    assert 0.5 * used <= index.summary()["approx_bytes"] <= 2 * used


# ---- property: the index against a brute-force model ----

SPEC_TTL, APPROX_TTL, APPROX_CAPACITY = 2.0, 5.0, 4
WORKERS = ["w0", "w1", "w2", "w3"]
# Few key values, reused across chains and positions, so workers share blocks and prefixes.
BASE_CHAINS = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 3], [10, 2, 3, 11, 1, 12]]
hash_values = st.integers(min_value=1, max_value=12)
chains = st.one_of(
    st.builds(lambda base, n: base[:n], st.sampled_from(BASE_CHAINS), st.integers(0, 6)),
    st.lists(hash_values, max_size=7),
)
mediums = st.sampled_from(["GPU", "gpu", None, "CPU", "disk"])
events = st.one_of(
    st.builds(stored, chains, mediums),
    st.builds(removed, st.lists(hash_values, max_size=4), mediums),
    st.just(AllBlocksCleared()),
    st.just(UnknownEvent(tag="Future", raw={"type": "Future"})),
)


class Model:
    """What the index should answer, computed the slow obvious way."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.tracked: dict[str, bool] = {}
        self.blocks: dict[str, set[int]] = {}
        self.spec: dict[str, dict[int, tuple[float, int]]] = {}  # key -> (expiry, last routed)
        self.routed = 0

    def add(self, w: str, tracked: bool) -> None:
        self.tracked[w], self.blocks[w], self.spec[w] = tracked, set(), {}

    def drop(self, w: str) -> None:
        del self.tracked[w], self.blocks[w], self.spec[w]

    def clear(self, w: str) -> None:
        self.blocks[w], self.spec[w] = set(), {}

    def store(self, w: str, hashes: list[int]) -> None:
        self.blocks[w].update(hashes)
        for h in hashes:
            self.spec[w].pop(h, None)

    def remove(self, w: str, hashes: list[int]) -> None:
        self.blocks[w].difference_update(hashes)
        for h in hashes:
            self.spec[w].pop(h, None)

    def apply(self, w: str, events: list[KVCacheEvent | UnknownEvent]) -> int:
        applied = 0
        for e in events:
            on_gpu = getattr(e, "medium", None) in (None, "GPU", "gpu")
            if isinstance(e, BlockStored) and on_gpu:
                self.store(w, e.block_hashes)
            elif isinstance(e, BlockRemoved) and on_gpu:
                self.remove(w, e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.clear(w)
            else:
                continue
            applied += 1
        return applied

    def speculate(self, w: str, hashes: list[int]) -> list[int]:
        now = self.clock.now
        ttl = SPEC_TTL if self.tracked[w] else APPROX_TTL
        added: list[int] = []
        for h in reversed(hashes):  # the chain's head counts as the most recently routed
            if h not in self.blocks[w]:
                old = self.spec[w].get(h)
                if old is None or old[0] <= now:
                    added.insert(0, h)
                self.routed += 1
                self.spec[w][h] = (now + ttl, self.routed)
        if not self.tracked[w]:
            live = {h: v for h, v in self.spec[w].items() if v[0] > now}
            while len(live) > APPROX_CAPACITY:
                del live[min(live, key=lambda h: live[h][1])]
            self.spec[w] = live
        return added

    def withdraw(self, w: str, hashes: list[int]) -> None:
        for h in hashes:
            self.spec[w].pop(h, None)

    def held(self, w: str, h: int) -> bool:
        spec = self.spec[w].get(h)
        return h in self.blocks[w] or (spec is not None and spec[0] > self.clock.now)

    def num_speculative(self, w: str) -> int:
        return sum(1 for expiry, _ in self.spec[w].values() if expiry > self.clock.now)

    def holders(self) -> dict[int, frozenset[str]]:
        out: dict[int, frozenset[str]] = {}
        for h in range(1, 13):
            ids = frozenset(w for w in self.tracked if self.held(w, h))
            if ids:
                out[h] = ids
        return out

    def match(self, hashes: list[int]) -> dict[str, int]:
        result = {}
        for w in self.tracked:
            n = 0
            while n < len(hashes) and self.held(w, hashes[n]):
                n += 1
            if n:
                result[w] = n
        return result


class IndexMatchesModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.index = BlockIndex(
            speculative_ttl=SPEC_TTL,
            approx_ttl=APPROX_TTL,
            approx_capacity_blocks=APPROX_CAPACITY,
            clock=self.clock,
        )
        # Compaction of the smallest logs, one entry a step: one is under way most of the
        # time, across clears, removals and sweeps.
        self.index._compact_slack = 0
        self.index._compact_work = 1
        self.model = Model(self.clock)

    @initialize(tracked=st.lists(st.booleans(), min_size=1, max_size=len(WORKERS)))
    def start_with_workers(self, tracked: list[bool]) -> None:
        for w, flag in zip(WORKERS, tracked, strict=False):
            self.index.add_worker(w, tracked=flag)
            self.model.add(w, flag)

    def _known(self, w: str) -> bool:
        """Whether the index may act for ``w``; an unknown worker must be a KeyError."""
        if w in self.model.tracked:
            return True
        with pytest.raises(KeyError):
            self.index.store(w, [1])
        return False

    @rule(w=st.sampled_from(WORKERS), tracked=st.booleans())
    def add_worker(self, w: str, tracked: bool) -> None:
        if w in self.model.tracked:
            with pytest.raises(ValueError):
                self.index.add_worker(w, tracked=tracked)
        else:
            self.index.add_worker(w, tracked=tracked)
            self.model.add(w, tracked)

    @rule(w=st.sampled_from(WORKERS))
    def remove_worker(self, w: str) -> None:
        if self._known(w):
            self.index.remove_worker(w)
            self.model.drop(w)

    @rule(w=st.sampled_from(WORKERS))
    def clear_worker(self, w: str) -> None:
        if self._known(w):
            self.index.clear_worker(w)
            self.model.clear(w)

    @rule(w=st.sampled_from(WORKERS), hashes=chains)
    def store(self, w: str, hashes: list[int]) -> None:
        if self._known(w):
            self.index.store(w, hashes)
            self.model.store(w, hashes)

    @rule(w=st.sampled_from(WORKERS), hashes=st.lists(hash_values, max_size=4))
    def remove(self, w: str, hashes: list[int]) -> None:
        if self._known(w):
            self.index.remove(w, hashes)
            self.model.remove(w, hashes)

    @rule(w=st.sampled_from(WORKERS), hashes=chains, times=st.integers(1, 3))
    def evict_and_store_again(self, w: str, hashes: list[int], times: int) -> None:
        """A prefix evicted and computed again: dead entries pile up in the worker's log
        until a compaction rewrites it."""
        if self._known(w):
            for _ in range(times):
                self.index.remove(w, hashes)
                self.model.remove(w, hashes)
                self.index.store(w, hashes)
                self.model.store(w, hashes)

    @rule(w=st.sampled_from(WORKERS), hashes=chains)
    def speculate_then_store(self, w: str, hashes: list[int]) -> None:
        """The usual course: routed there, then the worker's events confirm the guess."""
        if self._known(w):
            assert self.index.speculate(w, hashes) == self.model.speculate(w, hashes)
            self.index.store(w, hashes[: len(hashes) // 2 + 1])
            self.model.store(w, hashes[: len(hashes) // 2 + 1])

    @rule(w=st.sampled_from(WORKERS), evs=st.lists(events, max_size=4))
    def apply(self, w: str, evs: list[KVCacheEvent | UnknownEvent]) -> None:
        if self._known(w):
            assert self.index.apply(w, batch(*evs)) == self.model.apply(w, evs)

    @rule(w=st.sampled_from(WORKERS), hashes=chains)
    def speculate(self, w: str, hashes: list[int]) -> None:
        if self._known(w):
            assert self.index.speculate(w, hashes) == self.model.speculate(w, hashes)

    @rule(w=st.sampled_from(WORKERS), hashes=st.lists(hash_values, max_size=4))
    def withdraw(self, w: str, hashes: list[int]) -> None:
        if self._known(w):
            self.index.withdraw(w, hashes)
            self.model.withdraw(w, hashes)

    @rule(w=st.sampled_from(WORKERS), hashes=chains)
    def speculate_then_withdraw(self, w: str, hashes: list[int]) -> None:
        """A failed attempt takes back its speculation: every match is as before (unless
        the speculation evicted older guesses of an untracked worker for room)."""
        if not self._known(w):
            return
        probes = [hashes, *BASE_CHAINS, *([h] for h in range(1, 13))]
        before = [self.index.match(p) for p in probes]
        room = APPROX_CAPACITY - self.model.num_speculative(w)
        added = self.index.speculate(w, hashes)
        assert added == self.model.speculate(w, hashes)
        self.index.withdraw(w, added)
        self.model.withdraw(w, added)
        if self.model.tracked[w] or len(added) <= room:
            assert [self.index.match(p) for p in probes] == before

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(hashes=chains)
    def match(self, hashes: list[int]) -> None:
        assert self.index.match(hashes) == self.model.match(hashes)

    @rule(max_keys=st.integers(1, 4))
    def sweep(self, max_keys: int) -> None:
        before = self.index.pending_sweep()
        assert self.index.sweep(max_keys) == before - min(before, max_keys)

    @rule()
    def sweep_everything(self) -> None:
        while self.index.sweep(3):
            pass
        assert_table_is_exact(self.index)

    @invariant()
    def table_holds_what_the_model_holds(self) -> None:
        """Every key's live bits are its holders', no bit is stray, and each worker's log
        has every block it holds (else a clear would leave a bit behind)."""
        self.index.match([])  # let expired guesses go, as every query does first
        assert_no_stray_bits(self.index)
        assert holders(self.index) == self.model.holders()
        job = self.index._compaction
        for w, blocks in self.model.blocks.items():
            worker = self.index._workers[w]
            logged = set(worker.log)
            if job is not None and job.worker is worker and job.src is not None:
                logged |= set(job.src[job.pos :])
            assert blocks <= logged

    @invariant()
    def every_key_and_base_chain_matches(self) -> None:
        for chain in [*BASE_CHAINS, *([h] for h in range(1, 13))]:
            assert self.index.match(chain) == self.model.match(chain)

    @invariant()
    def counts_agree(self) -> None:
        assert sorted(self.index.workers()) == sorted(self.model.tracked)
        assert len(self.index) == sum(len(b) for b in self.model.blocks.values())
        for w in self.model.tracked:
            assert self.index.num_blocks(w) == len(self.model.blocks[w])
            assert self.index.num_speculative(w) == self.model.num_speculative(w)


IndexMatchesModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_index_matches_brute_force_model = IndexMatchesModel.TestCase
