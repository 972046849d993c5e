"""Flow control: the router's waiting room under saturation (pure, on a simulated clock)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.openai_api import OpenAIError
from kvpool.router.admission.entries import (
    ENTRY_OVERHEAD_BYTES,
    Band,
    Entry,
    QueueRefused,
    parse_band,
    shed_error,
)
from kvpool.router.admission.flow import FairQueue

HIGH, NORMAL, LOW = Band.HIGH, Band.NORMAL, Band.LOW


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Shed(list[tuple[Entry, str]]):
    """Collects what the queue sheds by itself, as the server's callback would."""

    def __call__(self, entry: Entry, reason: str) -> None:
        self.append((entry, reason))


def queue(clock: Clock | None = None, shed: Shed | None = None, **kw: int) -> FairQueue:
    kw.setdefault("max_requests", 1000)
    kw.setdefault("max_bytes", 10**9)
    return FairQueue(
        on_shed=shed if shed is not None else Shed(),
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )


def drain(q: FairQueue) -> list[Entry]:
    out = []
    while (e := q.pop_next()) is not None:
        out.append(e)
    return out


def measure_rate(q: FairQueue, clock: Clock, tenant: str = "bulk", pops: int = 10) -> None:
    """Pop ``pops`` entries 0.1 s apart: one backlogged window of 1 s closes."""
    for _ in range(pops):
        clock.now += 0.1
        assert q.pop_next() is not None


# -- ordering ----------------------------------------------------------------------------


def test_a_high_request_leaves_before_every_normal_and_low_one() -> None:
    q = queue()
    low = q.push(LOW, "batch", cost=10, size=0)
    normal = q.push(NORMAL, "team", cost=10, size=0)
    high = q.push(HIGH, "vip", cost=10, size=0)
    assert drain(q) == [high, normal, low]


def test_one_tenants_requests_leave_in_arrival_order() -> None:
    q = queue()
    mine = [q.push(NORMAL, "a", cost=c, size=0) for c in (50, 1, 30, 7)]
    assert drain(q) == mine


def test_two_tenants_get_equal_tokens_not_equal_request_counts() -> None:
    q = queue(max_requests=2000)
    for _ in range(100):
        q.push(NORMAL, "big", cost=100, size=0)
    for _ in range(1000):
        q.push(NORMAL, "small", cost=10, size=0)
    served = {"big": 0, "small": 0}
    for _ in range(200):
        e = q.pop_next()
        assert e is not None
        served[e.tenant] += e.cost
    # 200 pops: about 18 big ones and 182 small ones, the same tokens each
    assert abs(served["big"] - served["small"]) <= 100
    assert served["big"] > 800


def test_a_tenant_with_twice_the_weight_gets_twice_the_tokens() -> None:
    q = queue()
    for _ in range(300):
        q.push(NORMAL, "gold", cost=10, size=0, weight=2.0)
        q.push(NORMAL, "plain", cost=10, size=0, weight=1.0)
    served = {"gold": 0, "plain": 0}
    for _ in range(300):
        e = q.pop_next()
        assert e is not None
        served[e.tenant] += e.cost
    assert served["gold"] == pytest.approx(2 * served["plain"], abs=20)


def test_idle_time_is_not_banked_as_credit() -> None:
    q = queue()
    for _ in range(200):
        q.push(NORMAL, "busy", cost=10, size=0)
    for _ in range(100):
        q.pop_next()  # busy alone: 1000 tokens served, nobody else wanted any
    for _ in range(100):
        q.push(NORMAL, "late", cost=10, size=0)
    # the latecomer shares from now on; it does not get 1000 tokens in a row
    order = [q.pop_next().tenant for _ in range(20)]  # type: ignore[union-attr]
    assert order.count("late") == 10


