"""The kopf handlers: each gathers what it needs, calls a pure function, and acts.

* create / update / resume of an InferencePool -> :func:`sync` (validate, render, apply,
  prune, status);
* any event on a child (edited or deleted by hand, or a Deployment's pods becoming ready)
  -> :func:`sync` of its pool, which restores the child and refreshes the status;
* one operator thread over every pool: each ``autoscaling.intervalSeconds`` (or the resync
  interval) it scrapes the router and the workers, asks :mod:`kvpool.operator.autoscaler`
  for replicas, applies them (``Active``) or only records them (``Advisory``), and syncs
  the pool again as a safety net. With two replicas (kopf peering), only the active one
  runs it (:mod:`kvpool.operator.peering`), as kopf runs the handlers only there.
* ``/metrics`` (:mod:`kvpool.operator.metrics`), made from what this module keeps of
  each pool, when ``metrics_port`` is set.

Status is written in one place, :func:`sync`, from :func:`kvpool.operator.status.build_status`.
kopf keeps its own bookkeeping in ``kvpool.io/*`` annotations, not in the status.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpool.api import API_VERSION, GROUP, KIND, PLURAL, VERSION, validate_pool
from kvpool.api.inferencepool import InferencePoolSpec

from . import metrics
from . import settings as settings_module
from .cluster import Cluster
from .peering import PeeringReader, kubernetes_fetch
from .render import GROUP_LABEL, MANAGED_BY, POOL_LABEL, ROLE_LABEL, render, router_endpoint
from .scaling import autoscale_step, start_decision_counters
from .status import Observed, build_status

log = logging.getLogger(__name__)

SETTINGS: settings_module.OperatorSettings | None = None
IDENTITY: str | None = None  # this replica's kopf peer id, as ``kvpool operator run`` passed it
_cluster: Cluster | None = None
_cluster_lock = threading.Lock()


def operator_settings() -> settings_module.OperatorSettings:
    global SETTINGS
    if SETTINGS is None:
        SETTINGS = settings_module.from_environment()
    return SETTINGS


def cluster() -> Cluster:
    global _cluster
    with _cluster_lock:
        if _cluster is None:
            _cluster = Cluster()
        return _cluster


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PoolRuntime:
    """What the operator knows of a pool between handler calls (not in the API server)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: bool = False
    autoscaler_status: dict[str, Any] | None = None
    slo: tuple[str, str, str] | None = None
    autoscaling: tuple[str, str, str] | None = None
    scaler: Any = None  # the autoscaler's state and metrics window (see autoscale_step)
    # For /metrics, by the workers' role label. The metrics thread reads them while the
    # handlers write: each is replaced whole, never changed in place.
    phase: str | None = None
    replicas: dict[str, tuple[int, int]] = field(default_factory=dict)  # (desired, ready)
    recommended: dict[str, int] = field(default_factory=dict)
    decisions_total: dict[tuple[str, str, str], int] = field(default_factory=dict)
    slo_targets: dict[str, float] = field(default_factory=dict)  # ttft/itl -> seconds
    slo_quantile: float | None = None
    latency: dict[str, float] = field(default_factory=dict)  # ttft/itl -> seconds


_pools: dict[tuple[str, str], PoolRuntime] = {}
_pools_lock = threading.Lock()


def runtime(namespace: str, name: str) -> PoolRuntime:
    with _pools_lock:
        return _pools.setdefault((namespace, name), PoolRuntime())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod, its service account; elsewhere ``KUBECONFIG`` as it is set now (the
    ``kubernetes`` client reads that variable once, when first imported)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _cluster
    with _cluster_lock:
        _cluster = None  # made at first use, from the credentials of this run
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvpool.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
    ops = operator_settings()  # a bad KVPOOL_OPERATOR_* value stops the start here, named
    settings.peering.lifetime = ops.peering_lifetime_s


