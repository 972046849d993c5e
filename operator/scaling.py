"""One autoscaling round for one pool: scrape, build signals, decide, act, record.

The deciding is pure (:mod:`.signals`, :mod:`.autoscaler`); this module gathers its inputs
from the cluster (the pool's pods, scraped on their ``prometheus.io/port``) and acts on the
answer: in ``Active`` mode it writes the Deployments' replicas of the roles it owns, and
only then (one owner: the spec's replicas of an autoscaled role are not applied, and a role
an HPA or KEDA owns is never written), in ``Advisory`` and ``External`` mode it only
records. Either way the recommendation and the last five changes go to the pool's status,
and the recommendation, the windowed latencies and a count of decisions to the operator's
``/metrics`` (through the pool's runtime record, ``rt``); changes and new advice become
Kubernetes Events (``rt.events``).

The autoscaler's memory (each role's stabilisation windows and last change, and the last
decisions) also goes to status, as ``status.autoscaler.state``, so that an operator that
restarts, or a replica that takes over, resumes it instead of starting blind: it neither
forgets a cooldown nor scales on the first sample it sees. The metrics window (cumulative
histogram snapshots, per pod) is not kept: it is large (every bucket of every pod), and a
snapshot from before a gap would stretch the quantiles over time nobody scraped. It starts
empty; the first round after a take-over has no latency quantiles yet, and its proposal is
one of the several a change needs.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvpool.api.inferencepool import InferencePoolSpec

from .autoscaler import (
    MAX_PROPOSALS,
    AutoscalerState,
    Behavior,
    Bounds,
    Recommendation,
    RoleHistory,
    ScalingPolicy,
    decide,
)
from .render import COMPONENT_LABEL, GROUP_LABEL
from .signals import MetricsWindow, Signals, build_signals, parse

log = logging.getLogger(__name__)

MAX_DECISIONS = 5
MAX_EVENTS = 20  # waiting for sync to post them; older ones go first
DIRECTIONS = ("up", "down")
# Rounds further apart than this many intervals break the autoscaler's run of evidence.
MAX_GAP_ROUNDS = 3
_DECISION_FIELDS = {
    "time": str, "role": str, "current": int, "desired": int, "reason": str, "applied": bool,
}  # fmt: skip


@dataclass
class ScalerRuntime:
    window: MetricsWindow
    state: AutoscalerState = field(default_factory=AutoscalerState)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    restored: bool = False  # state and decisions were read from the pool's status


def policy_from_spec(spec: InferencePoolSpec) -> ScalingPolicy:
    a = spec.autoscaling
    slo = spec.slo

    def bounds(role: str) -> Bounds:
        """The spec's bounds; without them (Advisory, SLO only) up to the spec's count."""
        b = getattr(a, role)
        if b is None:
            return Bounds(1, max(1, spec.roles()[role].replicas))
        return Bounds(b.min_replicas, b.max_replicas)

    def window(seconds: int) -> float:
        """A window must hold MIN_PROPOSALS (3) rounds: a shorter one is widened to two
        intervals, lest it never hold enough; 0 stays 0 (no stabilisation)."""
        return seconds and max(seconds, 2 * a.interval_seconds)

    decode = bounds("decode")
    prefill = bounds("prefill") if spec.prefill is not None else None
    quantile = slo.quantile if slo else 0.9
    up, down = a.scale_up, a.scale_down
    return ScalingPolicy(
        decode=decode,
        prefill=prefill,
        ttft_target_s=slo.ttft_milliseconds / 1000 if slo and slo.ttft_milliseconds else None,
        itl_target_s=slo.itl_milliseconds / 1000 if slo and slo.itl_milliseconds else None,
        scale_up=Behavior(window(up.stabilization_window_seconds), up.max_step),
        scale_down=Behavior(window(down.stabilization_window_seconds), down.max_step),
        cooldown_s=a.cooldown_seconds,
        max_gap_s=MAX_GAP_ROUNDS * a.interval_seconds,
        kv_usage_target=a.kv_usage_target,
        waiting_per_replica_target=a.waiting_per_replica_target,
        ttft_quantile=quantile,
        itl_quantile=quantile,
    )


def _metrics_url(pod: dict[str, Any]) -> str | None:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    port = (meta.get("annotations") or {}).get("prometheus.io/port")
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip or not port or meta.get("deletionTimestamp"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/metrics"


def scrape(
    pods: list[dict[str, Any]], timeout: float
) -> tuple[list[tuple[str, str | None]], dict[str, list[tuple[str, str | None]]]]:
    """The /metrics text of each router and worker pod (None where the scrape failed)."""
    targets = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        component = labels.get(COMPONENT_LABEL)
        group = "router" if component == "router" else labels.get(GROUP_LABEL)
        if group in ("router", "prefill", "decode"):
            targets.append((group, meta.get("name", "?"), _metrics_url(pod)))

    def fetch(url: str | None) -> str | None:
        if url is None:
            return None
        try:
            resp = httpx.get(url, timeout=timeout)
            return resp.text if resp.status_code == 200 else None
        except httpx.HTTPError as exc:
            log.debug("scrape %s: %s", url, exc)
            return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        texts = list(pool.map(fetch, [url for _, _, url in targets]))
    router: list[tuple[str, str | None]] = []
    workers: dict[str, list[tuple[str, str | None]]] = {}
    for (group, name, _), text in zip(targets, texts, strict=True):
        if group == "router":
            router.append((name, text))
        else:
            workers.setdefault(group, []).append((name, text))
    return router, workers


#: the router's verdict on each worker's cache (router/state/agreement.py)
ROUTER_CACHE_FLAGGED = "kvpool_router_worker_cache_flagged"


def cache_condition(router: list[tuple[str, str | None]]) -> tuple[str, str, str]:
    """CacheAgreement from the routers' /metrics: False while a router finds a worker whose
    reported cached tokens disagree with its predictions (another hash seed, block size,
    model or template: that worker gets no cache credit), naming each and why."""
    flagged: dict[str, set[str]] = {}
    seen = False
    for _, text in router:
        exposition = parse(text)
        if exposition is None:
            continue
        for labels, value in exposition.values(ROUTER_CACHE_FLAGGED):
            seen = True
            if value >= 1:
                flagged.setdefault(labels.get("worker", "?"), set()).add(labels.get("cause", ""))
    if not seen:
        return ("Unknown", "NoMetrics", "no router has judged a worker's cache yet")
    if not flagged:
        return ("True", "Agree", "every worker's cached tokens agree with the router's index")
    parts = [f"{w} ({', '.join(sorted(c for c in causes if c)) or '?'})" for w, causes in
             sorted(flagged.items())]  # fmt: skip
    return (
        "False",
        "Disagree",
        f"{len(flagged)} worker(s) get no cache credit, their caches disagree with the "
        f"router's predictions: {'; '.join(parts)}. unseen: check the hash seed "
        "(PYTHONHASHSEED) and block size; over-predicted: prefix caching, model, chat "
        "template (kubectl logs the router)",
    )


def cache_step(cluster: Any, namespace: str, name: str, rt: Any, timeout: float = 2.0) -> None:
    """Only the routers' scrape, for CacheAgreement, where no autoscaling or SLO scrapes."""
    pods = [
        p
        for p in cluster.pods(namespace, name)
        if ((p.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL) == "router"
    ]
    router, _ = scrape(pods, timeout)
    rt.cache = cache_condition(router)


def slo_condition(spec: InferencePoolSpec, signals: Signals) -> tuple[str, str, str]:
    slo = spec.slo
    if slo is None:
        return ("Unknown", "NoSLO", "the spec sets no SLO")
    q = f"p{slo.quantile * 100:g}"
    checks = []
    for label, target_ms, value in (
        ("TTFT", slo.ttft_milliseconds, signals.ttft_s),
        ("ITL", slo.itl_milliseconds, signals.itl_s),
    ):
        if target_ms is None:
            continue
        if value is None:
            return ("Unknown", "NoMetrics", f"no {label} measured in the window")
        ok = value * 1000 <= target_ms
        checks.append(
            (ok, f"{label} {q} {value * 1000:.0f}ms {'<=' if ok else '>'} {target_ms:g}ms")
        )
    message = "; ".join(text for _, text in checks)
    if all(ok for ok, _ in checks):
        return ("True", "Met", message)
    return ("False", "Missed", message)


def start_decision_counters(rt: Any, spec: InferencePoolSpec) -> None:
    """Start the decision counters of every role the autoscaler decides for at 0, so that
    ``rate()`` over them gives 0, not nothing, before the first decision."""
    a = spec.autoscaling
    if not a.enabled:
        return
    keys = [(spec.worker_role_label(role), d, a.mode) for role in spec.roles() for d in DIRECTIONS]
    if any(k not in rt.decisions_total for k in keys):
        rt.decisions_total = {**{k: 0 for k in keys}, **rt.decisions_total}


def _count_decision(rt: Any, spec: InferencePoolSpec, rec: Recommendation) -> None:
    key = (
        spec.worker_role_label(rec.role),
        "up" if rec.desired > rec.current else "down",
        spec.autoscaling.mode,
    )
    rt.decisions_total = {**rt.decisions_total, key: rt.decisions_total.get(key, 0) + 1}


def _decision(rec: Recommendation, stamp: str, applied: bool) -> dict[str, Any]:
    return {
        "time": stamp,
        "role": rec.role,
        "current": rec.current,
        "desired": rec.desired,
        "reason": rec.reason,
        "applied": applied,
    }


def _seconds(t: float) -> float | int:
    """A time for status: to the millisecond, without a trailing ``.0``."""
    r = round(t, 3)
    return int(r) if r == int(r) else r


def state_to_status(state: AutoscalerState) -> dict[str, Any]:
    """Each role's history as ``status.autoscaler.state`` keeps it: times in Unix seconds,
    proposals as ``[time, replicas]`` pairs, oldest first (at most MAX_PROPOSALS)."""
    out: dict[str, Any] = {}
    for role, h in state.roles.items():
        entry: dict[str, Any] = {"proposals": [[_seconds(t), p] for t, p in h.proposals]}
        if h.since is not None:
            entry["since"] = _seconds(h.since)
        if h.last_change is not None:
            entry["lastChange"] = _seconds(h.last_change)
        out[role] = entry
    return out


def _time(value: Any) -> float | None:
    """A number of seconds from status, or None for anything else (status is input)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return seconds if math.isfinite(seconds) else None


def _role_history(saved: Any, now: float, horizon: float) -> RoleHistory:
    """One role's history from status; what does not parse, or lies outside the windows,
    is left out: a run that cannot be read starts afresh (which only delays a change)."""
    if not isinstance(saved, dict):
        return RoleHistory()
    last_change = _time(saved.get("lastChange"))
    if last_change is not None:
        last_change = min(last_change, now)  # a clock ahead of ours: the cooldown from now
    since = _time(saved.get("since"))
    raw = saved.get("proposals")
    fresh = RoleHistory((), None, last_change)
    if since is None or not isinstance(raw, list) or len(raw) > MAX_PROPOSALS:
        return fresh
    proposals: list[tuple[float, int]] = []
    previous = since
    for item in raw:
        t = _time(item[0]) if isinstance(item, list) and len(item) == 2 else None
        p = _time(item[1]) if t is not None else None  # JSON may give 4 as 4.0
        if t is None or t < previous or p is None or p < 0 or p != int(p):
            return fresh  # in time order, none before the run's start: or none of it
        previous = t
        if horizon <= t <= now:
            proposals.append((t, int(p)))
    if not proposals:
        return fresh
    return RoleHistory(tuple(proposals), since, last_change)


def restore(
    saved: Any, policy: ScalingPolicy, now: float
) -> tuple[AutoscalerState, list[dict[str, Any]]]:
    """The autoscaler's state and last decisions as a previous leader left them in
    ``status.autoscaler`` (as read from the API server); whatever is missing or malformed
    starts empty, and proposals older than the longest window are dropped."""
    if not isinstance(saved, dict):
        return AutoscalerState(), []
    histories = saved.get("state")
    histories = histories if isinstance(histories, dict) else {}
    horizon = now - max(
        policy.scale_up.stabilization_window_s, policy.scale_down.stabilization_window_s
    )
    roles = {role: _role_history(histories.get(role), now, horizon) for role in policy.roles()}
    decisions = saved.get("decisions")
    kept = [
        {key: d[key] for key in _DECISION_FIELDS}
        for d in (decisions if isinstance(decisions, list) else [])
        if isinstance(d, dict)
        and all(
            isinstance(d.get(key), kind) and (kind is bool or not isinstance(d[key], bool))
            for key, kind in _DECISION_FIELDS.items()
        )
    ]
    state = AutoscalerState({r: h for r, h in roles.items() if h != RoleHistory()})
    return state, kept[-MAX_DECISIONS:]


def _owned(spec: InferencePoolSpec, role: str) -> bool:
    """Whether the autoscaler may write this role's replicas (not an HPA's or KEDA's)."""
    owner = getattr(spec, "replicas_owner", None)
    if owner is not None and owner(role) != "autoscaler":
        return False
    autoscaled = getattr(spec, "autoscaled", None)
    return bool(autoscaled(role)) if autoscaled is not None else True


def _event(rt: Any, rec: Recommendation, applied: bool) -> None:
    """A Kubernetes Event for sync to post: a change made, or new advice."""
    events = getattr(rt, "events", None)
    if events is None:
        return
    up = rec.desired > rec.current
    if applied:
        reason = "ScaledUp" if up else "ScaledDown"
    else:
        reason = "RecommendScaleUp" if up else "RecommendScaleDown"
    message = f"{rec.role}: {rec.current} -> {rec.desired} replicas: {rec.reason}"
    events.append(("Normal", reason, message))
    del events[:-MAX_EVENTS]


def autoscale_step(
    cluster: Any,
    namespace: str,
    name: str,
    spec: InferencePoolSpec,
    rt: Any,
    stamp: str,
    scrape_timeout: float = 2.0,
    clock: Any = time.time,
    *,
    status: dict[str, Any] | None = None,
) -> None:
    """Scrape, decide, act; record in ``rt`` what :func:`..handlers.sync` writes to status.

    ``status`` is the pool's ``status.autoscaler`` as read from the API server: a fresh
    process (``rt.scaler`` None) resumes the autoscaler's windows, cooldown and decisions
    from it. ``clock`` must be wall-clock time (shared by every replica of the operator).
    """
    a = spec.autoscaling
    runtime: ScalerRuntime | None = rt.scaler
    if runtime is None:
        runtime = rt.scaler = ScalerRuntime(MetricsWindow(a.window_seconds))
    elif runtime.window.window_s != a.window_seconds:
        runtime.window = MetricsWindow(a.window_seconds)  # the decisions' memory stays
    now = clock()
    replicas: dict[str, tuple[int, int]] = {}
    for role in spec.roles():
        dep = cluster.deployment(namespace, f"{name}-{role}")
        if dep is None:  # not created yet (or deleted by hand): sync makes it first
            rt.autoscaling = ("False", "Waiting", f"Deployment {name}-{role} does not exist yet")
            return
        replicas[role] = (
            int((dep.get("spec") or {}).get("replicas", 0) or 0),
            int((dep.get("status") or {}).get("readyReplicas", 0) or 0),
        )
    router, workers = scrape(cluster.pods(namespace, name), scrape_timeout)
    for role in spec.roles():
        workers.setdefault(role, [])
    quantile = spec.slo.quantile if spec.slo else 0.9
    signals = build_signals(
        now, router, workers, replicas, runtime.window,
        ttft_quantile=quantile, itl_quantile=quantile,
    )  # fmt: skip
    rt.slo = slo_condition(spec, signals)
    rt.cache = cache_condition(router)
    rt.latency = {
        metric: value
        for metric, value in (("ttft", signals.ttft_s), ("itl", signals.itl_s))
        if value is not None
    }
    if not a.enabled:
        rt.autoscaling, rt.autoscaler_status, rt.recommended = None, None, {}
        return
    start_decision_counters(rt, spec)

    policy = policy_from_spec(spec)
    if not runtime.restored:
        runtime.state, runtime.decisions = restore(status, policy, now)
        runtime.restored = True
    before = runtime.state
    recommendations, state = decide(policy, signals, before)
    recommendation = {}
    applied_roles = set()
    rt.recommended = {spec.worker_role_label(r.role): r.desired for r in recommendations.values()}
    for role, rec in recommendations.items():
        applied = False
        if a.mode == "Active" and rec.desired != rec.current and _owned(spec, role):
            cluster.scale(namespace, f"{name}-{role}", rec.desired)
            applied = True
            applied_roles.add(role)
            log.info("InferencePool %s/%s: %s %d -> %d: %s", namespace, name, role,
                     rec.current, rec.desired, rec.reason)  # fmt: skip
        entry = _decision(rec, stamp, applied)
        recommendation[role] = entry
        previous = next((d for d in reversed(runtime.decisions) if d["role"] == role), None)
        repeated = (
            previous is not None
            and not applied
            and (previous["current"], previous["desired"]) == (rec.current, rec.desired)
        )
        if rec.desired != rec.current and not repeated:  # advice given again is not news
            runtime.decisions = [*runtime.decisions, entry][-MAX_DECISIONS:]
            _count_decision(rt, spec, rec)
            _event(rt, rec, applied)
    # Only a change made starts a cooldown: advice (Advisory, External, a role an HPA owns)
    # stays what the metrics say, round after round.
    runtime.state = AutoscalerState(
        {
            role: h
            if role in applied_roles
            else replace(h, last_change=before.roles[role].last_change)
            if role in before.roles
            else replace(h, last_change=None)
            for role, h in state.roles.items()
        }
    )
    owned = [role for role in recommendations if _owned(spec, role)]
    holding = all(r.reason.startswith("hold: no") for r in recommendations.values())
    if a.mode == "Advisory":
        rt.autoscaling = ("False", "Advisory", "recommendations are recorded, not applied")
    elif a.mode == "External" or (recommendations and not owned):
        rt.autoscaling = ("False", "External", "an HPA or KEDA owns the replicas;"
                          " recommendations are recorded, not applied")  # fmt: skip
    elif holding and recommendations:
        rt.autoscaling = ("False", "MetricsUnavailable", "; ".join(
            f"{r.role}: {r.reason}" for r in recommendations.values()))  # fmt: skip
    else:
        rt.autoscaling = ("True", "Active", "replicas of " + ", ".join(owned)
                          + " are set by the autoscaler")  # fmt: skip
    rt.autoscaler_status = {
        "lastEvaluationTime": stamp,
        "ttftSeconds": signals.ttft_s,
        "itlSeconds": signals.itl_s,
        "recommendation": recommendation,
        "decisions": list(runtime.decisions),
        "state": state_to_status(runtime.state),
    }