def test_a_tenant_that_pauses_briefly_keeps_its_place_not_a_fresh_one() -> None:
    q = queue()
    for _ in range(50):
        q.push(NORMAL, "steady", cost=10, size=0)
    q.push(NORMAL, "bursty", cost=300, size=0)
    popped = [q.pop_next() for _ in range(2)]
    assert [e.tenant for e in popped] == ["steady", "bursty"]  # type: ignore[union-attr]
    # bursty is idle now, 300 tokens ahead of steady; coming back does not erase that
    q.push(NORMAL, "bursty", cost=10, size=0)
    # steady is served from 10 to 300 tokens first (29 requests), then they alternate
    order = [q.pop_next().tenant for _ in range(31)]  # type: ignore[union-attr]
    assert order == ["steady"] * 29 + ["bursty", "steady"]


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.integers(1, 100), min_size=150, max_size=150),
    b=st.lists(st.integers(1, 100), min_size=150, max_size=150),
    head_start=st.integers(0, 40),
)
def test_token_fairness_holds_within_one_request_size_over_a_long_run(
    a: list[int], b: list[int], head_start: int
) -> None:
    q = queue()
    for c in a:
        q.push(NORMAL, "a", cost=c, size=0)
    for _ in range(head_start):
        q.pop_next()  # a alone for a while: none of it counts against b
    left = {"a": len(a) - head_start, "b": len(b)}
    for c in b:
        q.push(NORMAL, "b", cost=c, size=0)
    served = {"a": 0, "b": 0}
    while left["a"] and left["b"]:
        e = q.pop_next()
        assert e is not None
        served[e.tenant] += e.cost
        left[e.tenant] -= 1
        assert abs(served["a"] - served["b"]) <= 100


def test_settling_real_usage_corrects_a_tenants_share() -> None:
    q = queue()
    for _ in range(50):
        q.push(NORMAL, "a", cost=100, size=0)
        q.push(NORMAL, "b", cost=100, size=0)
    served = {"a": 0, "b": 0}
    for _ in range(22):
        e = q.pop_next()
        assert e is not None
        if e.tenant == "a":
            q.settle(e, 10)  # each reserved 100 (its max_tokens) and used 10
        served[e.tenant] += 1
    # a's requests really cost a tenth of b's: it gets about ten of them per one of b's
    assert served["a"] >= 5 * served["b"]


def test_peek_shows_the_next_entry_without_taking_it() -> None:
    q = queue()
    assert q.peek() is None
    low = q.push("low", "batch", cost=10, size=0)  # a band's label works as well
    high = q.push("high", "vip", cost=10, size=0)
    assert q.peek() is high and len(q) == 2  # the dispatcher checks the pool can take it
    assert q.remove(high)
    assert q.peek() is low
    assert q.pop_next() is low
    assert q.depth_by_band() == {"high": 0, "normal": 0, "low": 0}


def test_service_outside_the_queue_counts_its_last_request_not_the_quiet_period() -> None:
    q = queue()
    for _ in range(100):  # an hour of heavy direct use while the pool was not saturated
        q.charge(NORMAL, "heavy", 1000)
    q.charge(NORMAL, "light", 10)
    q.charge(NORMAL, "heavy", 500)  # its last request before saturation
    light = [q.push(NORMAL, "light", cost=100, size=0) for _ in range(10)]
    heavy = [q.push(NORMAL, "heavy", cost=100, size=0) for _ in range(10)]
    order = drain(q)
    # light goes first for the 500 tokens of heavy's last request, then they alternate
    assert order[:5] == light[:5]
    assert [e.tenant for e in order[5:9]] == ["heavy", "light", "heavy", "light"]
    assert set(order) == set(heavy + light)


def test_service_outside_the_queue_counts_while_a_tenant_waits() -> None:
    q = queue()
    a = [q.push(NORMAL, "a", cost=10, size=0) for _ in range(3)]
    b = [q.push(NORMAL, "b", cost=10, size=0) for _ in range(3)]
    q.charge(NORMAL, "a", 25)  # a had more served elsewhere meanwhile
    assert drain(q)[:4] == [b[0], b[1], b[2], a[0]]


# -- bounds and displacement ---------------------------------------------------------------