def _configure_peering(
    settings: kopf.OperatorSettings, ops: settings_module.OperatorSettings
) -> None:
    """Standalone: active. With peering: active while the peering object says so."""
    global _peering, _active
    if settings.peering.standalone:
        _peering, _active = None, True
        return
    identity = IDENTITY or os.environ.get("POD_ID")
    if identity is None:
        log.warning("peering %r: this replica's peer id is unknown (set POD_ID, or start it "
                    "with kvpool operator run): a live peer of equal priority may be this "
                    "one, so only a higher one pauses the loop", settings.peering.name)  # fmt: skip
    _peering = PeeringReader(
        kubernetes_fetch(lambda: cluster().client, settings.peering.name),
        identity,
        settings.peering.priority,
        namespaces=None if settings.peering.clusterwide else ops.namespace or None,
        mandatory=settings.peering.mandatory,
        lifetime_s=settings.peering.lifetime,
    )
    _active = False


# --- which replica is active (kopf peering) -------------------------------------------------

_peering: PeeringReader | None = None  # None: standalone
_active = False


def active() -> bool:
    """Whether this replica may act now (read at most once a second with peering)."""
    global _active
    _active = True if _peering is None else _peering.active()
    return _active


# --- the pool -------------------------------------------------------------------------------


def _autoscaled_paths(spec: InferencePoolSpec, child: dict[str, Any]) -> list[tuple[str, ...]]:
    group = (child["metadata"].get("labels") or {}).get(GROUP_LABEL)
    if child["kind"] == "Deployment" and group and spec.autoscaled(group):
        return [("spec", "replicas")]
    return []


def _describe_api_error(exc: ApiException, child: dict[str, Any]) -> str:
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        message = exc.reason
    return f"{child['kind']} {child['metadata']['name']}: {exc.status} {message}"


def sync(namespace: str, name: str, body: dict[str, Any] | None = None, prune: bool = True) -> None:
    """Bring the pool's children in line with its spec and write its status. Concurrent
    calls for one pool coalesce: a call that finds one running leaves it one more round."""
    rt = runtime(namespace, name)
    if not rt.lock.acquire(blocking=False):
        rt.pending = True
        return
    try:
        while True:
            rt.pending = False
            _timed_sync_once(namespace, name, body, prune, rt)
            body = None  # later rounds read the pool afresh
            if not rt.pending:
                break
    finally:
        rt.lock.release()


def _timed_sync_once(
    namespace: str, name: str, body: dict[str, Any] | None, prune: bool, rt: PoolRuntime
) -> None:
    started = time.perf_counter()
    result: str | None = "error"
    try:
        result = _sync_once(namespace, name, body, prune, rt)
    finally:
        if result is not None:
            metrics.RECONCILES.labels(result).inc()
            metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)


def _sync_once(
    namespace: str, name: str, body: dict[str, Any] | None, prune: bool, rt: PoolRuntime
) -> str | None:
    """One reconcile; its result for the metrics (ok, invalid, error), or None when the
    pool is gone."""
    c = cluster()
    body = body if body is not None else c.pool(namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None  # gone or going: garbage collection removes the children
    meta = body["metadata"]
    generation = int(meta.get("generation", 0) or 0)
    previous = body.get("status") or {}
    try:
        spec: InferencePoolSpec | None = validate_pool(name, body.get("spec") or {})
        error = None
    except ValueError as exc:
        spec, error = None, str(exc)
        log.warning("InferencePool %s/%s: invalid spec, children left as they are: %s",
                    namespace, name, error)  # fmt: skip

    deployments: dict[str, Any] = {}
    apply_error = None
    if spec is not None:
        children = render(name, namespace, spec, operator_settings().images())
        owner = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "uid": meta["uid"]},
        }
        kopf.append_owner_reference(children, owner=owner)
        for child in children:
            try:
                live = c.apply(child, unowned=_autoscaled_paths(spec, child))
            except ApiException as exc:
                apply_error = _describe_api_error(exc, child)
                log.error("InferencePool %s/%s: %s", namespace, name, apply_error)
                continue
            if child["kind"] == "Deployment":
                labels = child["metadata"]["labels"]
                deployments[labels.get(GROUP_LABEL) or "router"] = live
        if prune and apply_error is None:
            c.prune(namespace, name, meta["uid"], children)
        endpoint = router_endpoint(name, namespace, spec)
    else:
        for group in ("router", "prefill", "decode"):
            deployments[group] = c.deployment(namespace, f"{name}-{group}")
        endpoint = (previous.get("router") or {}).get("endpoint")
    observed = Observed(
        generation=generation,
        deployments=deployments,
        error=error,
        apply_error=apply_error,
        autoscaler=rt.autoscaler_status if spec is not None else previous.get("autoscaler"),
        slo=rt.slo,
        autoscaling=rt.autoscaling,
    )
    status = build_status(spec, observed, previous, now(), endpoint)
    if status != {k: previous.get(k) for k in status}:
        c.patch_status(namespace, name, status)
    _record_for_metrics(rt, spec, deployments, status)
    return "invalid" if error else "error" if apply_error else "ok"


