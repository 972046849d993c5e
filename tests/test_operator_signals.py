"""From /metrics texts to the autoscaler's signals: quantiles over a window of cumulative
histograms, per-pod resets, garbage, and the attribution of the router's per-worker
gauges to roles. Texts come from real prometheus_client registries."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from kvpool.operator.autoscaler import AutoscalerState, Bounds, ScalingPolicy, Signals, decide
from kvpool.operator.signals import (
    ROUTER_ITL,
    ROUTER_QUEUED,
    ROUTER_RATE,
    ROUTER_TTFT,
    WORKER_ITL,
    WORKER_KV_USAGE,
    WORKER_TTFT,
    WORKER_WAITING,
    MetricsWindow,
    build_signals,
    histogram_quantile,
    parse,
)

BUCKETS = (0.1, 0.5, 1.0)


class Router:
    """A router pod's /metrics, with the router's series names."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(ROUTER_TTFT, "ttft", buckets=buckets, registry=r)
        self.itl = Histogram(ROUTER_ITL, "itl", buckets=buckets, registry=r)
        self.queued = Gauge(ROUTER_QUEUED, "queued", ["worker"], registry=r)
        self.rate = Gauge(ROUTER_RATE, "rate", ["worker"], registry=r)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class Worker:
    """A worker pod's /metrics, under vLLM's names and labels."""

    def __init__(self, waiting: float = 0.0, kv: float = 0.0) -> None:
        r = self.registry = CollectorRegistry()
        Gauge(WORKER_WAITING, "waiting", ["model_name"], registry=r).labels("m").set(waiting)
        Gauge(WORKER_KV_USAGE, "kv", ["model_name"], registry=r).labels("m").set(kv)
        self.ttft = Histogram(
            WORKER_TTFT, "ttft", ["model_name"], buckets=BUCKETS, registry=r
        ).labels("m")
        self.itl = Histogram(WORKER_ITL, "itl", ["model_name"], buckets=BUCKETS, registry=r).labels(
            "m"
        )

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def observe(h: Histogram, *values: float) -> None:
    for v in values:
        h.observe(v)


# -- histogram_quantile ------------------------------------------------------------------

CUMULATIVE = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, math.inf: 40.0}


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.1, 0.04),  # rank 4 of 10 in [0, 0.1]
        (0.5, 0.3),  # rank 20: 10 of the 20 in (0.1, 0.5]
        (0.9, 0.8),  # rank 36: 6 of the 10 in (0.5, 1.0]
        (1.0, 1.0),
    ],
)
def test_quantile_interpolates_linearly_inside_its_bucket(q: float, expected: float) -> None:
    assert histogram_quantile(q, CUMULATIVE) == pytest.approx(expected)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.9, {0.1: 1.0, 0.5: 2.0, math.inf: 10.0}) == 0.5


def test_quantile_without_observations_or_inf_bucket_is_none() -> None:
    assert histogram_quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None
    assert histogram_quantile(0.9, {0.1: 3.0, 0.5: 4.0}) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, CUMULATIVE)


# -- the window --------------------------------------------------------------------------


def test_window_quantile_counts_only_what_was_observed_between_snapshots() -> None:
    router = Router()
    observe(router.ttft, *[2.0] * 100)  # before the first snapshot: not in the window
    window = MetricsWindow(window_s=120)
    build_signals(0.0, [("r-0", router.text())], {}, {"decode": (1, 1)}, window)
    observe(router.ttft, *[0.05] * 10, *[0.3] * 20, *[0.8] * 10)
    signals = build_signals(
        15.0, [("r-0", router.text())], {}, {"decode": (1, 1)}, window, ttft_quantile=0.5
    )
    assert signals.ttft_s == pytest.approx(0.3)  # as CUMULATIVE above
    assert window.quantile(ROUTER_TTFT, 0.9, 15.0) == pytest.approx(0.8)