def test_a_push_over_the_count_bound_is_refused_with_queue_full() -> None:
    q = queue(max_requests=3)
    for _ in range(3):
        q.push(NORMAL, "a", cost=1, size=0)
    with pytest.raises(QueueRefused) as exc:
        q.push(NORMAL, "a", cost=1, size=0)
    assert exc.value.reason == "queue_full"
    assert exc.value.status == 429
    assert exc.value.body()["error"]["code"] == "queue_full"
    assert exc.value.headers["Retry-After"] == "1"
    assert len(q) == 3
    assert q.stats().shed == {"queue_full": 1}


def test_a_push_over_the_byte_bound_is_refused_with_queue_bytes() -> None:
    q = queue(max_bytes=2 * (1000 + ENTRY_OVERHEAD_BYTES))
    q.push(NORMAL, "a", cost=1, size=1000)
    q.push(NORMAL, "a", cost=1, size=999)
    with pytest.raises(QueueRefused) as exc:
        q.push(NORMAL, "a", cost=1, size=2)
    assert exc.value.reason == "queue_bytes"
    with pytest.raises(QueueRefused, match="more than its whole bound"):
        q.push(HIGH, "b", cost=1, size=10**6)
    assert q.bytes == 1999 + 2 * ENTRY_OVERHEAD_BYTES


def test_a_flooding_tenant_gives_its_newest_place_to_another_tenant() -> None:
    shed = Shed()
    q = queue(shed=shed, max_requests=4)
    flood = [q.push(NORMAL, "flood", cost=10, size=0) for _ in range(4)]
    mine = q.push(NORMAL, "polite", cost=10, size=0)
    assert shed == [(flood[-1], "displaced")]
    assert flood[-1].state == "shed"
    assert shed_error(flood[-1]).status == 429
    # the flood's own next request is the one refused
    with pytest.raises(QueueRefused) as exc:
        q.push(NORMAL, "flood", cost=10, size=0)
    assert exc.value.reason == "queue_full"
    assert mine in drain(q)[:2]


def test_a_full_queue_of_low_requests_makes_room_for_a_high_one() -> None:
    shed = Shed()
    q = queue(shed=shed, max_requests=2)
    low = [q.push(LOW, "batch", cost=10, size=0) for _ in range(2)]
    high = q.push(HIGH, "vip", cost=10, size=0)
    assert shed == [(low[1], "displaced")]
    assert drain(q) == [high, low[0]]


def test_a_low_request_never_displaces_a_higher_one() -> None:
    shed = Shed()
    q = queue(shed=shed, max_requests=2)
    q.push(NORMAL, "a", cost=10, size=0)
    q.push(HIGH, "b", cost=10, size=0)
    with pytest.raises(QueueRefused):
        q.push(LOW, "c", cost=10, size=0)
    assert shed == []
    assert len(q) == 2


def test_a_refused_push_displaces_nothing() -> None:
    shed = Shed()
    q = queue(shed=shed, max_requests=10, max_bytes=3 * (100 + ENTRY_OVERHEAD_BYTES))
    q.push(LOW, "batch", cost=10, size=100)
    q.push(HIGH, "vip", cost=10, size=100)
    q.push(HIGH, "vip", cost=10, size=100)
    # even displacing the low entry would not make room for this one
    with pytest.raises(QueueRefused) as exc:
        q.push(HIGH, "other", cost=10, size=100 + 2 * (100 + ENTRY_OVERHEAD_BYTES))
    assert exc.value.reason == "queue_bytes"
    assert shed == [] and len(q) == 3


# -- cancellation --------------------------------------------------------------------------


def test_a_cancelled_request_is_never_dispatched_and_frees_its_place() -> None:
    q = queue(max_requests=2)
    gone = q.push(NORMAL, "a", cost=10, size=100)
    stays = q.push(NORMAL, "a", cost=10, size=100)
    assert q.remove(gone) is True
    assert q.remove(gone) is False  # already gone: nothing to do
    assert q.bytes == 100 + ENTRY_OVERHEAD_BYTES
    assert gone.state == "cancelled"
    again = q.push(NORMAL, "b", cost=10, size=0)
    assert drain(q) == [stays, again]
    assert q.remove(stays) is False  # dispatched already
    assert q.stats().cancelled == 1


