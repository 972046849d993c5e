"""The kopf handlers: each gathers what it needs, calls a pure function, and acts.

* create / update / resume of an InferencePool -> :func:`sync` (validate, render, apply,
  prune, status);
* any event on a child (edited or deleted by hand, or a Deployment's pods becoming ready)
  -> :func:`sync` of its pool, which restores the child and refreshes the status (the pool
  secret aside: it is made once, with a random key, and never written again);
* one operator thread over every pool: each ``autoscaling.intervalSeconds`` (or the resync
  interval) it scrapes the router and the workers, asks :mod:`kvpool.operator.autoscaler`
  for replicas, applies them (``Active``) or only records them (``Advisory``), and syncs
  the pool again as a safety net. With two replicas, only the one holding the Lease runs
  (:mod:`kvpool.operator.leader`): ``kvpool operator run`` starts kopf once it leads.
* ``/metrics`` (:mod:`kvpool.operator.metrics`), made from what this module keeps of
  each pool, when ``metrics_port`` is set.

Status is written in one place, :func:`sync`, from :func:`kvpool.operator.status.build_status`.
kopf keeps its own bookkeeping in ``kvpool.io/*`` annotations, not in the status.
"""

from __future__ import annotations

import base64
import contextvars
import copy
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from kvpool import __version__
from kvpool.api import API_VERSION, GROUP, KIND, PLURAL, VERSION, validate_pool
from kvpool.api.inferencepool import InferencePoolSpec
from kvpool.signing import new_secret

from . import metrics
from . import settings as settings_module
from .cluster import AlreadyOwned, ChildCache, Cluster, foreign_owner, merge_patch
from .leader import LeaderElector
from .podcheck import check_children, pod_security_warning
from .render import (
    GENERATED_KEY,
    GROUP_LABEL,
    MANAGED_BY,
    POOL_LABEL,
    ROLE_LABEL,
    keep_default_images,
    render,
    router_endpoint,
)
from .scaling import autoscale_step, cache_step, start_decision_counters
from .status import Observed, build_status

log = logging.getLogger(__name__)

SETTINGS: settings_module.OperatorSettings | None = None
_cluster: Cluster | None = None
_cluster_lock = threading.Lock()
# The pools' children as kopf's watches deliver them (see child_changed): syncs read them
# here, and prune finds what to delete here, instead of asking the API server each time.
CHILDREN = ChildCache()


def operator_settings() -> settings_module.OperatorSettings:
    global SETTINGS
    if SETTINGS is None:
        SETTINGS = settings_module.from_environment()
    return SETTINGS