def _record_for_metrics(
    rt: PoolRuntime,
    spec: InferencePoolSpec | None,
    deployments: dict[str, Any],
    status: dict[str, Any],
) -> None:
    replicas = {}
    for role in ("prefill", "decode"):
        dep = deployments.get(role)
        if dep is None or (spec is not None and role not in spec.roles()):
            continue
        if spec is not None:
            label = spec.worker_role_label(role)
        else:  # as it runs: the label its pods carry
            template = (dep.get("spec") or {}).get("template") or {}
            label = ((template.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL, role)
        replicas[label] = (
            int((dep.get("spec") or {}).get("replicas", 0) or 0),
            int((dep.get("status") or {}).get("readyReplicas", 0) or 0),
        )
    rt.replicas = replicas
    rt.phase = status.get("phase")
    if spec is None:
        return  # the last valid spec's SLO and autoscaling stand
    slo = spec.slo
    targets = {}
    if slo is not None and slo.ttft_milliseconds is not None:
        targets["ttft"] = slo.ttft_milliseconds / 1000
    if slo is not None and slo.itl_milliseconds is not None:
        targets["itl"] = slo.itl_milliseconds / 1000
    rt.slo_targets = targets
    rt.slo_quantile = slo.quantile if slo is not None else None
    start_decision_counters(rt, spec)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    sync(namespace, name, _plain(body))


def _plain(body: Any) -> dict[str, Any]:
    """kopf's live body view as plain data (what the API server sent)."""
    return copy.deepcopy(dict(body))


# --- the children ---------------------------------------------------------------------------

_CHILD_KINDS = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("policy", "v1", "poddisruptionbudgets"),
)


def child_changed(event: dict[str, Any], body: kopf.Body, namespace: str, **_: Any) -> None:
    """A child was added, changed or deleted (by us, by its controller or by hand)."""
    labels = body.get("metadata", {}).get("labels") or {}
    owners = body.get("metadata", {}).get("ownerReferences") or []
    pool = labels.get(POOL_LABEL)
    if not pool or not any(o.get("kind") == KIND and o.get("name") == pool for o in owners):
        return
    # A child that is edited back or re-created by this very sync causes one more, quiet one.
    sync(namespace, pool, prune=False)


for _group, _version, _plural in _CHILD_KINDS:
    kopf.on.event(_group, _version, _plural, labels={"app.kubernetes.io/managed-by": MANAGED_BY})(
        child_changed
    )


# --- the loop: autoscaling and resync -------------------------------------------------------
#
# One thread for every pool, not a kopf daemon or timer per pool: those put a finalizer on
# each pool, and a finalizer left behind by an uninstalled operator blocks the pool's
# deletion. Pools enter the loop from their watch events and leave it when deleted.

_due: dict[tuple[str, str], float] = {}
_loop_stop = threading.Event()
_loop_thread: threading.Thread | None = None