# -- deadlines and predicted wait ----------------------------------------------------------


def test_no_request_is_shed_by_prediction_before_the_drain_rate_is_measured() -> None:
    clock = Clock()
    q = queue(clock)
    for _ in range(500):
        q.push(NORMAL, "bulk", cost=100, size=0)
    assert q.predicted_wait(LOW, "x") is None
    q.push(LOW, "x", cost=10, size=0, deadline=clock.now + 0.001)  # not shed


def test_predicted_wait_counts_tokens_ahead_over_the_drain_rate() -> None:
    clock = Clock()
    q = queue(clock)
    for _ in range(100):
        q.push(NORMAL, "bulk", cost=10, size=0)
    measure_rate(q, clock)  # 100 tokens in 1 s
    assert q.drain_rate == pytest.approx(100)
    assert q.predicted_wait(HIGH, "vip") == 0  # nothing of higher or equal band ahead
    assert q.predicted_wait(LOW, "batch") == pytest.approx(9.0)  # 900 normal tokens
    assert q.predicted_wait(NORMAL, "bulk") == pytest.approx(9.0)  # its own backlog
    assert q.predicted_wait(NORMAL, "newcomer") == pytest.approx(0.0)  # VTC: its turn next
    q.push(NORMAL, "other", cost=200, size=0)
    # other's next request starts where its first ends, 200 tokens on: its own 200 and
    # 200 of bulk's (served meanwhile, fairly) are ahead of it
    assert q.predicted_wait(NORMAL, "other") == pytest.approx(4.0)


def test_a_request_whose_deadline_the_queue_cannot_meet_is_shed_at_once() -> None:
    clock = Clock()
    q = queue(clock)
    for _ in range(100):
        q.push(NORMAL, "bulk", cost=10, size=0)
    measure_rate(q, clock)
    with pytest.raises(QueueRefused) as exc:
        q.push(LOW, "batch", cost=10, size=0, deadline=clock.now + 5.0)  # needs 9 s
    assert exc.value.reason == "deadline"
    assert exc.value.status == 503
    assert exc.value.headers["Retry-After"] == "9"
    assert exc.value.retry_after_s == pytest.approx(9.0)
    assert len(q) == 90
    ok = q.push(LOW, "batch", cost=10, size=0, deadline=clock.now + 10.0)
    assert ok.state == "queued"
    assert q.stats().shed == {"deadline": 1}


def test_a_request_whose_deadline_has_passed_is_refused() -> None:
    clock = Clock()
    q = queue(clock)
    with pytest.raises(QueueRefused, match="deadline"):
        q.push(HIGH, "a", cost=1, size=0, deadline=clock.now - 0.5)


def test_a_waiting_request_is_shed_when_its_deadline_passes() -> None:
    clock = Clock()
    shed = Shed()
    q = queue(clock, shed)
    late = q.push(NORMAL, "a", cost=10, size=100, deadline=clock.now + 2.0)
    patient = q.push(NORMAL, "a", cost=10, size=100)
    assert q.next_deadline() == clock.now + 2.0
    clock.now += 1.0
    assert q.expire() == 0
    clock.now += 1.5
    assert q.expire() == 1
    assert shed == [(late, "deadline")]
    assert late.waited_s == pytest.approx(2.5)
    assert shed_error(late, 1.2).headers["Retry-After"] == "2"
    assert q.next_deadline() is None
    assert q.bytes == 100 + ENTRY_OVERHEAD_BYTES
    assert drain(q) == [patient]


def test_pop_never_returns_an_entry_past_its_deadline() -> None:
    clock = Clock()
    shed = Shed()
    q = queue(clock, shed)
    expired = q.push(HIGH, "a", cost=10, size=0, deadline=clock.now + 1.0)
    clock.now += 5
    assert q.pop_next() is None
    assert shed == [(expired, "deadline")]


# -- counters ------------------------------------------------------------------------------