def test_window_sums_router_pods() -> None:
    a, b = Router(), Router()
    window = MetricsWindow(120)
    for pod, r in (("r-0", a), ("r-1", b)):
        window.add_exposition(0.0, pod, parse(r.text()), ROUTER_TTFT)
    observe(a.ttft, *[0.05] * 10, *[0.3] * 10)
    observe(b.ttft, *[0.3] * 10, *[0.8] * 10)
    for pod, r in (("r-0", a), ("r-1", b)):
        window.add_exposition(15.0, pod, parse(r.text()), ROUTER_TTFT)
    assert window.quantile(ROUTER_TTFT, 0.5, 15.0) == pytest.approx(0.3)
    assert window.quantile(ROUTER_TTFT, 0.9, 15.0) == pytest.approx(0.8)


def test_observations_older_than_the_window_expire() -> None:
    router = Router()
    window = MetricsWindow(window_s=60)
    for t in range(0, 181, 15):
        if t <= 30:
            observe(router.ttft, 0.8, 0.8)  # slow at first ...
        elif t <= 90:
            observe(router.ttft, 0.05, 0.05)  # ... then fast ...
        window.add_exposition(float(t), "r-0", parse(router.text()), ROUTER_TTFT)
        if t == 30:
            assert window.quantile(ROUTER_TTFT, 0.5, t) == pytest.approx(0.75)
        if t == 120:  # snapshots 60..120: only the fast ones
            assert window.quantile(ROUTER_TTFT, 0.99, t) <= 0.1
    # ... then nothing for a whole window: no observations, no quantile
    assert window.quantile(ROUTER_TTFT, 0.5, 180.0) is None
    assert window.has(ROUTER_TTFT)
    window.expire(1000.0)
    assert not window.has(ROUTER_TTFT)


def test_a_restarted_pod_counts_from_zero_and_the_others_are_untouched() -> None:
    a, b = Router(), Router()
    window = MetricsWindow(120)
    observe(a.ttft, *[0.8] * 50)  # a's history, before the window
    window.add_exposition(0.0, "r-0", parse(a.text()), ROUTER_TTFT)
    window.add_exposition(0.0, "r-1", parse(b.text()), ROUTER_TTFT)
    a = Router()  # r-0 restarts: its counters start again from zero
    observe(a.ttft, *[0.05] * 10)
    observe(b.ttft, *[0.3] * 10)
    window.add_exposition(15.0, "r-0", parse(a.text()), ROUTER_TTFT)
    window.add_exposition(15.0, "r-1", parse(b.text()), ROUTER_TTFT)
    delta = window.increase(ROUTER_TTFT, 15.0)
    assert delta == {0.1: 10.0, 0.5: 20.0, 1.0: 20.0, math.inf: 20.0}
    # and after the restart, deltas again
    observe(a.ttft, *[0.05] * 5)
    window.add_exposition(30.0, "r-0", parse(a.text()), ROUTER_TTFT)
    assert window.increase(ROUTER_TTFT, 30.0)[math.inf] == 25.0


def test_pods_with_different_buckets_still_sum_to_a_cumulative_histogram() -> None:
    fine, coarse = Router(buckets=(0.1, 0.25, 0.5, 1.0)), Router(buckets=(0.5, 1.0))
    window = MetricsWindow(120)
    for t, pod, r in ((0.0, "a", fine), (0.0, "b", coarse)):
        window.add_exposition(t, pod, parse(r.text()), ROUTER_TTFT)
    observe(fine.ttft, 0.2, 0.2)
    observe(coarse.ttft, 0.4, 0.4)
    for t, pod, r in ((15.0, "a", fine), (15.0, "b", coarse)):
        window.add_exposition(t, pod, parse(r.text()), ROUTER_TTFT)
    counts = window.increase(ROUTER_TTFT, 15.0)
    assert counts == {0.1: 0.0, 0.25: 2.0, 0.5: 4.0, 1.0: 4.0, math.inf: 4.0}


