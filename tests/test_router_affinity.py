"""Session affinity's memory: which worker each conversation was last sent to (pure)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.router.routing.affinity import MAX_KEY_CHARS, SessionAffinity


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_is_remembered_on_its_latest_worker() -> None:
    sessions = SessionAffinity()
    assert sessions.get("chat-1") is None
    sessions.remember("chat-1", "w0")
    sessions.remember("chat-1", "w2")  # load moved it
    assert sessions.get("chat-1") == "w2"
    assert len(sessions) == 1


def test_a_session_unused_for_the_ttl_is_forgotten() -> None:
    clock = Clock()
    sessions = SessionAffinity(ttl_s=60, clock=clock)
    sessions.remember("chat-1", "w0")
    clock.now += 59
    assert sessions.get("chat-1") == "w0"  # a read does not keep it alive...
    sessions.remember("chat-1", "w0")  # ...routing its next turn does
    clock.now += 59
    assert sessions.get("chat-1") == "w0"
    clock.now += 1
    assert sessions.get("chat-1") is None
    assert len(sessions) == 0


def test_the_least_recently_used_session_goes_first_when_full() -> None:
    sessions = SessionAffinity(capacity=2)
    sessions.remember("a", "w0")
    sessions.remember("b", "w1")
    sessions.remember("a", "w0")  # a is now the more recent
    sessions.remember("c", "w2")
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == ("w0", None, "w2")


def test_forget_worker_drops_only_that_workers_sessions() -> None:
    sessions = SessionAffinity()
    sessions.remember("a", "w0")
    sessions.remember("b", "w1")
    sessions.remember("c", "w0")
    sessions.remember("c", "w1")  # moved off w0: not w0's any more
    sessions.forget_worker("w0")
    assert (sessions.get("a"), sessions.get("b"), sessions.get("c")) == (None, "w1", "w1")
    sessions.forget_worker("gone")  # unknown: nothing happens
    assert len(sessions) == 2


def test_long_keys_are_kept_as_a_digest_and_never_collide_with_short_ones() -> None:
    sessions = SessionAffinity()
    long_a, long_b = "a" * (MAX_KEY_CHARS + 1), "a" * MAX_KEY_CHARS + "b"
    sessions.remember(long_a, "w0")
    sessions.remember(long_b, "w1")
    sessions.remember("a" * MAX_KEY_CHARS, "w2")  # at the limit: kept as it is
    assert (sessions.get(long_a), sessions.get(long_b)) == ("w0", "w1")
    assert sessions.get("a" * MAX_KEY_CHARS) == "w2"
    stored = list(sessions._entries)
    assert all(len(k) <= MAX_KEY_CHARS for k in stored)
    assert sum(isinstance(k, bytes) for k in stored) == 2


def test_a_bad_capacity_or_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        SessionAffinity(capacity=0)
    with pytest.raises(ValueError, match="ttl_s"):
        SessionAffinity(ttl_s=0)


KEYS = st.sampled_from([f"s{i}" for i in range(12)] + ["x" * 300, "x" * 299 + "y"])
WORKERS = st.sampled_from(["w0", "w1", "w2", "w3"])


class SessionMachine(RuleBasedStateMachine):
    """SessionAffinity against a plain dict of (worker, last used) with a moving clock."""

    capacity = 5
    ttl = 10.0

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.sessions = SessionAffinity(self.capacity, self.ttl, clock=self.clock)
        self.model: dict[str, tuple[str, float]] = {}  # insertion order: least recent first

    def _live(self) -> dict[str, str]:
        now = self.clock.now
        return {k: w for k, (w, used) in self.model.items() if now - used < self.ttl}

    @rule(key=KEYS, worker=WORKERS)
    def remember(self, key: str, worker: str) -> None:
        self.sessions.remember(key, worker)
        self.model.pop(key, None)
        self.model[key] = (worker, self.clock.now)
        self.model = {k: v for k, v in self.model.items() if k in self._live()}
        while len(self.model) > self.capacity:
            del self.model[next(iter(self.model))]

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        assert self.sessions.get(key) == self._live().get(key)

    @rule(worker=WORKERS)
    def forget_worker(self, worker: str) -> None:
        self.sessions.forget_worker(worker)
        self.model = {k: v for k, v in self.model.items() if v[0] != worker}

    @rule(seconds=st.sampled_from([0.0, 0.5, 3.0, 9.99, 10.0, 25.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        assert len(self.sessions._entries) <= self.capacity

    @invariant()
    def holds_exactly_the_live_sessions(self) -> None:
        assert len(self.sessions) == len(self._live())

    @invariant()
    def reverse_index_matches_the_entries(self) -> None:
        by_worker: dict[str, set[object]] = {}
        for k, (w, _) in self.sessions._entries.items():
            by_worker.setdefault(w, set()).add(k)
        assert self.sessions._by_worker == by_worker


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