def test_counters_report_depth_wait_sheds_and_tokens_by_tenant() -> None:
    clock = Clock()
    q = queue(clock, max_requests=3)
    q.push(HIGH, "vip", cost=5, size=0)
    q.push(LOW, "batch", cost=50, size=0)
    q.push(LOW, "batch", cost=70, size=0)
    with pytest.raises(QueueRefused):
        q.push(LOW, "batch", cost=1, size=0)
    s = q.stats()
    assert s.depth == {HIGH: 1, NORMAL: 0, LOW: 2}
    clock.now += 2.0
    vip = q.pop_next()
    assert vip is not None and vip.waited_s == pytest.approx(2.0)
    clock.now += 1.0
    q.pop_next()
    s = q.stats()
    assert s.depth == {HIGH: 0, NORMAL: 0, LOW: 1}
    assert s.popped == {HIGH: 1, NORMAL: 0, LOW: 1}
    assert s.wait_seconds_sum[HIGH] == pytest.approx(2.0)
    assert s.wait_seconds_sum[LOW] == pytest.approx(3.0)
    assert s.shed == {"queue_full": 1}
    assert s.dispatched_tokens == {"vip": 5, "batch": 50}


def test_a_priority_header_is_read_case_blind_and_a_bad_one_is_a_400() -> None:
    assert parse_band(" High ") is HIGH
    with pytest.raises(OpenAIError) as exc:
        parse_band("urgent", "x-kvpool-priority")
    assert exc.value.status == 400 and exc.value.param == "x-kvpool-priority"


# -- memory --------------------------------------------------------------------------------


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_ten_thousand_waiters_stay_within_the_memory_bound() -> None:
    n, size = 10_000, 1000
    bound = n * (size + ENTRY_OVERHEAD_BYTES)
    q = queue(max_requests=n, max_bytes=bound)
    tracemalloc.start()
    try:
        base = _traced()
        entries = [
            q.push(NORMAL, f"t{i % 10}", cost=100, size=size, payload=bytes(size)) for i in range(n)
        ]
        full = _traced() - base
        assert full <= bound * 1.1, f"{n} entries take {full} bytes, bound {bound}"
        refused = 0
        for i in range(n):
            try:
                q.push(NORMAL, f"t{i % 10}", cost=100, size=size, payload=bytes(size))
            except QueueRefused:
                refused += 1
        assert refused == n
        after = _traced() - base
        assert after - full < 64 * 1024, f"refused pushes grew memory by {after - full}"
        # the server drops its reference when a request is cancelled or timed out
        waiting: list[Entry | None] = list(entries)
        del entries
        for i in range(0, n, 2):
            assert q.remove(waiting[i])  # type: ignore[arg-type]
            waiting[i] = None
        half = _traced() - base
        assert half < full * 0.55, f"half the entries removed, {half} of {full} bytes left"
        for i in range(1, n, 2):
            assert q.remove(waiting[i])  # type: ignore[arg-type]
            waiting[i] = None
        del waiting
        assert _traced() - base < 64 * 1024
        assert q.bytes == 0 and len(q) == 0
    finally:
        tracemalloc.stop()


