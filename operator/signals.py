"""From the router's and the workers' /metrics (Prometheus text) to the autoscaler's
:class:`~kvpool.operator.autoscaler.Signals`.

The operator scrapes the pods itself rather than asking a Prometheus server, so a pool
autoscales where no Prometheus is installed. That makes this module do what PromQL would:
latency quantiles over a sliding window, from the deltas of cumulative histograms, as
``histogram_quantile(q, sum by (le) (rate(x_bucket[w])))`` gives them, with counter
resets (a restarted pod) handled per pod. Gauges are read from the latest scrape only.

Missing data is ``None``, never zero: a zero would read as "idle" and scale a pool down
because its metrics endpoint broke.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

from .autoscaler import DECODE, PREFILL, RoleSignals, Signals

logger = logging.getLogger(__name__)

# The router's series (kvpool.router.admin.metrics) ...
ROUTER_TTFT = "kvpool_router_time_to_first_token_seconds"
ROUTER_ITL = "kvpool_router_inter_token_latency_seconds"
ROUTER_QUEUED = "kvpool_router_worker_queued_prefill_tokens"
ROUTER_RATE = "kvpool_router_worker_prefill_rate_tokens_per_second"
# ... and the workers', under vLLM's names (contract 5).
WORKER_TTFT = "vllm:time_to_first_token_seconds"
WORKER_ITL = "vllm:inter_token_latency_seconds"
WORKER_WAITING = "vllm:num_requests_waiting"
WORKER_KV_USAGE = "vllm:kv_cache_usage_perc"

# The workers' histograms are kept in a window by role, since they are read by role.
WORKER_TTFT_KEY = {role: f"{role}/{WORKER_TTFT}" for role in (DECODE, PREFILL)}
WORKER_ITL_KEY = {role: f"{role}/{WORKER_ITL}" for role in (DECODE, PREFILL)}

Labels = tuple[tuple[str, str], ...]
Buckets = dict[float, float]  # upper bound ("le") -> cumulative count
Text = str | bytes | None


# -- parsing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Exposition:
    """One parsed /metrics text: every finite sample, by sample name."""

    samples: Mapping[str, tuple[tuple[Labels, float], ...]]

    def values(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(labels), v) for labels, v in self.samples.get(name, ())]

    def total(self, name: str) -> float | None:
        """The sum over the series' label sets (one per data-parallel engine), or None."""
        values = [v for _, v in self.samples.get(name, ())]
        return math.fsum(values) if values else None

    def highest(self, name: str) -> float | None:
        values = [v for _, v in self.samples.get(name, ())]
        return max(values) if values else None

    def histograms(self, name: str) -> dict[Labels, Buckets]:
        """The cumulative buckets of each label set (less ``le``) of histogram ``name``."""
        out: dict[Labels, Buckets] = {}
        for labels, value in self.samples.get(name + "_bucket", ()):
            rest = tuple((k, v) for k, v in labels if k != "le")
            le = dict(labels).get("le")
            try:
                bound = float(le) if le is not None else math.nan
            except ValueError:
                continue
            if math.isnan(bound):
                continue
            out.setdefault(rest, {})[bound] = value
        return out


