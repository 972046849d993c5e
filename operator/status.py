"""A pool's status from what the cluster shows: a pure function, the one place status is made.

Ready means clients can be served now: the router has an available replica and every role
has a ready worker. Progressing means a rollout or a scale is under way; False with reason
ProgressDeadlineExceeded, a Deployment's rollout has failed (as Argo CD, Flux and
kube-state-metrics read a Deployment). Degraded means the operator cannot do what the spec
asks (the spec is invalid, or applying it failed) or the cluster will not run it (a
Deployment's pods are refused: Pod Security admission, a ResourceQuota; or its rollout passed
its progress deadline); the children keep running as they were. Why comes from the
Deployments' own conditions, in their controller's words, so that ``kubectl describe`` shows
it and no one has to go looking in ReplicaSet events. A condition's lastTransitionTime moves
only when its status does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.api import InferencePoolSpec

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Observed:
    """What the handlers saw: the live Deployments by group (router, prefill, decode)."""

    generation: int
    deployments: dict[str, Manifest | None] = field(default_factory=dict)
    error: str | None = None  # the spec's problems (reason InvalidSpec)
    apply_error: str | None = None  # the API server refused a child (reason ApplyFailed)
    owner_error: str | None = None  # a child's name is another's object (reason AlreadyOwned)
    autoscaler: dict[str, Any] | None = None  # status.autoscaler as recorded by the daemon
    slo: tuple[str, str, str] | None = None  # (status, reason, message) of SLOMet
    autoscaling: tuple[str, str, str] | None = None  # the same, for AutoscalingActive
    cache: tuple[str, str, str] | None = None  # the same, for CacheAgreement


# A Deployment's message as status keeps it: Pod Security names every violation of every
# container, and an admission webhook may say anything, at any length.
MESSAGE_MAX = 1024
# The same where Ready and Progressing repeat it beside their own news (Degraded has it whole).
BRIEF_MAX = 200


@dataclass(frozen=True)
class Failure:
    """Why a Deployment's pods do not come up, in its controller's words."""

    deployment: str
    timed_out: bool  # Progressing False, ProgressDeadlineExceeded; else ReplicaFailure True
    reason: str  # the Deployment condition's: FailedCreate, FailedDelete, ProgressDeadlineExceeded
    message: str  # at most MESSAGE_MAX characters

    @property
    def condition(self) -> str:
        return "ProgressDeadlineExceeded" if self.timed_out else "ReplicaFailure"


def failures(dep: Manifest | None) -> list[Failure]:
    """The Deployment's failed conditions, refusals (the cause) before a timed-out rollout
    (their effect). None while its controller has not seen the latest change: they are about
    the one before (``kubectl rollout status`` and Argo CD wait for observedGeneration too)."""
    if dep is None:
        return []
    meta, st = dep.get("metadata") or {}, dep.get("status") or {}
    if int(st.get("observedGeneration", 0) or 0) < int(meta.get("generation", 0) or 0):
        return []
    name = meta.get("name", "?")
    found = []
    for c in st.get("conditions") or []:
        reason, message = c.get("reason") or "", _truncate(c.get("message") or "", MESSAGE_MAX)
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            found.append(Failure(name, False, reason or "ReplicaFailure", message))
        elif c.get("type") == "Progressing" and reason == "ProgressDeadlineExceeded":
            found.append(Failure(name, True, reason, message))
    return sorted(found, key=lambda f: f.timed_out)


def _truncate(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def role_status(dep: Manifest | None) -> dict[str, Any]:
    spec = (dep or {}).get("spec") or {}
    st = (dep or {}).get("status") or {}
    desired = int(spec.get("replicas", 0) or 0)
    ready = int(st.get("readyReplicas", 0) or 0)
    return {
        "desiredReplicas": desired,
        "replicas": int(st.get("replicas", 0) or 0),
        "readyReplicas": ready,
        "updatedReplicas": int(st.get("updatedReplicas", 0) or 0),
        "summary": f"{ready}/{desired}",
        **_why(dep),
    }


def _why(dep: Manifest | None) -> dict[str, str]:
    """A role's (or the router's) ``reason`` and ``message``: its Deployment's first failure;
    nothing while there is none."""
    found = failures(dep)
    return {"reason": found[0].reason, "message": found[0].message} if found else {}


def _rolling(dep: Manifest | None) -> str | None:
    """Why this Deployment is still moving, or None when it has settled."""
    if dep is None:
        return "not created yet"
    meta, spec, st = dep.get("metadata") or {}, dep.get("spec") or {}, dep.get("status") or {}
    desired = int(spec.get("replicas", 0) or 0)
    if int(st.get("observedGeneration", 0) or 0) < int(meta.get("generation", 0) or 0):
        return "change not yet seen by its controller"
    if int(st.get("updatedReplicas", 0) or 0) < desired:
        return f"{st.get('updatedReplicas', 0) or 0}/{desired} updated"
    if int(st.get("replicas", 0) or 0) > desired:
        return "old pods terminating"
    if int(st.get("readyReplicas", 0) or 0) < desired:
        return f"{st.get('readyReplicas', 0) or 0}/{desired} ready"
    return None


def _progress(deps: dict[str, Manifest | None], groups: list[str]) -> tuple[str, str, str]:
    """(status, reason, message) of Progressing. A rollout past its deadline has failed,
    whatever else still moves (listed after it); a refusal is named where it holds one up."""
    timed_out, moving = [], []
    for group in groups:
        dep, detail = deps.get(group), _rolling(deps.get(group))
        if dep is None:
            moving.append(detail)
            continue
        name, found = (dep.get("metadata") or {}).get("name", "?"), failures(dep)
        late = next((f for f in found if f.timed_out), None)
        if late is not None:
            timed_out.append(
                f"{name} ({detail}): {late.message}" if detail else f"{name}: {late.message}"
            )
        elif detail:
            moving.append(f"{name}: {detail}" + _because(found))
    if timed_out:
        return ("False", "ProgressDeadlineExceeded", "; ".join(timed_out + moving))
    if moving:
        return ("True", "RollingOut", "; ".join(moving))
    return ("False", "Complete", "every Deployment is up to date")


def _because(found: list[Failure]) -> str:
    """What a Ready or Progressing message adds for a Deployment whose pods are refused."""
    return "".join(
        f" ({f.reason}: {_truncate(f.message, BRIEF_MAX)})" for f in found if not f.timed_out
    )


def _condition(
    previous: list[dict[str, Any]],
    kind: str,
    status: str,
    reason: str,
    message: str,
    now: str,
    generation: int,
) -> dict[str, Any]:
    before = next((c for c in previous if c.get("type") == kind), None)
    changed = before is None or before.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }


def build_status(
    spec: InferencePoolSpec | None,
    observed: Observed,
    previous: dict[str, Any] | None,
    now: str,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """The whole ``status`` of a pool. ``spec`` is the last valid spec (None if there never
    was one); ``observed.error`` says why the current one is refused."""
    previous = previous or {}
    prev_conditions = previous.get("conditions") or []
    deps = observed.deployments
    # Without a valid spec, the roles are those that run (left as they were).
    if spec is not None:
        roles = list(spec.roles())
    else:
        roles = [r for r in ("prefill", "decode") if deps.get(r) is not None]
    status: dict[str, Any] = {"observedGeneration": observed.generation}
    if spec is not None:
        status["engine"] = engine_status(spec)

    router_dep = deps.get("router")
    for role in ("prefill", "decode"):
        status[role] = role_status(deps.get(role)) if role in roles else None
    if endpoint and (spec is not None or router_dep is not None):
        router = role_status(router_dep)
        status["router"] = {
            "endpoint": endpoint,
            "readyReplicas": router["readyReplicas"],
            "replicas": router["desiredReplicas"],
            **_why(router_dep),
        }

    def cond(kind: str, st: str, reason: str, message: str) -> dict[str, Any]:
        return _condition(prev_conditions, kind, st, reason, message, now, observed.generation)

    # Ready: judged on what runs, whether or not the latest spec was valid.
    missing = []
    router_ready = int(((router_dep or {}).get("status") or {}).get("availableReplicas", 0) or 0)
    if not roles:
        missing.append("no worker Deployment: no valid spec applied yet")
    if router_ready < 1:
        missing.append("router: no available replica" + _because(failures(router_dep)))
    for role in roles:
        if status[role]["readyReplicas"] < 1:
            why = _because(failures(deps.get(role)))
            missing.append(f"{role}: no ready worker ({status[role]['summary']}){why}")
    if missing:
        ready = cond("Ready", "False", "NotReady", "; ".join(missing))
    else:
        ready = cond("Ready", "True", "Serving", "router and every role have ready replicas")

    progressing = cond("Progressing", *_progress(deps, ["router", *roles]))

    # What the cluster refuses to run, refusals first: they are why a rollout times out.
    failed = [f for g in ["router", *roles] for f in failures(deps.get(g))]
    failed.sort(key=lambda f: f.timed_out)
    if observed.error:
        degraded = cond("Degraded", "True", "InvalidSpec", observed.error)
    elif observed.owner_error:
        degraded = cond("Degraded", "True", "AlreadyOwned", observed.owner_error)
    elif observed.apply_error:
        degraded = cond("Degraded", "True", "ApplyFailed", observed.apply_error)
    elif failed:
        message = "; ".join(f"Deployment {f.deployment}: {f.reason}: {f.message}" for f in failed)
        degraded = cond("Degraded", "True", failed[0].condition, message)
    else:
        degraded = cond("Degraded", "False", "Reconciled", "the children match the spec")

    autoscaling = observed.autoscaling or _autoscaling_default(spec)
    slo = observed.slo or (
        ("Unknown", "NoSLO", "the spec sets no SLO")
        if spec is None or spec.slo is None
        else ("Unknown", "NoMetrics", "no latency measured yet")
    )
    status["conditions"] = [
        ready,
        progressing,
        degraded,
        cond("AutoscalingActive", *autoscaling),
        cond("SLOMet", *slo),
        cond(
            "CacheAgreement",
            *(observed.cache or ("Unknown", "NoMetrics", "the routers not scraped yet")),
        ),
    ]
    if degraded["status"] == "True":
        status["phase"] = "Degraded"
    elif ready["status"] == "True":
        status["phase"] = "Ready"
    elif any(deps.get(g) is not None for g in deps):
        status["phase"] = "Progressing"
    else:
        status["phase"] = "Pending"
    if observed.autoscaler is not None:
        status["autoscaler"] = observed.autoscaler
    return status


def engine_status(spec: InferencePoolSpec) -> dict[str, Any]:
    """The engine the workers run and its block size, and what of them the operator chose
    where the spec is silent (``kubectl get kvpool -o wide`` shows the engine)."""
    return {
        "type": spec.engine_type,
        "blockSize": spec.block_size,
        "chosen": spec.engine_choices(),
    }


def _autoscaling_default(spec: InferencePoolSpec | None) -> tuple[str, str, str]:
    if spec is None or not spec.autoscaling.enabled:
        return ("False", "Disabled", "autoscaling.enabled is false: replicas come from the spec")
    if spec.autoscaling.mode == "Advisory":
        return ("False", "Advisory", "recommendations are recorded in status, not applied")
    return ("False", "MetricsUnavailable", "no metrics scraped yet")


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)