def cluster() -> Cluster:
    global _cluster
    with _cluster_lock:
        if _cluster is None:
            _cluster = Cluster(cache=CHILDREN)
        return _cluster


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PoolRuntime:
    """What the operator knows of a pool between handler calls (not in the API server)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: bool = False  # a sync was asked for: the one running does one more round
    pending_prune: bool = False
    pending_fresh: bool = False
    fresh_at: float | None = None  # when a resync last read the children from the API server
    # (pool uid, generation) whose pool secret is known to exist: it is created (or found
    # to exist) once per spec generation; the operator cannot read Secrets to look.
    secret_checked: tuple[str, int] | None = None
    failures: int = 0  # syncs in a row whose apply failed (the retry's backoff)
    # Events for a person (kubectl describe): the autoscaler's decisions wait here to be
    # posted; a warning is posted once per new message, not at every resync.
    events: list[tuple[str, str, str]] = field(default_factory=list)
    warned: dict[str, tuple[str, int]] = field(default_factory=dict)  # message, generation
    autoscaler_status: dict[str, Any] | None = None
    slo: tuple[str, str, str] | None = None
    autoscaling: tuple[str, str, str] | None = None
    cache: tuple[str, str, str] | None = None  # CacheAgreement, from the routers' metrics
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
    CHILDREN.clear()  # filled again by this run's watches
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvpool.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvpool.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    for group, _version, plural in _CHILD_KINDS:
        settings.watching.label_selectors[group, plural] = CHILD_SELECTOR
    settings.execution.max_workers = 8
    operator_settings()  # a bad KVPOOL_OPERATOR_* value stops the start here, named


def _configure_peering(
    settings: kopf.OperatorSettings, ops: settings_module.OperatorSettings
) -> None:
    """Which replica acts is decided by the Lease that ``kvpool operator run`` holds before
    it starts kopf (:data:`LEADER`; none: this process acts alone). kopf's own peering would
    pause kopf's handlers but not this module's loop, and judges a peer's age by comparing
    its timestamp with the local clock: it is refused."""
    global _active
    if not settings.peering.standalone:
        message = (f"kopf peering {settings.peering.name!r} is not how kvpool replicas take "
                   "turns: run `kvpool operator run` with KVPOOL_OPERATOR_LEASE_NAME, or kopf "
                   "with --standalone")  # fmt: skip
        if settings.peering.mandatory:
            raise kopf.PermanentError(message)
        log.warning("%s; the operator's loop ignores kopf peering", message)
    _active = LEADER is None or LEADER.is_leader()
    if ops.lease() is not None and LEADER is None:
        log.warning("lease %s/%s is set but this process did not take it (started by `kopf "
                    "run`?): it acts alone", *ops.lease())  # fmt: skip


# --- which replica is active (the Lease) ----------------------------------------------------

LEADER: LeaderElector | None = None  # set by ``kvpool operator run``; None: acts alone
_active = False


def active() -> bool:
    """Whether this replica may act now: it holds the Lease and renewed it within the renew
    deadline (``kvpool operator run`` exits soon after that fails). A replica that takes
    over forgets its autoscalers' memory: the pools' status holds what the replica active
    meanwhile decided, and each restores from it."""
    global _active
    was = _active
    _active = LEADER is None or LEADER.is_leader()
    if _active and not was:
        with _pools_lock:
            for rt in _pools.values():
                rt.scaler = None
                rt.autoscaler_status = None  # from before the other replica's rounds
    return _active


# --- the pool -------------------------------------------------------------------------------


def _describe_api_error(exc: ApiException, child: dict[str, Any]) -> str:
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except ValueError:
        message = exc.reason
    return f"{child['kind']} {child['metadata']['name']}: {exc.status} {message}"


def sync(
    namespace: str,
    name: str,
    body: dict[str, Any] | None = None,
    prune: bool = True,
    fresh: bool = False,
) -> None:
    """Bring the pool's children in line with its spec and write its status. Concurrent
    calls for one pool coalesce, and none is lost: a call that finds one running marks one
    more round, and the runner looks for that mark again after letting go of the lock.
    ``fresh``: read the children from the API server, not the watches' cache."""
    if LEADER is not None and not LEADER.is_leader():  # it lost its Lease: no more writes
        return
    rt = runtime(namespace, name)
    rt.pending_prune = rt.pending_prune or prune
    rt.pending_fresh = rt.pending_fresh or fresh
    rt.pending = True
    while rt.pending:
        if not rt.lock.acquire(blocking=False):
            return  # the runner sees the mark: it runs again, or lets go and we take over
        try:
            while rt.pending:
                rt.pending, prune, rt.pending_prune = False, rt.pending_prune, False
                fresh, rt.pending_fresh = rt.pending_fresh, False
                _timed_sync_once(namespace, name, body, prune, rt, fresh)
                body = None  # later rounds read the pool afresh
        finally:
            rt.lock.release()


def _timed_sync_once(
    namespace: str,
    name: str,
    body: dict[str, Any] | None,
    prune: bool,
    rt: PoolRuntime,
    fresh: bool = False,
) -> None:
    started = time.perf_counter()
    result: str | None = "error"
    try:
        result = _sync_once(namespace, name, body, prune, rt, fresh)
    finally:
        if result is not None:
            metrics.RECONCILES.labels(result).inc()
            metrics.RECONCILE_DURATION.observe(time.perf_counter() - started)
        _schedule_retry(namespace, name, rt, failed=result == "error")


# --- Kubernetes Events ----------------------------------------------------------------------

_kopf_context: contextvars.Context | None = None


def _remember_kopf_context() -> None:
    """Keep a handler's context: kopf's event API works only where kopf set its posting
    queue, which the operator's own loop thread is not."""
    global _kopf_context
    _kopf_context = contextvars.copy_context()