def test_tenants_that_left_leave_no_state_behind() -> None:
    clock = Clock()
    shed_count = 0

    def on_shed(entry: Entry, reason: str) -> None:
        nonlocal shed_count  # the server fails the request's future and lets go of it
        shed_count += 1

    q = FairQueue(max_requests=10_000, max_bytes=10**9, on_shed=on_shed, clock=clock)
    tracemalloc.start()
    try:
        # warm up once so lazily created structures exist before the baseline
        q.remove(q.push(NORMAL, "warm", cost=1, size=0, deadline=clock.now + 1))
        base = _traced()
        entries = [
            q.push(Band(i % 3), f"user-{i}", cost=10, size=0, deadline=clock.now + 1 + i % 2)
            for i in range(10_000)
        ]
        for e in entries[: len(entries) // 2]:
            q.remove(e)  # clients left
        del entries, e
        clock.now += 10
        assert q.expire() == 5_000 == shed_count  # the rest timed out
        assert len(q) == 0
        left = _traced() - base
        assert left < 64 * 1024, f"{left} bytes stayed behind for tenants that left"
    finally:
        tracemalloc.stop()


# -- invariants under any sequence of operations --------------------------------------------


class QueueMachine(RuleBasedStateMachine):
    """A model of what waits (push order) checked against the queue after every step."""

    MAX_REQUESTS = 8
    MAX_BYTES = 8 * ENTRY_OVERHEAD_BYTES + 3000

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.shed = Shed()
        self.q = FairQueue(
            max_requests=self.MAX_REQUESTS,
            max_bytes=self.MAX_BYTES,
            on_shed=self.shed,
            clock=self.clock,
        )
        self.live: list[Entry] = []
        self.gone: list[Entry] = []

    def _absorb_shed(self, pushed_band: Band | None = None) -> None:
        for e, reason in self.shed:
            assert e in self.live, "shed an entry that was not waiting"
            assert e.state == "shed" and e.shed_reason == reason
            if reason == "deadline":
                assert e.deadline is not None and e.deadline <= self.clock.now
            else:
                assert reason == "displaced" and pushed_band is not None
                assert e.band >= pushed_band, "displaced an entry of a higher band"
            self.live.remove(e)
            self.gone.append(e)
        self.shed.clear()

    @rule(
        band=st.sampled_from(Band),
        tenant=st.sampled_from(["a", "b", "c"]),
        cost=st.integers(0, 50),
        size=st.integers(0, 1500),
        deadline=st.none() | st.floats(0, 5),
        weight=st.sampled_from([0.5, 1.0, 3.0]),
    )
    def push(
        self, band: Band, tenant: str, cost: int, size: int, deadline: float | None, weight: float
    ) -> None:
        try:
            e = self.q.push(
                band,
                tenant,
                cost=cost,
                size=size,
                weight=weight,
                deadline=None if deadline is None else self.clock.now + deadline,
            )
        except QueueRefused as exc:
            assert exc.status in (429, 503)
            assert all(r == "deadline" for _, r in self.shed), "a refused push displaced"
            self._absorb_shed()
            return
        self._absorb_shed(band)
        self.live.append(e)

    @rule()
    def pop(self) -> None:
        e = self.q.pop_next()
        self._absorb_shed()
        if not self.live:
            assert e is None
            return
        assert e is not None and e in self.live
        assert e.band == min(x.band for x in self.live), "a lower band left first"
        same = [x for x in self.live if x.band == e.band and x.tenant == e.tenant]
        assert e is same[0], "a tenant's requests left out of order"
        assert e.state == "dispatched"
        self.live.remove(e)
        self.gone.append(e)

    @rule()
    def peek_then_pop(self) -> None:
        e = self.q.peek()
        self._absorb_shed()
        assert (e is None) == (not self.live)
        assert self.q.pop_next() is e
        if e is not None:
            self.live.remove(e)
            self.gone.append(e)

    @rule(band=st.sampled_from(Band), tenant=st.sampled_from(["a", "b", "c"]))
    def charge(self, band: Band, tenant: str) -> None:
        self.q.charge(band, tenant, 30)

    @precondition(lambda self: self.live or self.gone)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(self.live + self.gone))
        assert self.q.remove(e) is (e in self.live)
        if e in self.live:
            self.live.remove(e)
            self.gone.append(e)

    @rule(dt=st.floats(0, 2))
    def advance(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def accounting_is_exact(self) -> None:
        q = self.q
        assert len(q) == len(self.live) <= self.MAX_REQUESTS
        assert q.bytes == sum(e.size + ENTRY_OVERHEAD_BYTES for e in self.live)
        assert q.bytes <= self.MAX_BYTES
        for band in Band:
            mine = [e for e in self.live if e.band == band]
            assert q.depth(band) == len(mine)
            assert q.queued_tokens(band) == sum(e.cost for e in mine)
        deadlines = [e.deadline for e in self.live if e.deadline is not None]
        assert q.next_deadline() == (min(deadlines) if deadlines else None)


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
