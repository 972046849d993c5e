from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator

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
from kvpool.router.index import BlockIndex


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
    index.add_worker("c")  # takes a's bit
    assert index.match([1, 2, 3]) == {"b": 1}
    assert "a" not in index and "c" in index
    assert index.summary()["distinct_blocks"] == 1
    index.store("c", [1, 2])
    assert index.match([1, 2, 3]) == {"b": 1, "c": 2}


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
    assert summary["distinct_blocks"] == 3
    assert summary["approx_bytes"] > 0


def test_memory_per_entry_under_200_bytes() -> None:
    rng = random.Random(7)
    workers = [f"w{i}" for i in range(8)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = BlockIndex()
        for w in workers:
            index.add_worker(w)
        # 200k distinct 64-bit keys (top bit set: the widest ints), each on 2 of 8 workers;
        # the keys are created inside the trace, since in service the index keeps them alive.
        for _ in range(200):
            chunk = [rng.getrandbits(63) | (1 << 63) for _ in range(1000)]
            for h in chunk:
                for w in rng.sample(workers, 2):
                    index.store(w, (h,))
            del chunk
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index) == 400_000
    per_entry = used / len(index)
    assert per_entry <= 200, f"{per_entry:.0f} bytes per entry"
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