def parse(text: Text) -> Exposition | None:
    """The text's samples, or None for a scrape that failed or does not parse.

    A text that breaks off half-way is refused whole: half a histogram would read as a
    counter reset.
    """
    if text is None:
        return None
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        samples: dict[str, list[tuple[Labels, float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                value = float(s.value)
                if math.isfinite(value):
                    labels = tuple(sorted(s.labels.items()))
                    samples.setdefault(s.name, []).append((labels, value))
    except Exception as exc:  # any garbage at all: this scrape is missing, nothing more
        logger.debug("unparseable metrics text: %s", exc)
        return None
    return Exposition({k: tuple(v) for k, v in samples.items()})


# -- histograms over a window ------------------------------------------------------------


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """PromQL's ``histogram_quantile`` over cumulative ``buckets``, or None where it gives
    NaN (no observations, no ``+Inf`` bucket, no finite bucket).

    Linear interpolation inside the bucket the rank falls in, the lowest bucket starting at
    0; a rank in the ``+Inf`` bucket gives the highest finite bound.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    bounds = sorted(buckets)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return None
    counts: list[float] = []
    for b in bounds:  # deltas of sums can dip by float error; buckets never decrease
        counts.append(max(buckets[b], counts[-1]) if counts else buckets[b])
    total = counts[-1]
    if not total > 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(bounds) - 1:
        return bounds[-2]
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[i - 1] if i > 0 else 0.0
    below = counts[i - 1] if i > 0 else 0.0
    inside = counts[i] - below
    if inside <= 0:
        return start
    return start + (bounds[i] - start) * (rank - below) / inside


def _increase(prev: Buckets, cur: Buckets) -> Buckets:
    """What was observed between two snapshots of one series. A bucket that went down, or
    a changed set of buckets, means the process restarted: all of ``cur`` is new."""
    if prev.keys() != cur.keys() or any(cur[b] < prev[b] for b in cur):
        return dict(cur)
    return {b: cur[b] - prev[b] for b in cur}


def _merge(parts: Iterable[Buckets]) -> Buckets:
    """Cumulative buckets summed over series. A series without some bound counts there
    what it counts at its next lower bound, so the sum stays cumulative."""
    parts = list(parts)
    out: Buckets = {}
    for bound in sorted({b for p in parts for b in p}):
        total = 0.0
        for p in parts:
            below = [b for b in p if b <= bound]
            if below:
                total += p[max(below)]
        out[bound] = total
    return out


class MetricsWindow:
    """Snapshots of cumulative histograms over the last ``window_s`` seconds, per series.

    Each (metric, source) pair keeps its own snapshots, a source being one pod and label
    set: a reset is judged per pod, as PromQL's ``rate`` judges it per series, so one
    pod's restart neither erases nor double-counts the others' observations. What was
    observed between the oldest and the newest snapshot inside the window counts; a
    source needs two snapshots in the window to count at all (as ``rate`` needs two
    samples).
    """

    def __init__(self, window_s: float = 120.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._series: dict[str, dict[str, deque[tuple[float, Buckets]]]] = {}

    def add(self, now: float, metric: str, source: str, buckets: Mapping[float, float]) -> None:
        snapshots = self._series.setdefault(metric, {}).setdefault(source, deque())
        if snapshots and now <= snapshots[-1][0]:
            logger.debug("%s from %s: snapshot at %s is not newer; ignored", metric, source, now)
            return
        snapshots.append((now, dict(buckets)))
        self.expire(now)

    def add_exposition(
        self, now: float, pod: str, exposition: Exposition, name: str, key: str | None = None
    ) -> bool:
        """Adds the pod's series of histogram ``name``, kept as ``key`` (default: the
        name); False when the pod has none."""
        found = exposition.histograms(name)
        for labels, buckets in found.items():
            source = pod + "".join(f",{k}={v}" for k, v in labels)
            self.add(now, key or name, source, buckets)
        return bool(found)

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s
        for metric in list(self._series):
            sources = self._series[metric]
            for source in list(sources):
                snapshots = sources[source]
                while snapshots and snapshots[0][0] < cutoff:
                    snapshots.popleft()
                if not snapshots:
                    del sources[source]
            if not sources:
                del self._series[metric]

    def has(self, metric: str) -> bool:
        """Whether any source reported ``metric`` within the window (with or without
        observations)."""
        return bool(self._series.get(metric))

    def increase(self, metric: str, now: float) -> Buckets | None:
        """The observations of ``metric`` within the window, as cumulative buckets summed
        over sources; None when no source has two snapshots in it."""
        cutoff = now - self.window_s
        parts: list[Buckets] = []
        for snapshots in self._series.get(metric, {}).values():
            inside = [b for t, b in snapshots if cutoff <= t <= now]
            if len(inside) < 2:
                continue
            total: Buckets = {}
            for prev, cur in pairwise(inside):
                for b, v in _increase(prev, cur).items():
                    total[b] = total.get(b, 0.0) + v
            parts.append(total)
        return _merge(parts) if parts else None

    def quantile(self, metric: str, q: float, now: float) -> float | None:
        """The q-quantile of what ``metric`` observed within the window; None without
        observations."""
        buckets = self.increase(metric, now)
        return None if buckets is None else histogram_quantile(q, buckets)


# -- one scrape's signals ----------------------------------------------------------------


Scraped = Sequence[tuple[str, Text]] | Sequence[Text]


def _named(texts: Scraped, prefix: str) -> list[tuple[str, Exposition | None]]:
    out: list[tuple[str, Exposition | None]] = []
    for i, item in enumerate(texts):
        name, text = item if isinstance(item, tuple) else (f"{prefix}{i}", item)
        out.append((name, parse(text)))
    return out


def _role_signals(
    replicas: int,
    ready: int,
    pods: list[tuple[str, Exposition | None]],
    queued: Mapping[str, float],
    rates: Mapping[str, list[float]],
) -> RoleSignals:
    scraped = [e for _, e in pods if e is not None]
    waiting = [v for e in scraped if (v := e.total(WORKER_WAITING)) is not None]
    # a data-parallel pod's cache is as full as its fullest engine, as the router reads it
    kv = [v for e in scraped if (v := e.highest(WORKER_KV_USAGE)) is not None]
    names = [name for name, _ in pods]
    pod_queued = [queued[n] for n in names if n in queued]
    pod_rates = [statistics.median(rates[n]) for n in names if rates.get(n)]
    return RoleSignals(
        replicas=replicas,
        ready_replicas=ready,
        waiting_requests=math.fsum(waiting) if waiting else None,
        kv_usage=statistics.fmean(kv) if kv else None,
        queued_prefill_tokens=math.fsum(pod_queued) if pod_queued else None,
        prefill_rate_tokens_per_s=statistics.median(pod_rates) if pod_rates else None,
    )


def build_signals(
    now: float,
    router: Scraped,
    workers: Mapping[str, Sequence[tuple[str, Text]]],
    replicas: Mapping[str, tuple[int, int]],
    window: MetricsWindow,
    *,
    ttft_quantile: float = 0.9,
    itl_quantile: float = 0.9,
) -> Signals:
    """The autoscaler's signals from one round of scrapes at ``now``, feeding ``window``.

    ``router`` holds the router pods' texts as ``(pod name, text)``; plain texts are taken
    by position, which misjudges resets when the set of router pods changes. ``workers``
    maps a role ("decode", and "prefill" in a disaggregated pool) to its pods' ``(pod
    name, text)``: list every pod of the role, a failed scrape's text as None, because the
    router's per-worker gauges are attributed to roles by these names (the router labels a
    worker with its pod name). ``replicas`` maps each role to ``(spec.replicas, ready)``;
    only its roles get signals, and it must hold "decode".

    TTFT and ITL come from the router, which sees what clients see. Where the router has no
    such histogram in the window, the workers' vLLM histograms stand in: for TTFT the
    prefill role's in a disaggregated pool (it is the part that role controls), else the
    decode role's; for ITL always the decode role's (a prefill worker emits one token).
    """
    if DECODE not in replicas:
        raise ValueError(f"replicas must hold the {DECODE!r} role, got {sorted(replicas)}")
    unknown = set(replicas) - {DECODE, PREFILL}
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}: only {DECODE!r} and {PREFILL!r}")

    routers = _named(router, "router-")
    queued: dict[str, float] = {}
    rates: dict[str, list[float]] = {}
    for pod, exposition in routers:
        if exposition is None:
            continue
        window.add_exposition(now, pod, exposition, ROUTER_TTFT)
        window.add_exposition(now, pod, exposition, ROUTER_ITL)
        # Each router counts the tokens it sent itself: the queue is their sum. Each
        # learns a worker's rate on its own: any one of them is an estimate.
        for labels, v in exposition.values(ROUTER_QUEUED):
            if "worker" in labels:
                queued[labels["worker"]] = queued.get(labels["worker"], 0.0) + v
        for labels, v in exposition.values(ROUTER_RATE):
            if "worker" in labels and v > 0:
                rates.setdefault(labels["worker"], []).append(v)

    roles: dict[str, RoleSignals] = {}
    for role, (spec_replicas, ready) in replicas.items():
        pods = [(name, parse(text)) for name, text in workers.get(role, ())]
        for pod, exposition in pods:
            if exposition is not None:
                window.add_exposition(now, pod, exposition, WORKER_TTFT, WORKER_TTFT_KEY[role])
                window.add_exposition(now, pod, exposition, WORKER_ITL, WORKER_ITL_KEY[role])
        roles[role] = _role_signals(spec_replicas, ready, pods, queued, rates)
    for role in set(workers) - set(replicas):
        logger.debug("worker texts of role %r ignored: no replica counts for it", role)
    window.expire(now)

    ttft_role = PREFILL if PREFILL in replicas else DECODE
    ttft = _quantile(window, ROUTER_TTFT, WORKER_TTFT_KEY[ttft_role], ttft_quantile, now)
    itl = _quantile(window, ROUTER_ITL, WORKER_ITL_KEY[DECODE], itl_quantile, now)
    return Signals(
        time=now, ttft_s=ttft, itl_s=itl, decode=roles[DECODE], prefill=roles.get(PREFILL)
    )


def _quantile(
    window: MetricsWindow, router_key: str, worker_key: str, q: float, now: float
) -> float | None:
    if window.has(router_key):
        return window.quantile(router_key, q, now)
    return window.quantile(worker_key, q, now)