def test_a_snapshot_not_newer_than_the_last_is_ignored() -> None:
    window = MetricsWindow(120)
    window.add(10.0, "m", "p", {1.0: 1.0, math.inf: 1.0})
    window.add(10.0, "m", "p", {1.0: 5.0, math.inf: 5.0})
    window.add(20.0, "m", "p", {1.0: 2.0, math.inf: 2.0})
    assert window.increase("m", 20.0) == {1.0: 1.0, math.inf: 1.0}


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>502 Bad Gateway</body></html>",
        "hello world\n",
        b"\xff\xfe\x00garbage",
        'x_bucket{le="0.1"',  # a text cut short
        "",
        None,
    ],
)
def test_garbage_scrapes_count_as_missing_and_never_raise(text: str | bytes | None) -> None:
    exposition = parse(text)
    assert exposition is None or not exposition.samples
    window = MetricsWindow(120)
    for t in (0.0, 15.0):
        signals = build_signals(
            t, [("r-0", text)], {"decode": [("d-0", text)]}, {"decode": (1, 1)}, window
        )
    assert signals.ttft_s is None and signals.itl_s is None
    assert signals.decode.waiting_requests is None and signals.decode.kv_usage is None
    assert signals.decode.queued_prefill_tokens is None


def test_nan_and_inf_readings_are_no_readings() -> None:
    registry = CollectorRegistry()
    Gauge(WORKER_WAITING, "w", registry=registry).set(math.nan)
    Gauge(WORKER_KV_USAGE, "kv", registry=registry).set(math.inf)
    exposition = parse(generate_latest(registry))
    assert exposition.total(WORKER_WAITING) is None
    assert exposition.highest(WORKER_KV_USAGE) is None


# -- one scrape's signals ----------------------------------------------------------------


def test_router_gauges_map_to_roles_by_pod_name() -> None:
    r0, r1 = Router(), Router()
    for router, queued in ((r0, 1000.0), (r1, 500.0)):
        router.queued.labels("pool-prefill-0").set(queued)
        router.queued.labels("pool-prefill-1").set(queued * 2)
        router.queued.labels("pool-decode-0").set(7.0)
        router.queued.labels("gone-pod").set(1e9)  # a worker no role lists any more
    r0.rate.labels("pool-prefill-0").set(6000.0)
    r1.rate.labels("pool-prefill-0").set(8000.0)
    r0.rate.labels("pool-prefill-1").set(10000.0)
    r1.rate.labels("pool-prefill-1").set(0.0)  # not learned: no estimate
    r0.rate.labels("pool-decode-0").set(3000.0)
    workers = {
        # a failed scrape still names its pod, so the router's gauges for it still count
        "prefill": [("pool-prefill-0", Worker().text()), ("pool-prefill-1", None)],
        "decode": [("pool-decode-0", Worker().text())],
    }
    signals = build_signals(
        0.0,
        [("r-0", r0.text()), ("r-1", r1.text())],
        workers,
        {"prefill": (2, 2), "decode": (1, 1)},
        MetricsWindow(120),
    )
    assert signals.prefill is not None
    assert signals.prefill.queued_prefill_tokens == 1000 + 2000 + 500 + 1000
    # per worker the median over routers (7000, 10000), then the median over workers
    assert signals.prefill.prefill_rate_tokens_per_s == 8500.0
    assert signals.decode.queued_prefill_tokens == 14.0
    assert signals.decode.prefill_rate_tokens_per_s == 3000.0
    assert (signals.prefill.replicas, signals.prefill.ready_replicas) == (2, 2)


def test_waiting_sums_and_kv_usage_averages_over_the_pods_that_answered() -> None:
    workers = {
        "decode": [
            ("d-0", Worker(waiting=3, kv=0.5).text()),
            ("d-1", Worker(waiting=4, kv=0.9).text()),
            ("d-2", "garbage"),
        ]
    }
    signals = build_signals(0.0, [], workers, {"decode": (3, 3)}, MetricsWindow(120))
    assert signals.decode.waiting_requests == 7.0
    assert signals.decode.kv_usage == pytest.approx(0.7)
    assert signals.prefill is None