def post_event(pool: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A Kubernetes Event about the pool (kopf posts it, in the background)."""
    meta = pool.get("metadata") or {}
    obj = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta},
    }
    try:
        kopf.event(obj, type=type_, reason=reason, message=message)
    except LookupError:  # not in a kopf handler: in the loop's thread
        if _kopf_context is None:
            log.info("no kopf context yet: event %s %s not posted: %s", type_, reason, message)
            return
        _kopf_context.copy().run(kopf.event, obj, type=type_, reason=reason, message=message)


def _warn_once(rt: PoolRuntime, pool: dict[str, Any], reason: str, message: str | None) -> None:
    """A Warning event when ``message`` is new for ``reason``; None: the problem is gone.
    A sync of an older generation (a read that raced a spec change) clears nothing."""
    generation = int((pool.get("metadata") or {}).get("generation", 0) or 0)
    seen = rt.warned.get(reason)
    if message is None:
        if seen is not None and generation >= seen[1]:
            rt.warned.pop(reason, None)
    elif seen is None or seen[0] != message:
        rt.warned[reason] = (message, generation)
        post_event(pool, "Warning", reason, message)


# --- the pool -------------------------------------------------------------------------------

SPEC_REPLICAS = "kvpool.io/spec-replicas"  # the spec's count when last synced (a Deployment's)


def _worker_replicas(
    spec: InferencePoolSpec, child: dict[str, Any], live: dict[str, Any] | None
) -> int | None:
    """Takes a worker Deployment's replicas out of ``child`` (they have their own field
    manager, see :mod:`.cluster`) and says what to write, if anything (at creation, they go
    in the first apply too, so the Deployment never starts at the API server's default):
    * the spec owns them: its count when it changed since the last sync (or at creation),
      so a ``kubectl scale`` stands until the spec's count moves, and a pool switched from
      Active or External back to the spec keeps what runs until then;
    * the autoscaler owns them: its first count at creation, then :mod:`.scaling` writes;
    * an HPA or KEDA owns them (External): never.
    The spec's count is recorded on the Deployment (``kvpool.io/spec-replicas``) only once
    it needs no write: a count that failed to be written is tried again at the next sync."""
    group = (child["metadata"].get("labels") or {}).get(GROUP_LABEL)
    if child["kind"] != "Deployment" or group not in ("prefill", "decode"):
        return None
    replicas = child["spec"].pop("replicas", None)
    count = spec.roles()[group].replicas
    annotations = child["metadata"].setdefault("annotations", {})
    seen = ((live or {}).get("metadata", {}).get("annotations") or {}).get(SPEC_REPLICAS)
    owner = spec.replicas_owner(group)
    write = None
    if live is None:
        if owner != "external":
            write = replicas
    elif owner == "spec" and seen != str(count):
        if (live.get("spec") or {}).get("replicas") != count:
            write = count
    if write is not None and live is not None:
        if seen is not None:
            annotations[SPEC_REPLICAS] = seen  # recorded once written
        else:
            annotations.pop(SPEC_REPLICAS, None)
    else:
        annotations[SPEC_REPLICAS] = str(count)
    return write


def _sync_once(
    namespace: str,
    name: str,
    body: dict[str, Any] | None,
    prune: bool,
    rt: PoolRuntime,
    fresh: bool = False,
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
    settings = operator_settings()
    children: list[dict[str, Any]] = []
    try:
        spec: InferencePoolSpec | None = validate_pool(
            name, body.get("spec") or {}, allow_host_access=settings.allow_host_access
        )
        assert spec is not None
        children = render(name, namespace, spec, settings.images(), settings.peers())
        check_children(children)
        error = None
        _warn_once(rt, body, "PodSecurity", pod_security_warning(children))
    except ValueError as exc:
        spec, error = None, str(exc)
        log.warning("InferencePool %s/%s: invalid spec, children left as they are: %s",
                    namespace, name, error)  # fmt: skip
    _warn_once(rt, body, "InvalidSpec", error)

    deployments: dict[str, Any] = {}
    apply_error = owner_error = None
    secret = previous.get("poolSecret")  # the pool secret the operator made: name and uid
    if spec is not None:
        owner = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "uid": meta["uid"]},
        }
        kopf.append_owner_reference(children, owner=owner)
        try:
            lives = [
                None if _generated(child) else c.read_cached(child, fresh) for child in children
            ]
        except ApiException as exc:
            lives, apply_error = [], f"reading the children: {exc.status} {exc.reason}"
        taken = [
            str(AlreadyOwned(child, who))
            for child, live in zip(children, lives, strict=False)
            if live is not None and (who := foreign_owner(live, name, meta["uid"]))
        ]
        changed = []
        if lives and not taken:  # the pool secret first: a name taken stops the rest
            try:
                secret, made = _ensure_pool_secret(c, rt, body, children)
            except ApiException as exc:
                secret, apply_error = previous.get("poolSecret"), _describe_api_error(
                    exc, next(ch for ch in children if _generated(ch)))  # fmt: skip
            except AlreadyOwned as exc:
                taken.append(str(exc))
            else:
                changed += made
        if taken:  # another's object: touch none, so that nothing half-made serves
            owner_error = "; ".join(taken) + " (delete or rename it)"
            log.error("InferencePool %s/%s: %s", namespace, name, owner_error)
        elif lives:
            children = keep_default_images(children, lives)
        for child, live in zip(children, lives, strict=False):
            if owner_error:
                break
            if _generated(child):
                continue
            replicas = _worker_replicas(spec, child, live)
            try:
                if not c.converged(live, child):  # the usual case, unchanged: no apply
                    live = c.apply(child, live, create_replicas=replicas)
                    changed.append(f"{child['kind']} {child['metadata']['name']}")
                if replicas is not None:
                    live = c.scale(namespace, child["metadata"]["name"], replicas)
            except AlreadyOwned as exc:  # taken between the read and the write
                owner_error = f"{exc} (delete or rename it)"
                break
            except ApiException as exc:
                apply_error = _describe_api_error(exc, child)
                log.error("InferencePool %s/%s: %s", namespace, name, apply_error)
                continue
            if child["kind"] == "Deployment":
                labels = child["metadata"]["labels"]
                deployments[labels.get(GROUP_LABEL) or "router"] = live
        if changed and not (apply_error or owner_error):
            post_event(body, "Normal", "Applied", "applied " + ", ".join(changed))
        if prune and not (apply_error or owner_error):
            try:
                pruned = c.prune(namespace, name, meta["uid"], children, fresh)
                if secret is not None and not any(_generated(ch) for ch in children):
                    if c.delete_made(_secret_object(namespace, secret["name"]), secret["uid"]):
                        pruned.append(f"Secret/{secret['name']}")
                    secret = None
            except ApiException as exc:
                pruned, apply_error = [], f"pruning: {exc.status} {exc.reason}"
            if pruned:
                post_event(body, "Normal", "Pruned", "deleted " + ", ".join(pruned))
        endpoint = router_endpoint(name, namespace, spec)
    if spec is None or owner_error:
        for group in ("router", "prefill", "decode"):
            deployments.setdefault(group, c.deployment(namespace, f"{name}-{group}"))
        endpoint = (previous.get("router") or {}).get("endpoint") if spec is None else endpoint
    _warn_once(rt, body, "AlreadyOwned", owner_error)
    _warn_once(rt, body, "ApplyFailed", apply_error)
    for type_, reason, message in rt.events:
        post_event(body, type_, reason, message)
    rt.events = []
    observed = Observed(
        generation=generation,
        deployments=deployments,
        error=error,
        apply_error=apply_error,
        owner_error=owner_error,
        autoscaler=_autoscaler_status(spec, rt, previous),
        slo=rt.slo,
        autoscaling=rt.autoscaling,
        cache=rt.cache,
    )
    status = build_status(spec, observed, previous, now(), endpoint)
    status["poolSecret"] = secret
    patch = status_patch(previous, status)
    if patch:
        c.patch_status(namespace, name, patch)
    _record_for_metrics(rt, spec, deployments, status)
    return "invalid" if error else "error" if (apply_error or owner_error) else "ok"


def _autoscaler_status(
    spec: InferencePoolSpec | None, rt: PoolRuntime, previous: dict[str, Any]
) -> dict[str, Any] | None:
    """``status.autoscaler`` as this sync writes it: the autoscaler's own once it has run
    here; until then (a restart or a take-over, whose first sync comes before the loop's
    first round) the predecessor's, as it stands. That round restores the windows from it:
    dropped, they would start again, and a change would wait for a whole new window."""
    if spec is None or (spec.autoscaling.enabled and rt.autoscaler_status is None):
        return previous.get("autoscaler")
    return rt.autoscaler_status


def _secret_object(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace}}  # fmt: skip


def _ensure_pool_secret(
    c: Cluster, rt: PoolRuntime, pool: dict[str, Any], children: list[dict[str, Any]]
) -> tuple[dict[str, str] | None, list[str]]:
    """Create the pool secret when the pool has one made for it; its record for
    ``status.poolSecret`` (name and uid: how the operator, which may not read Secrets, knows
    it made it, and what it may delete), and what was created, in words.

    A create is sent once per spec generation (in each operator process): a 409 says that
    one exists. It is the pool's when the pool's status records it, or when the pool was
    synced before by an operator that kept no record (made by it, then); else someone
    else's, and :class:`AlreadyOwned` is raised. A pool secret deleted by hand is made
    again, with a new key, at the pool's next spec change or the operator's restart."""
    meta = pool["metadata"]
    previous = pool.get("status") or {}
    record = previous.get("poolSecret")
    child = next((ch for ch in children if _generated(ch)), None)
    if child is None:
        return record, []
    name = child["metadata"]["name"]
    if record is not None and record.get("name") != name:
        record = None
    checked = (meta["uid"], int(meta.get("generation", 0) or 0))
    if rt.secret_checked == checked:
        return record, []
    made = c.create_once(with_generated_key(child))
    if made is not None:
        record = {"name": name, "uid": made["metadata"].get("uid", "")}
        # recorded at once: a restart before the sync's status write would find a Secret it
        # made and no record of it, and take it for another's
        c.patch_status(meta["namespace"], meta["name"], {"poolSecret": record})
        rt.secret_checked = checked
        return record, [f"Secret {name}"]
    if record is None and previous.get("observedGeneration") is None:
        raise AlreadyOwned(child, "not one the operator made for this pool (it cannot read "
                           "Secrets to tell whose it is)")  # fmt: skip
    rt.secret_checked = checked
    return record, []


def _generated(child: dict[str, Any]) -> str | None:
    """The key of a child whose data the operator generates once (the pool secret)."""
    return ((child["metadata"].get("annotations") or {}).get(GENERATED_KEY)) or None


def with_generated_key(child: dict[str, Any]) -> dict[str, Any]:
    """The child, its generated key filled with a new pool secret (256 random bits, as text:
    it reaches the pods as an environment variable)."""
    body = copy.deepcopy(child)
    value = new_secret().encode()
    body["data"] = {_generated(child): base64.b64encode(value).decode()}
    return body


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def status_patch(previous: dict[str, Any], status: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that turns ``previous`` into ``status``, with ``null`` for every key
    that no longer applies (a merge patch keeps what it does not name); None: no change."""
    wanted = _without_nulls(status)
    if wanted == previous:
        return None
    return merge_patch(previous, wanted)


def _schedule_retry(namespace: str, name: str, rt: PoolRuntime, failed: bool) -> None:
    """After a failed apply, the loop syncs the pool again in 1, 2, 4 ... 60 s, not at the
    next resync; a sync that succeeds resets the backoff."""
    if not failed:
        rt.failures = 0
        return
    rt.failures += 1
    delay = min(2.0 ** (rt.failures - 1), RETRY_MAX_S)
    with _pools_lock:
        key = (namespace, name)
        _retry[key] = min(_retry.get(key, float("inf")), time.monotonic() + delay)


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


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(namespace: str, name: str, **_: Any) -> None:
    """The pool as it is now, not the body of the event: kopf may hand a handler an event
    from before the operator's own status write (it runs creation again when its annotation
    lags that write), and a status built on a stale one moves every condition's time."""
    _remember_kopf_context()
    sync(namespace, name)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def resume(namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    """An operator (re)started, or a replica took over, and finds the pool: say so, and what
    the autoscaler takes up again from the pool's status."""
    _remember_kopf_context()
    plain = _plain(body)
    saved = ((plain.get("status") or {}).get("autoscaler") or {}).get("state")
    carried = "; the autoscaler resumes its windows from status" if saved else ""
    post_event(plain, "Normal", "Resumed",
               f"kvpool operator {__version__} took the pool up again{carried}")  # fmt: skip
    sync(namespace, name)


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
    ("networking.k8s.io", "v1", "networkpolicies"),
    # Not Secrets: the pool secret is made once and never restored or rewritten, so the
    # operator need not watch (nor be able to read as they change) the cluster's Secrets; one
    # deleted by hand is made again, with a new key, at the next resync.
)


def child_changed(event: dict[str, Any], body: kopf.Body, namespace: str, **_: Any) -> None:
    """A child was added, changed or deleted (by us, by its controller or by hand)."""
    CHILDREN.seen(_plain(body), deleted=event.get("type") == "DELETED")
    labels = body.get("metadata", {}).get("labels") or {}
    owners = body.get("metadata", {}).get("ownerReferences") or []
    pool = labels.get(POOL_LABEL)
    if not pool or not any(o.get("kind") == KIND and o.get("name") == pool for o in owners):
        return
    # A child that is edited back or re-created by this very sync causes one more, quiet one.
    sync(namespace, pool, prune=False)


CHILD_SELECTOR = f"app.kubernetes.io/managed-by={MANAGED_BY}"

for _group, _version, _plural in _CHILD_KINDS:
    # The label filter is checked here too; the API server filters first (the selector set
    # in :func:`configure`), so the operator never lists the cluster's other objects.
    kopf.on.event(_group, _version, _plural, labels={"app.kubernetes.io/managed-by": MANAGED_BY})(
        child_changed
    )


# --- the loop: autoscaling and resync -------------------------------------------------------
#
# One thread for every pool, not a kopf daemon or timer per pool: those put a finalizer on
# each pool, and a finalizer left behind by an uninstalled operator blocks the pool's
# deletion. Pools enter the loop from their watch events and leave it when deleted.

_due: dict[tuple[str, str], float] = {}
_retry: dict[tuple[str, str], float] = {}  # pools whose last apply failed: when to try again
RETRY_MAX_S = 60.0
FRESH_ROUNDS = 10  # a resync in this many reads the children from the API server
_loop_stop = threading.Event()
_loop_thread: threading.Thread | None = None


@kopf.on.event(GROUP, VERSION, PLURAL)
def pool_seen(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
    _remember_kopf_context()
    key = (namespace, name)
    with _pools_lock:
        if event.get("type") == "DELETED":
            _due.pop(key, None)
            _retry.pop(key, None)
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
            retry = [k for k, t in _retry.items() if t <= time.monotonic() and k not in due]
            for key in retry:
                _retry.pop(key, None)
        for namespace, name in retry:
            if _loop_stop.is_set() or not active():
                break
            try:
                sync(namespace, name)
            except Exception:  # scheduled again by the next failure, or by the resync
                log.exception("InferencePool %s/%s: retry failed", namespace, name)
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
                _retry.pop((namespace, name), None)
                _pools.pop((namespace, name), None)
            return interval
        try:
            spec = validate_pool(
                name, body.get("spec") or {}, allow_host_access=settings.allow_host_access
            )
        except ValueError:
            spec = None
        if spec is not None and (spec.autoscaling.enabled or spec.slo is not None):
            interval = min(interval, spec.autoscaling.interval_seconds)
            saved = (body.get("status") or {}).get("autoscaler")
            autoscale_step(cluster(), namespace, name, spec, rt, now(), settings.scrape_timeout_s,
                           status=saved)  # fmt: skip
        elif spec is not None:
            rt.autoscaler_status, rt.slo, rt.autoscaling, rt.scaler = None, None, None, None
            rt.recommended, rt.latency = {}, {}
            cache_step(cluster(), namespace, name, rt, settings.scrape_timeout_s)
        # Now and then (every FRESH_ROUNDS resyncs) the children are read from the API
        # server, not the watches' cache: what a watch missed while kopf re-listed (an
        # object deleted meanwhile sends no event) is found within minutes.
        now_s = time.monotonic()
        fresh = rt.fresh_at is None or now_s - rt.fresh_at >= FRESH_ROUNDS * interval
        if fresh:
            rt.fresh_at = now_s
        sync(namespace, name, fresh=fresh)  # reads the pool again: the scrape took seconds
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
        _retry.clear()
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
