"""One autoscaling round for one pool: scrape, build signals, decide, act, record.

The deciding is pure (:mod:`.signals`, :mod:`.autoscaler`); this module gathers its inputs
from the cluster (the pool's pods, scraped on their ``prometheus.io/port``) and acts on the
answer: in ``Active`` mode it writes the Deployments' replicas, and only then (one owner:
the spec's replicas of an autoscaled role are not applied), in ``Advisory`` mode it only
records. Either way the recommendation and the last five changes go to the pool's status,
and the recommendation, the windowed latencies and a count of decisions to the operator's
``/metrics`` (through the pool's runtime record, ``rt``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvpool.api.inferencepool import InferencePoolSpec

from .autoscaler import AutoscalerState, Behavior, Bounds, Recommendation, ScalingPolicy, decide
from .render import COMPONENT_LABEL, GROUP_LABEL
from .signals import MetricsWindow, Signals, build_signals

log = logging.getLogger(__name__)

MAX_DECISIONS = 5
DIRECTIONS = ("up", "down")


@dataclass
class ScalerRuntime:
    window: MetricsWindow
    state: AutoscalerState = field(default_factory=AutoscalerState)
    decisions: list[dict[str, Any]] = field(default_factory=list)


def policy_from_spec(spec: InferencePoolSpec) -> ScalingPolicy:
    a = spec.autoscaling
    slo = spec.slo

    def bounds(role: str) -> Bounds:
        """The spec's bounds; without them (Advisory, SLO only) up to the spec's count."""
        b = getattr(a, role)
        if b is None:
            return Bounds(1, max(1, spec.roles()[role].replicas))
        return Bounds(b.min_replicas, b.max_replicas)

    decode = bounds("decode")
    prefill = bounds("prefill") if spec.prefill is not None else None
    quantile = slo.quantile if slo else 0.9
    return ScalingPolicy(
        decode=decode,
        prefill=prefill,
        ttft_target_s=slo.ttft_milliseconds / 1000 if slo and slo.ttft_milliseconds else None,
        itl_target_s=slo.itl_milliseconds / 1000 if slo and slo.itl_milliseconds else None,
        scale_up=Behavior(a.scale_up.stabilization_window_seconds, a.scale_up.max_step),
        scale_down=Behavior(a.scale_down.stabilization_window_seconds, a.scale_down.max_step),
        cooldown_s=a.cooldown_seconds,
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


def autoscale_step(
    cluster: Any,
    namespace: str,
    name: str,
    spec: InferencePoolSpec,
    rt: Any,
    stamp: str,
    scrape_timeout: float = 2.0,
    clock: Any = time.time,
) -> None:
    """Scrape, decide, act; record in ``rt`` what :func:`..handlers.sync` writes to status."""
    a = spec.autoscaling
    runtime: ScalerRuntime | None = rt.scaler
    if runtime is None or runtime.window.window_s != a.window_seconds:
        runtime = rt.scaler = ScalerRuntime(MetricsWindow(a.window_seconds))
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
    rt.latency = {
        metric: value
        for metric, value in (("ttft", signals.ttft_s), ("itl", signals.itl_s))
        if value is not None
    }
    if not a.enabled:
        rt.autoscaling, rt.autoscaler_status, rt.recommended = None, None, {}
        return
    start_decision_counters(rt, spec)

    before = runtime.state
    recommendations, runtime.state = decide(policy_from_spec(spec), signals, before)
    if a.mode == "Advisory":
        # Nothing was changed, so nothing starts a cooldown: the advice stays what the
        # metrics say, round after round.
        runtime.state = AutoscalerState(
            {
                role: replace(h, last_change=before.roles[role].last_change)
                if role in before.roles
                else replace(h, last_change=None)
                for role, h in runtime.state.roles.items()
            }
        )
    recommendation = {}
    rt.recommended = {spec.worker_role_label(r.role): r.desired for r in recommendations.values()}
    for role, rec in recommendations.items():
        applied = False
        if a.mode == "Active" and rec.desired != rec.current:
            cluster.scale(namespace, f"{name}-{role}", rec.desired)
            applied = True
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
    holding = all(r.reason.startswith("hold: no") for r in recommendations.values())
    if a.mode == "Advisory":
        rt.autoscaling = ("False", "Advisory", "recommendations are recorded, not applied")
    elif holding and recommendations:
        rt.autoscaling = ("False", "MetricsUnavailable", "; ".join(
            f"{r.role}: {r.reason}" for r in recommendations.values()))  # fmt: skip
    else:
        rt.autoscaling = ("True", "Active", "replicas of " + ", ".join(recommendations)
                          + " are set by the autoscaler")  # fmt: skip
    rt.autoscaler_status = {
        "lastEvaluationTime": stamp,
        "ttftSeconds": signals.ttft_s,
        "itlSeconds": signals.itl_s,
        "recommendation": recommendation,
        "decisions": list(runtime.decisions),
    }