def test_missing_data_is_none_not_zero() -> None:
    signals = build_signals(
        0.0, [("r-0", Router().text())], {}, {"decode": (2, 1)}, MetricsWindow(120)
    )
    d = signals.decode
    assert (d.replicas, d.ready_replicas) == (2, 1)
    assert d.waiting_requests is None and d.kv_usage is None
    assert d.queued_prefill_tokens is None and d.prefill_rate_tokens_per_s is None
    assert signals.ttft_s is None and signals.itl_s is None


def test_worker_histograms_stand_in_when_the_router_has_none() -> None:
    d0, d1 = Worker(), Worker()
    window = MetricsWindow(120)
    no_histograms = CollectorRegistry()
    Gauge(ROUTER_QUEUED, "q", ["worker"], registry=no_histograms).labels("d-0").set(0)
    router = [("r-0", generate_latest(no_histograms).decode())]

    def scrape(t: float) -> Signals:
        workers = {"decode": [("d-0", d0.text()), ("d-1", d1.text())]}
        return build_signals(t, router, workers, {"decode": (2, 2)}, window, ttft_quantile=0.5)

    scrape(0.0)
    observe(d0.ttft, *[0.05] * 10, *[0.3] * 10)
    observe(d1.ttft, *[0.3] * 10, *[0.8] * 10)
    observe(d1.itl, *[0.05] * 4)
    signals = scrape(15.0)
    assert signals.ttft_s == pytest.approx(0.3)
    assert signals.itl_s == pytest.approx(0.1 * 0.9)  # p90 of four in [0, 0.1]


def test_disaggregated_ttft_fallback_reads_the_prefill_workers() -> None:
    p, d = Worker(), Worker()
    window = MetricsWindow(120)

    def scrape(t: float) -> Signals:
        workers = {"prefill": [("p-0", p.text())], "decode": [("d-0", d.text())]}
        return build_signals(t, [], workers, {"prefill": (1, 1), "decode": (1, 1)}, window)

    scrape(0.0)
    observe(p.ttft, *[0.8] * 10)
    observe(d.ttft, *[0.05] * 10)  # the decode side's first token: after the KV pull only
    observe(d.itl, *[0.3] * 10)
    signals = scrape(15.0)
    assert signals.ttft_s == pytest.approx(0.5 + 0.5 * 0.9)
    assert signals.itl_s == pytest.approx(0.1 + 0.4 * 0.9)


def test_the_router_histograms_win_over_the_workers() -> None:
    router, worker = Router(), Worker()
    window = MetricsWindow(120)

    def scrape(t: float) -> Signals:
        workers = {"decode": [("d-0", worker.text())]}
        return build_signals(t, [("r-0", router.text())], workers, {"decode": (1, 1)}, window)

    scrape(0.0)
    observe(router.ttft, *[0.8] * 10)
    observe(worker.ttft, *[0.05] * 10)
    assert scrape(15.0).ttft_s == pytest.approx(0.95)


def test_unknown_roles_and_missing_decode_are_refused() -> None:
    with pytest.raises(ValueError, match="decode"):
        build_signals(0.0, [], {}, {"prefill": (1, 1)}, MetricsWindow(120))
    with pytest.raises(ValueError, match="unknown roles"):
        build_signals(0.0, [], {}, {"decode": (1, 1), "both": (1, 1)}, MetricsWindow(120))


def test_scraped_signals_drive_a_scale_up() -> None:
    router, worker = Router(buckets=(0.25, 0.5, 1.0, 2.5)), Worker(kv=0.5)
    window = MetricsWindow(120)
    policy = ScalingPolicy(decode=Bounds(1, 8), ttft_target_s=0.5)
    state = AutoscalerState()
    for t in range(0, 76, 15):  # the first snapshot has no window; then 60 s of breach
        observe(router.ttft, *[0.9] * 20)  # every request takes ~2x the target
        signals = build_signals(
            t,
            [("r-0", router.text())],
            {"decode": [("d-0", worker.text())]},
            {"decode": (2, 2)},
            window,
        )
        recs, state = decide(policy, signals, state)
    assert recs["decode"].desired == 4
    assert recs["decode"].reason.startswith("scale up: TTFT p90 0.9")
