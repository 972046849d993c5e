"""The SLO autoscaler over simulated time: a loop calls ``decide`` every 15 s with metric
series drawn from a small model of the pool, applies what it decides, and the tests look
at the replica counts that follow."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.operator.autoscaler import (
    AutoscalerState,
    Behavior,
    Bounds,
    Recommendation,
    RoleSignals,
    ScalingPolicy,
    Signals,
    compact,
    decide,
)

TICK = 15.0
TTFT_TARGET = 0.5
ITL_TARGET = 0.05

AGGREGATED = ScalingPolicy(
    decode=Bounds(1, 8), prefill=None, ttft_target_s=TTFT_TARGET, itl_target_s=ITL_TARGET
)
DISAGGREGATED = replace(AGGREGATED, prefill=Bounds(1, 8))


def role(
    replicas: int,
    ready: int | None = None,
    *,
    waiting: float | None = 0.0,
    kv: float | None = 0.3,
    queued: float | None = 0.0,
    rate: float | None = 8000.0,
) -> RoleSignals:
    return RoleSignals(
        replicas=replicas,
        ready_replicas=replicas if ready is None else ready,
        waiting_requests=waiting,
        kv_usage=kv,
        queued_prefill_tokens=queued,
        prefill_rate_tokens_per_s=rate,
    )


@dataclass
class Pool:
    """Replica counts as a Deployment would have them: new replicas become ready
    ``ready_after`` seconds after they are asked for."""

    replicas: dict[str, int]
    ready_after: float = 0.0
    ready_at: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ready_at = {r: [-math.inf] * n for r, n in self.replicas.items()}

    def ready(self, role: str, now: float) -> int:
        return sum(t <= now for t in self.ready_at[role])

    def scale(self, role: str, desired: int, now: float) -> None:
        times = sorted(self.ready_at[role])  # scaling down removes the newest (not ready) first
        if desired > len(times):
            times += [now + self.ready_after] * (desired - len(times))
        self.ready_at[role] = times[:desired]
        self.replicas[role] = desired


# what the pool's metrics look like at a time, for the replicas it has and has ready
Plant = Callable[[float, Pool], Signals]


@dataclass
class Run:
    recs: list[dict[str, Recommendation]]
    pool: Pool

    def changes(self, role: str = "decode") -> list[Recommendation]:
        return [r[role] for r in self.recs if role in r and r[role].desired != r[role].current]

    def counts(self, role: str = "decode") -> list[int]:
        return [r[role].desired for r in self.recs]


def simulate(
    policy: ScalingPolicy,
    plant: Plant,
    pool: Pool,
    *,
    start: float = 0.0,
    duration: float = 1800.0,
    state: AutoscalerState | None = None,
) -> Run:
    state = AutoscalerState() if state is None else state
    recs = []
    t = start
    while t < start + duration:
        recs_now, state = decide(policy, plant(t, pool), state)
        for r, rec in recs_now.items():
            pool.scale(r, rec.desired, t)
        recs.append(recs_now)
        t += TICK
    return Run(recs, pool)


def aggregated_plant(
    *,
    ttft: Callable[[float, int], float | None] = lambda t, n: 0.4,
    itl: Callable[[float, int], float | None] = lambda t, n: 0.04,
    kv: Callable[[float, int], float | None] = lambda t, n: 0.6,
    waiting: Callable[[float, int], float | None] = lambda t, n: 0.0,
    queued: Callable[[float, int], float | None] = lambda t, n: 0.0,
) -> Plant:
    def plant(t: float, pool: Pool) -> Signals:
        n = pool.replicas["decode"]
        rs = role(
            n,
            pool.ready("decode", t),
            waiting=waiting(t, n),
            kv=kv(t, n),
            queued=queued(t, n),
        )
        return Signals(time=t, ttft_s=ttft(t, n), itl_s=itl(t, n), decode=rs)

    return plant


# -- scaling up on each signal -----------------------------------------------------------


def test_ttft_breach_scales_up_after_the_scale_up_window() -> None:
    # Calm for five minutes, then the load doubles: TTFT goes to 2x the target at 2
    # replicas and falls as replicas are added.
    def ttft(t: float, n: int) -> float:
        load = 1.0 if t < 300 else 2.0
        return TTFT_TARGET * 0.9 * load * 2 / n

    run = simulate(AGGREGATED, aggregated_plant(ttft=ttft), Pool({"decode": 2}), duration=900)
    first = run.changes()[0]
    assert first.time == 300 + AGGREGATED.scale_up.stabilization_window_s
    assert first.desired == 4 and first.raw == 4
    assert first.reason == "scale up: TTFT p90 0.90s > target 0.50s"
    assert run.pool.replicas["decode"] == 4
    assert len(run.changes()) == 1


def test_itl_breach_scales_the_decode_role_up_in_steps() -> None:
    itl = lambda t, n: ITL_TARGET * 6 / n  # noqa: E731
    run = simulate(AGGREGATED, aggregated_plant(itl=itl), Pool({"decode": 3}), duration=900)
    changes = run.changes()
    assert [(c.current, c.desired) for c in changes] == [(3, 5), (5, 6)]
    assert changes[0].raw == 6 and "ITL p90 100ms > target 50ms (step limit 2)" in changes[0].reason
    assert run.pool.replicas["decode"] == 6


def test_prefill_backlog_scales_the_prefill_role_before_ttft_shows_it() -> None:
    # 40k uncached tokens queued, 8k tokens/s per worker: 2.5 s of work per replica at 2
    # replicas, five times the 0.5 s TTFT target, while no request has finished yet.
    def plant(t: float, pool: Pool) -> Signals:
        p = pool.replicas["prefill"]
        d = pool.replicas["decode"]
        return Signals(
            time=t,
            ttft_s=None,
            itl_s=0.04,
            prefill=role(p, pool.ready("prefill", t), queued=40_000.0, kv=None, waiting=None),
            decode=role(d, pool.ready("decode", t), kv=0.6),
        )

    run = simulate(DISAGGREGATED, plant, Pool({"prefill": 2, "decode": 2}), duration=600)
    first = run.changes("prefill")[0]
    # the first round on which the backlog has been seen for the whole scale-up window
    assert first.time == DISAGGREGATED.scale_up.stabilization_window_s
    assert first.raw == 10 and first.desired == 4
    assert first.reason.startswith("scale up: prefill backlog 20000 tokens/replica (2.50s)")
    assert run.pool.replicas["prefill"] == 8  # the max
    assert run.changes("decode") == []  # decode does not read the prefill backlog


def test_backlog_in_an_aggregated_pool_scales_the_decode_role() -> None:
    queued = lambda t, n: 2 * 8000.0 * TTFT_TARGET * 1.5  # noqa: E731
    run = simulate(AGGREGATED, aggregated_plant(queued=queued), Pool({"decode": 2}), duration=120)
    assert run.changes()[0].desired == 3
    assert "prefill backlog" in run.changes()[0].reason


def test_kv_usage_above_target_scales_up_until_within_tolerance() -> None:
    kv = lambda t, n: min(1.0, 2.0 / n)  # noqa: E731
    run = simulate(AGGREGATED, aggregated_plant(kv=kv), Pool({"decode": 2}), duration=1200)
    assert run.changes()[0].reason == "scale up: KV usage 1.00 > target 0.85"
    assert run.pool.replicas["decode"] == 3  # 0.67 / 0.85 = 0.78: then it is left alone
    assert len(run.changes()) == 1
    assert (
        run.recs[-1]["decode"].reason == "hold: TTFT p90 0.40s < target 0.50s rounds to 3 replicas"
    )


def test_waiting_requests_per_ready_replica_scale_up() -> None:
    waiting = lambda t, n: 12.0  # noqa: E731
    run = simulate(AGGREGATED, aggregated_plant(waiting=waiting), Pool({"decode": 2}), duration=90)
    assert run.changes()[0].reason.startswith("scale up: waiting 6.0 requests/replica > target 2")


# -- stability ---------------------------------------------------------------------------


def test_ttft_noise_around_the_target_does_not_flap() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        ttft = lambda t, n, rng=rng: TTFT_TARGET * 0.9 * (1 + rng.uniform(-0.3, 0.3))  # noqa: E731
        plant = aggregated_plant(ttft=ttft, kv=lambda t, n: 0.5)
        run = simulate(AGGREGATED, plant, Pool({"decode": 4}), duration=3600)
        assert len(run.changes()) <= 1, (seed, [c.reason for c in run.changes()])


def test_ttft_oscillating_fast_around_the_target_does_not_flap() -> None:
    # a two-minute period: above the tolerance for at most half of the scale-up window
    ttft = lambda t, n: TTFT_TARGET * 0.9 * (1 + 0.3 * math.sin(2 * math.pi * t / 120))  # noqa: E731
    run = simulate(AGGREGATED, aggregated_plant(ttft=ttft), Pool({"decode": 4}), duration=3600)
    assert len(run.changes()) <= 1


def test_within_tolerance_holds_and_says_so() -> None:
    run = simulate(
        AGGREGATED,
        aggregated_plant(ttft=lambda t, n: 0.53),
        Pool({"decode": 3}),
        duration=15,
    )
    assert run.recs[0]["decode"].desired == 3
    assert run.recs[0]["decode"].reason == "hold: within tolerance: TTFT p90 0.53s > target 0.50s"


# -- missing metrics ---------------------------------------------------------------------


def test_vanished_metrics_hold_and_restart_the_scale_down_window() -> None:
    gone = lambda t: 600 <= t < 900  # noqa: E731

    def plant(t: float, pool: Pool) -> Signals:
        n = pool.replicas["decode"]
        if gone(t):
            return Signals(t, None, None, role(n, waiting=None, kv=None, queued=None, rate=None))
        return Signals(t, 0.1, 0.01, role(n, kv=0.1))  # idle: wants 1 replica

    run = simulate(AGGREGATED, plant, Pool({"decode": 8}), duration=1500)
    during = [r["decode"] for r in run.recs if gone(r["decode"].time)]
    assert during and all(r.desired == r.current for r in during)
    assert during[0].reason == "hold: no TTFT, backlog, ITL, KV usage or waiting requests metrics"
    # before: scale-down each tick once 300 s were covered; after: 300 s of fresh data first
    downs = [c.time for c in run.changes()]
    assert downs[0] == 300
    assert [t for t in downs if t >= 600] and min(t for t in downs if t >= 600) == 900 + 300


def test_missing_slo_target_drops_that_signal() -> None:
    policy = replace(AGGREGATED, ttft_target_s=None)
    # a TTFT of 10 s and a huge backlog mean nothing without a TTFT target
    signals = Signals(0.0, 10.0, 0.05, role(2, queued=1e9, kv=0.85))
    recs, _ = decide(policy, signals, AutoscalerState())
    assert recs["decode"].desired == 2
    assert recs["decode"].reason.startswith("hold: within tolerance")


def test_prefill_role_without_a_ttft_target_holds() -> None:
    policy = replace(DISAGGREGATED, ttft_target_s=None)
    signals = Signals(0.0, 1.0, 0.04, decode=role(2), prefill=role(2, queued=1e6))
    recs, _ = decide(policy, signals, AutoscalerState())
    assert recs["prefill"].desired == 2
    assert recs["prefill"].reason == "hold: no SLO target or metric applies to this role"


def test_a_role_without_signals_gets_no_recommendation() -> None:
    recs, _ = decide(DISAGGREGATED, Signals(0.0, 0.4, 0.04, role(2)), AutoscalerState())
    assert set(recs) == {"decode"}


# -- bounds, steps, windows, cooldown, readiness -----------------------------------------


def test_a_count_below_min_is_raised_at_once_even_without_metrics() -> None:
    policy = replace(AGGREGATED, decode=Bounds(2, 8))
    signals = Signals(0.0, None, None, role(1, waiting=None, kv=None, queued=None, rate=None))
    recs, _ = decide(policy, signals, AutoscalerState())
    assert recs["decode"].desired == 2
    assert recs["decode"].reason == "bounds: 1 replicas, below min 2"


def test_a_count_above_max_is_lowered_at_once_despite_cooldown_and_windows() -> None:
    policy = replace(AGGREGATED, scale_up=Behavior(0.0, 2))  # scale up on one sample
    state = AutoscalerState()
    recs, state = decide(policy, Signals(0.0, 2.0, 0.04, role(6)), state)
    assert recs["decode"].desired == 8  # a change at t=0: the cooldown runs
    recs, _ = decide(policy, Signals(15.0, 2.0, 0.04, role(12)), state)
    assert recs["decode"].desired == 8
    assert recs["decode"].reason.startswith("bounds: 12 replicas, above max 8")


def test_at_max_a_breach_holds_and_says_so() -> None:
    recs, _ = decide(AGGREGATED, Signals(0.0, 2.0, 0.04, role(8)), AutoscalerState())
    assert recs["decode"].desired == 8 and recs["decode"].raw == 32
    assert recs["decode"].reason == "hold: at max 8: TTFT p90 2.00s > target 0.50s"


def test_replica_counts_stay_within_bounds_and_step_limits() -> None:
    policy = replace(AGGREGATED, decode=Bounds(2, 7), cooldown_s=0.0)
    load = lambda t: 10.0 if (t // 900) % 2 == 0 else 0.2  # noqa: E731
    plant = aggregated_plant(
        ttft=lambda t, n: TTFT_TARGET * load(t) / n, itl=lambda t, n: 0.01, kv=lambda t, n: 0.1
    )
    run = simulate(policy, plant, Pool({"decode": 2}), duration=3600)
    for c in run.changes():
        assert 2 <= c.desired <= 7
        assert -policy.scale_down.max_step <= c.desired - c.current <= policy.scale_up.max_step
    assert max(run.counts()) == 7 and min(run.counts()) == 2


def test_scale_down_waits_for_the_whole_window() -> None:
    def ttft(t: float, n: int) -> float:
        return TTFT_TARGET if t < 600 else TTFT_TARGET * 0.25

    plant = aggregated_plant(ttft=ttft, itl=lambda t, n: 0.02)
    run = simulate(AGGREGATED, plant, Pool({"decode": 6}), duration=1500)
    changes = run.changes()
    assert changes[0].time == 600 + AGGREGATED.scale_down.stabilization_window_s
    assert (changes[0].current, changes[0].desired) == (6, 5)
    assert changes[0].reason.startswith("scale down: KV usage 0.60 < target 0.85")
    # one step at a time, one cooldown apart
    assert all(b.time - a.time >= AGGREGATED.cooldown_s for a, b in pairwise(changes))


def test_a_fresh_state_does_not_scale_down_at_once() -> None:
    # an operator restart: the pool is idle, but the state knows nothing yet
    plant = aggregated_plant(ttft=lambda t, n: 0.05, itl=lambda t, n: 0.005, kv=lambda t, n: 0.05)
    run = simulate(AGGREGATED, plant, Pool({"decode": 5}), start=10_000.0, duration=600)
    first = run.changes()[0]
    assert first.time == 10_000.0 + AGGREGATED.scale_down.stabilization_window_s
    assert run.recs[0]["decode"].reason.startswith("hold: scale-down to 1 waits for 300s")


def breach(t: float, replicas: int = 2) -> Signals:
    return Signals(t, 1.0, 0.04, role(replicas))  # TTFT twice the target: 4 replicas


def test_a_fresh_state_does_not_scale_up_on_one_sample() -> None:
    # a new pool, or an operator that restarted with nothing to resume
    recs, state = decide(AGGREGATED, breach(10_000.0), AutoscalerState())
    assert recs["decode"].desired == 2
    assert recs["decode"].reason.startswith("hold: scale-up to 4 waits for 60s of proposals")
    assert state.roles["decode"].since == 10_000.0


def test_a_scale_up_needs_three_proposals_spanning_its_window() -> None:
    window = AGGREGATED.scale_up.stabilization_window_s
    # two proposals a whole window apart are not enough
    _, state = decide(AGGREGATED, breach(0.0), AutoscalerState())
    recs, _ = decide(AGGREGATED, breach(window), state)
    assert recs["decode"].desired == 2
    assert recs["decode"].reason.startswith("hold: scale-up to 4 waits for 3 proposals in 60s")
    # three within 10 s are not enough either: they do not span the window
    state = AutoscalerState()
    for t in (0.0, 5.0, 10.0):
        recs, state = decide(AGGREGATED, breach(t), state)
    assert recs["decode"].reason.startswith("hold: scale-up to 4 waits for 60s of proposals")
    # three spanning it are
    state = AutoscalerState()
    for t in (0.0, window / 2, window):
        recs, state = decide(AGGREGATED, breach(t), state)
    assert (recs["decode"].desired, recs["decode"].time) == (4, window)


def test_scale_up_and_scale_down_wait_alike() -> None:
    calm = lambda t: Signals(t, 0.05, 0.005, role(6, kv=0.05))  # noqa: E731
    for signals, window in ((breach, AGGREGATED.scale_up), (calm, AGGREGATED.scale_down)):
        state = AutoscalerState()
        t = 0.0
        while True:
            recs, state = decide(AGGREGATED, signals(t), state)
            if recs["decode"].desired != recs["decode"].current:
                break
            t += TICK
        assert t == window.stabilization_window_s


def test_a_window_of_zero_scales_on_one_sample() -> None:
    policy = replace(AGGREGATED, scale_up=Behavior(0.0, 2))
    recs, _ = decide(policy, breach(0.0), AutoscalerState())
    assert recs["decode"].desired == 4
    assert recs["decode"].reason == "scale up: TTFT p90 1.00s > target 0.50s"


def test_a_gap_between_rounds_restarts_the_windows() -> None:
    policy = replace(AGGREGATED, max_gap_s=45.0)
    state = AutoscalerState()
    for t in (0.0, 15.0, 30.0, 45.0):
        _, state = decide(policy, breach(t), state)
    # nobody looked for 90 s: what was seen before does not vouch for the window
    recs, state = decide(policy, breach(135.0), state)
    assert recs["decode"].desired == 2
    assert state.roles["decode"].since == 135.0
    assert state.roles["decode"].proposals == ((135.0, 4),)
    # without a limit the run goes on (but the window still needs three proposals)
    state = AutoscalerState()
    for t in (0.0, 15.0, 30.0, 45.0, 135.0):
        recs, state = decide(AGGREGATED, breach(t), state)
    assert state.roles["decode"].since == 0.0
    assert recs["decode"].reason.startswith("hold: scale-up to 4 waits for 3 proposals in 60s")


def test_cooldown_spaces_changes_of_a_role() -> None:
    policy = replace(AGGREGATED, cooldown_s=120.0, scale_up=Behavior(0.0, 1))
    plant = aggregated_plant(ttft=lambda t, n: 10.0)
    run = simulate(policy, plant, Pool({"decode": 1}), duration=600)
    times = [c.time for c in run.changes()]
    assert times == [0, 120, 240, 360, 480]
    assert run.recs[1]["decode"].reason.startswith("hold: cooldown, last change 15s ago (< 120s)")


def test_no_scale_up_while_added_replicas_are_not_ready() -> None:
    policy = replace(AGGREGATED, cooldown_s=0.0)
    plant = aggregated_plant(ttft=lambda t, n: 10.0)
    run = simulate(policy, plant, Pool({"decode": 1}, ready_after=90.0), duration=600)
    times = [c.time for c in run.changes()]
    window = policy.scale_up.stabilization_window_s
    assert times[:3] == [window, window + 90, window + 180]
    after_first = run.recs[int(window / TICK) + 1]["decode"]
    assert after_first.reason.startswith(
        "hold: 2 of 3 replicas not ready yet; no scale-up until they are"
    )


def test_not_ready_replicas_do_not_block_a_scale_down() -> None:
    policy = replace(AGGREGATED, scale_down=Behavior(0.0, 1), cooldown_s=0.0)
    signals = Signals(0.0, 0.1, 0.01, role(4, ready=2, kv=0.1))
    recs, _ = decide(policy, signals, AutoscalerState())
    assert recs["decode"].desired == 3


# -- purity ------------------------------------------------------------------------------


def test_decide_is_deterministic_and_leaves_the_given_state_alone() -> None:
    state = AutoscalerState()
    for t in range(0, 300, 15):
        _, state = decide(AGGREGATED, Signals(float(t), 0.9, 0.04, role(3)), state)
    before = repr(state)
    signals = Signals(300.0, 2.0, 0.04, role(3))
    first = decide(AGGREGATED, signals, state)
    second = decide(AGGREGATED, signals, state)
    assert first == second
    assert repr(state) == before


def test_history_is_kept_to_the_longest_window_and_compact() -> None:
    state = AutoscalerState()
    for t in range(0, 3600, 15):
        _, state = decide(AGGREGATED, Signals(float(t), 0.5, 0.04, role(3)), state)
    kept = state.roles["decode"].proposals
    # the same proposal for an hour: the last three say all a window can ask of it
    assert [t for t, _ in kept] == [3555.0, 3570.0, 3585.0]
    assert state.roles["decode"].since == 0.0


def test_compacted_history_keeps_each_windows_lowest_and_highest() -> None:
    proposals = tuple((float(t), p) for t, p in enumerate([5, 2, 7, 3, 6, 4, 4, 4, 4, 5]))
    kept = compact(proposals)
    # 2 and 7 are not beaten later; 3 is lower than all after it, 6 higher; then the last 3
    assert kept == ((1.0, 2), (2.0, 7), (3.0, 3), (4.0, 6), (7.0, 4), (8.0, 4), (9.0, 5))
    for start in range(len(proposals)):
        window = [p for t, p in proposals if t >= start]
        inside = [p for t, p in kept if t >= start]
        assert (min(inside), max(inside)) == (min(window), max(window))


# -- properties --------------------------------------------------------------------------

maybe = lambda s: st.none() | s  # noqa: E731
ratios = st.floats(0, 20, allow_nan=False)


@st.composite
def role_signals(draw: st.DrawFn) -> RoleSignals:
    replicas = draw(st.integers(0, 20))
    return RoleSignals(
        replicas=replicas,
        ready_replicas=draw(st.integers(0, replicas)),
        waiting_requests=draw(maybe(st.floats(0, 200, allow_nan=False))),
        kv_usage=draw(maybe(st.floats(0, 1))),
        queued_prefill_tokens=draw(maybe(st.floats(0, 1e6))),
        prefill_rate_tokens_per_s=draw(maybe(st.floats(0, 1e5))),
    )


@st.composite
def policies(draw: st.DrawFn) -> ScalingPolicy:
    def bounds() -> Bounds:
        lo = draw(st.integers(1, 6))
        return Bounds(lo, lo + draw(st.integers(0, 8)))

    def behavior() -> Behavior:
        return Behavior(draw(st.sampled_from([0.0, 15.0, 60.0, 300.0])), draw(st.integers(1, 4)))

    return ScalingPolicy(
        decode=bounds(),
        prefill=bounds() if draw(st.booleans()) else None,
        ttft_target_s=draw(maybe(st.floats(0.05, 5))),
        itl_target_s=draw(maybe(st.floats(0.005, 0.5))),
        scale_up=behavior(),
        scale_down=behavior(),
        cooldown_s=draw(st.sampled_from([0.0, 30.0, 60.0])),
    )


@settings(max_examples=150, deadline=None)
@given(
    policy=policies(),
    steps=st.lists(
        st.tuples(
            st.sampled_from([0.0, 1.0, 15.0, 15.0, 60.0]),
            maybe(ratios),
            maybe(ratios),
            role_signals(),
            role_signals(),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_desired_is_within_bounds_and_steps_unless_bringing_into_bounds(
    policy: ScalingPolicy, steps: list
) -> None:
    state = AutoscalerState()
    t = 0.0
    for dt, ttft, itl, decode, prefill in steps:
        t += dt
        signals = Signals(t, ttft, itl, decode=decode, prefill=prefill)
        recs, state = decide(policy, signals, state)
        for name, bounds in policy.roles().items():
            rec = recs[name]
            assert bounds.min_replicas <= rec.desired <= bounds.max_replicas
            if rec.current < bounds.min_replicas or rec.current > bounds.max_replicas:
                assert rec.desired == bounds.clamp(rec.current)
                assert rec.reason.startswith("bounds:")
                continue
            assert rec.desired - rec.current <= policy.scale_up.max_step
            assert rec.current - rec.desired <= policy.scale_down.max_step
            if rec.desired > rec.current:
                assert signals_for(signals, name).ready_replicas >= rec.current
            if rec.desired == rec.current:
                assert rec.reason.startswith("hold:")


def signals_for(signals: Signals, name: str) -> RoleSignals:
    rs = signals.decode if name == "decode" else signals.prefill
    assert rs is not None
    return rs


def test_a_near_zero_prefill_rate_scales_up_by_a_step_without_overflowing() -> None:
    # A learned rate of 5e-324 tokens/s makes the backlog pressure infinite.
    signals = Signals(
        time=0.0,
        ttft_s=None,
        itl_s=None,
        prefill=role(2, queued=1.0, rate=5e-324),
        decode=role(2),
    )
    policy = replace(DISAGGREGATED, scale_up=Behavior(0.0, 2))  # one sample decides
    recs, _ = decide(policy, signals, AutoscalerState())
    assert recs["prefill"].desired == 2 + policy.scale_up.max_step