@kopf.on.event(GROUP, VERSION, PLURAL)
def pool_seen(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
    key = (namespace, name)
    with _pools_lock:
        if event.get("type") == "DELETED":
            _due.pop(key, None)
            _pools.pop(key, None)
        else:
            _due.setdefault(key, 0.0)


def _loop() -> None:
    while not _loop_stop.wait(0.5):
        try:
            if not active():  # another replica scales and resyncs; kopf pauses us too
                continue
        except Exception:
            log.exception("peering: cannot tell whether this replica is active")
            continue
        with _pools_lock:
            due = [k for k, t in _due.items() if t <= time.monotonic()]
        for namespace, name in due:
            if _loop_stop.is_set() or not active():
                break
            interval = tick(namespace, name)
            with _pools_lock:
                if (namespace, name) in _due:
                    _due[(namespace, name)] = time.monotonic() + interval


def tick(namespace: str, name: str) -> float:
    """One round for a pool: measure (and scale) if it asks to, then resync. Returns the
    seconds until its next round."""
    settings = operator_settings()
    interval = settings.resync_interval_s
    rt = runtime(namespace, name)
    try:
        body = cluster().pool(namespace, name)
        if body is None:  # deleted while this replica was paused, so its event was missed
            with _pools_lock:
                _due.pop((namespace, name), None)
                _pools.pop((namespace, name), None)
            return interval
        try:
            spec = validate_pool(name, body.get("spec") or {})
        except ValueError:
            spec = None
        if spec is not None and (spec.autoscaling.enabled or spec.slo is not None):
            interval = min(interval, spec.autoscaling.interval_seconds)
            autoscale_step(cluster(), namespace, name, spec, rt, now(), settings.scrape_timeout_s)
        elif spec is not None:
            rt.autoscaler_status, rt.slo, rt.autoscaling, rt.scaler = None, None, None, None
            rt.recommended, rt.latency = {}, {}
        sync(namespace, name)  # reads the pool again: the scrape may have taken seconds
    except Exception:  # the next round tries again; the pool keeps serving
        log.exception("InferencePool %s/%s: periodic round failed", namespace, name)
    return interval


@kopf.on.startup()
def start_loop(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _loop_thread
    _configure_peering(settings, operator_settings())
    _loop_stop.clear()
    _loop_thread = threading.Thread(target=_loop, name="kvpool-operator-loop", daemon=True)
    _loop_thread.start()


@kopf.on.cleanup()
def stop_loop(**_: Any) -> None:
    _loop_stop.set()
    if _loop_thread is not None:
        _loop_thread.join(timeout=10)
    with _pools_lock:
        _due.clear()
        _pools.clear()


# --- /metrics -------------------------------------------------------------------------------

_metrics_server: Any = None


def metrics_snapshot() -> metrics.OperatorView:
    """What /metrics shows now. A paused replica shows no pool: the active one does."""
    if not _active:
        return metrics.OperatorView(active=False)
    with _pools_lock:
        pools = list(_pools.items())
    return metrics.OperatorView(
        active=True,
        pools=tuple(
            metrics.PoolView(
                namespace=namespace,
                name=name,
                phase=rt.phase,
                roles=tuple(
                    metrics.RoleView(role, desired, ready)
                    for role, (desired, ready) in rt.replicas.items()
                ),
                recommended=rt.recommended,
                decisions=rt.decisions_total,
                slo_targets=rt.slo_targets,
                slo_quantile=rt.slo_quantile,
                latency=rt.latency,
            )
            for (namespace, name), rt in pools
        ),
    )


@kopf.on.startup()
def start_metrics(**_: Any) -> None:
    global _metrics_server
    port = operator_settings().metrics_port
    if port is not None:
        _metrics_server = metrics.serve(metrics.make_registry(metrics_snapshot), port)


def metrics_port() -> int | None:
    """The port /metrics is served on (the one bound, when the setting was 0)."""
    return _metrics_server.server_port if _metrics_server is not None else None


@kopf.on.cleanup()
def stop_metrics(**_: Any) -> None:
    global _metrics_server
    if _metrics_server is not None:
        _metrics_server.shutdown()
        _metrics_server.server_close()
        _metrics_server = None
