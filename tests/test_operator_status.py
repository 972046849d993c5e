"""A pool's status, computed from what the cluster shows (pure), and the apply helpers."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.api import InferencePoolStatus, validate_pool
from kvpool.operator.cluster import contains, merge_patch
from kvpool.operator.status import Observed, build_status, condition

SPEC = validate_pool(
    "p",
    {
        "model": {"name": "m", "source": {"builtin": {}}},
        "disaggregation": {"mode": "Disaggregated"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "slo": {"ttftMilliseconds": 500},
    },
)
ENDPOINT = "http://p-router.ns.svc"


def deployment(
    name: str, replicas: int, ready: int, updated: int | None = None, generation: int = 1
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": replicas if updated is None else updated,
        },
    }


def all_ready() -> dict[str, Any]:
    return {
        "router": deployment("p-router", 1, 1),
        "prefill": deployment("p-prefill", 1, 1),
        "decode": deployment("p-decode", 2, 2),
    }


def test_ready_when_router_and_every_role_have_a_ready_replica() -> None:
    status = build_status(SPEC, Observed(3, all_ready()), None, "T1", ENDPOINT)
    assert condition(status, "Ready")["status"] == "True"
    assert status["phase"] == "Ready"
    assert status["observedGeneration"] == 3
    assert status["prefill"]["summary"] == "1/1"
    assert status["decode"] == {
        "desiredReplicas": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "summary": "2/2",
    }
    assert status["router"] == {"endpoint": ENDPOINT, "readyReplicas": 1, "replicas": 1}
    assert condition(status, "Progressing")["status"] == "False"


@pytest.mark.parametrize("missing", ["router", "prefill", "decode"])
def test_not_ready_names_what_has_no_ready_replica(missing: str) -> None:
    deps = all_ready()
    deps[missing] = deployment(f"p-{missing}", 1, 0)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    ready = condition(status, "Ready")
    assert ready["status"] == "False"
    assert missing in ready["message"]
    assert status["phase"] == "Progressing"


def test_a_rollout_in_progress_is_progressing_and_says_where() -> None:
    deps = all_ready()
    deps["decode"] = deployment("p-decode", 2, 2, updated=1)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    progressing = condition(status, "Progressing")
    assert progressing["status"] == "True"
    assert progressing["message"] == "p-decode: 1/2 updated"
    assert condition(status, "Ready")["status"] == "True"  # still serving meanwhile


def test_an_invalid_spec_is_degraded_and_ready_still_reports_what_runs() -> None:
    observed = Observed(4, all_ready(), error="spec.decode.replicas: must be >= 0")
    status = build_status(None, observed, None, "T1")
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"] == "spec.decode.replicas: must be >= 0"
    assert status["phase"] == "Degraded"
    assert status["observedGeneration"] == 4
    assert condition(status, "Ready")["status"] == "True"  # the old children still serve
    assert status["decode"]["summary"] == "2/2"


def test_a_refused_child_is_degraded_with_the_servers_message() -> None:
    observed = Observed(1, all_ready(), apply_error="Deployment p-decode: 422 invalid image")
    status = build_status(SPEC, observed, None, "T1", ENDPOINT)
    assert condition(status, "Degraded")["reason"] == "ApplyFailed"
    assert "422 invalid image" in condition(status, "Degraded")["message"]


def test_transition_time_moves_only_when_a_condition_changes_status() -> None:
    first = build_status(SPEC, Observed(1, all_ready()), None, "T1", ENDPOINT)
    same = build_status(SPEC, Observed(2, all_ready()), first, "T2", ENDPOINT)
    assert condition(same, "Ready")["lastTransitionTime"] == "T1"
    assert condition(same, "Ready")["observedGeneration"] == 2
    deps = all_ready()
    deps["decode"] = deployment("p-decode", 2, 0)
    changed = build_status(SPEC, Observed(3, deps), same, "T3", ENDPOINT)
    assert condition(changed, "Ready")["lastTransitionTime"] == "T3"


def test_cache_agreement_is_unknown_until_a_router_judges_and_then_names_flagged_workers() -> None:
    from kvpool.operator.scaling import cache_condition

    status = build_status(SPEC, Observed(1, all_ready()), None, "T1", ENDPOINT)
    assert condition(status, "CacheAgreement")["status"] == "Unknown"
    assert cache_condition([("r-0", None), ("r-1", "garbage {")])[1] == "NoMetrics"
    page = (
        "# TYPE kvpool_router_worker_cache_flagged gauge\n"
        'kvpool_router_worker_cache_flagged{worker="a",cause=""} 0\n'
        'kvpool_router_worker_cache_flagged{worker="b",cause="over-predicted"} 1\n'
    )
    flagged = cache_condition([("r-0", page)])
    status = build_status(SPEC, Observed(1, all_ready(), cache=flagged), status, "T2", ENDPOINT)
    cond = condition(status, "CacheAgreement")
    assert (cond["status"], cond["reason"]) == ("False", "Disagree")
    assert "b (over-predicted)" in cond["message"] and "a (" not in cond["message"]
    assert status["phase"] == "Ready"  # it serves, without cache credit for b


def test_autoscaling_and_slo_conditions_default_to_what_the_spec_says() -> None:
    status = build_status(SPEC, Observed(1, all_ready()), None, "T1", ENDPOINT)
    assert condition(status, "AutoscalingActive")["reason"] == "Disabled"
    assert condition(status, "SLOMet")["status"] == "Unknown"
    assert condition(status, "SLOMet")["reason"] == "NoMetrics"
    measured = Observed(
        1, all_ready(), slo=("False", "Missed", "TTFT p90 800ms > 500ms"),
        autoscaling=("True", "Active", "replicas of prefill, decode are set by the autoscaler"),
    )  # fmt: skip
    status = build_status(SPEC, measured, None, "T1", ENDPOINT)
    assert condition(status, "SLOMet")["message"] == "TTFT p90 800ms > 500ms"
    assert condition(status, "AutoscalingActive")["status"] == "True"


def test_nothing_created_yet_is_pending() -> None:
    status = build_status(SPEC, Observed(1, {}), None, "T1", ENDPOINT)
    assert status["phase"] == "Pending"
    assert condition(status, "Ready")["status"] == "False"


# --- why pods do not come up: the Deployments' own conditions ----------------------------
# Shaped as the deployment controller writes them: ReplicaFailure is the ReplicaSet's, copied
# with the API server's refusal as its message; Progressing turns False with
# ProgressDeadlineExceeded after spec.progressDeadlineSeconds without progress.

POD_SECURITY = (
    'pods "p-decode-7d9f8b6c5-" is forbidden: violates PodSecurity "restricted:latest": '
    'allowPrivilegeEscalation != false (container "worker" must set '
    "securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container "
    '"worker" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot != true (pod '
    'or container "worker" must set securityContext.runAsNonRoot=true), seccompProfile (pod or '
    'container "worker" must set securityContext.seccompProfile.type to "RuntimeDefault" or '
    '"Localhost")'
)
QUOTA = (
    'pods "p-router-5c9d7f6b8-" is forbidden: exceeded quota: compute-resources, '
    "requested: limits.cpu=2, used: limits.cpu=8, limited: limits.cpu=8"
)


def k8s_condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
    at = "2025-05-01T12:00:00Z"
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": at, "lastTransitionTime": at}  # fmt: skip


def failing(
    name: str,
    replicas: int,
    ready: int = 0,
    refused: str | None = None,
    timed_out: bool = False,
    generation: int = 1,
    observed: int = 1,
) -> dict[str, Any]:
    """A Deployment whose pods do not all come up: refused ones are never created."""
    rs = f'ReplicaSet "{name}-7d9f8b6c5"'
    dep = deployment(name, replicas, ready, generation=generation)
    created = ready if refused else replicas
    dep["status"] |= {
        "observedGeneration": observed,
        "replicas": created,
        "updatedReplicas": created,
        "unavailableReplicas": replicas - ready,
    }
    conditions = [
        k8s_condition(
            "Available",
            "False",
            "MinimumReplicasUnavailable",
            "Deployment does not have minimum availability.",
        ),
        k8s_condition(
            "Progressing", "False", "ProgressDeadlineExceeded", f"{rs} has timed out progressing."
        )
        if timed_out
        else k8s_condition("Progressing", "True", "ReplicaSetUpdated", f"{rs} is progressing."),
    ]
    if refused:
        conditions.append(k8s_condition("ReplicaFailure", "True", "FailedCreate", refused))
    dep["status"]["conditions"] = conditions
    return dep


def healthy(dep: dict[str, Any]) -> dict[str, Any]:
    name = dep["metadata"]["name"]
    dep["status"]["conditions"] = [
        k8s_condition(
            "Available", "True", "MinimumReplicasAvailable", "Deployment has minimum availability."
        ),
        k8s_condition(
            "Progressing",
            "True",
            "NewReplicaSetAvailable",
            f'ReplicaSet "{name}-7d9f8b6c5" has successfully progressed.',
        ),
    ]
    return dep


def test_pods_refused_by_pod_security_degrade_the_pool_and_say_why_everywhere() -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, refused=POD_SECURITY)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReplicaFailure")
    assert degraded["message"] == f"Deployment p-decode: FailedCreate: {POD_SECURITY}"
    assert status["phase"] == "Degraded"
    assert status["decode"]["reason"] == "FailedCreate"
    assert status["decode"]["message"] == POD_SECURITY
    assert status["decode"]["summary"] == "0/2"
    ready = condition(status, "Ready")
    assert ready["status"] == "False"
    assert ready["message"].startswith(
        'decode: no ready worker (0/2) (FailedCreate: pods "p-decode-7d9f8b6c5-" is forbidden: '
        'violates PodSecurity "restricted:latest"'
    )
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert progressing["message"].startswith("p-decode: 0/2 updated (FailedCreate: pods ")
    assert "reason" not in status["prefill"] and "message" not in status["prefill"]


def test_router_pods_refused_by_a_quota_are_named_in_ready_and_the_router_status() -> None:
    deps = all_ready()
    deps["router"] = failing("p-router", 1, refused=QUOTA)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    assert (
        condition(status, "Ready")["message"]
        == f"router: no available replica (FailedCreate: {QUOTA})"
    )
    assert condition(status, "Degraded")["message"] == f"Deployment p-router: FailedCreate: {QUOTA}"
    assert status["router"] == {
        "endpoint": ENDPOINT, "readyReplicas": 0, "replicas": 1,
        "reason": "FailedCreate", "message": QUOTA,
    }  # fmt: skip


def test_a_refused_surge_pod_degrades_a_pool_that_still_serves() -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, ready=1, refused=QUOTA.replace("router", "decode"))
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Degraded")["reason"] == "ReplicaFailure"
    assert status["decode"]["reason"] == "FailedCreate"


@pytest.mark.parametrize("ready", [0, 1])
def test_a_rollout_past_its_deadline_has_failed_and_ready_follows_the_counts(ready: int) -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, ready=ready, timed_out=True)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert progressing["message"] == (
        f'p-decode ({ready}/2 ready): ReplicaSet "p-decode-7d9f8b6c5" has timed out progressing.'
    )
    assert condition(status, "Ready")["status"] == ("True" if ready else "False")
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ProgressDeadlineExceeded")
    assert "Deployment p-decode: ProgressDeadlineExceeded: " in degraded["message"]
    assert status["decode"]["reason"] == "ProgressDeadlineExceeded"
    assert status["phase"] == "Degraded"


def test_refused_pods_are_the_cause_named_first_when_the_rollout_times_out() -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, refused=POD_SECURITY, timed_out=True)
    deps["prefill"] = deployment("p-prefill", 1, 1, updated=0)  # still rolling: listed after
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    progressing = condition(status, "Progressing")
    assert progressing["reason"] == "ProgressDeadlineExceeded"
    assert progressing["message"] == (
        'p-decode (0/2 updated): ReplicaSet "p-decode-7d9f8b6c5" has timed out progressing.'
        "; p-prefill: 0/1 updated"
    )
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "ReplicaFailure"
    assert degraded["message"].startswith(f"Deployment p-decode: FailedCreate: {POD_SECURITY}; ")
    assert status["decode"]["reason"] == "FailedCreate"


def test_failures_from_before_a_change_its_controller_has_not_seen_are_not_reported() -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, timed_out=True, generation=2, observed=1)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    progressing = condition(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert progressing["message"] == "p-decode: change not yet seen by its controller"
    assert condition(status, "Degraded")["status"] == "False"
    assert "reason" not in status["decode"]


def test_a_healthy_deployments_conditions_change_nothing() -> None:
    plain = build_status(SPEC, Observed(1, all_ready()), None, "T1", ENDPOINT)
    deps = {group: healthy(dep) for group, dep in all_ready().items()}
    assert build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT) == plain
    assert condition(plain, "Degraded")["reason"] == "Reconciled"


def test_a_long_refusal_is_truncated_whole_in_degraded_briefly_elsewhere() -> None:
    webhook = 'admission webhook "policy.example.com" denied the request: ' + "x" * 5000
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, refused=webhook)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    message = status["decode"]["message"]
    assert len(message) == 1024 and message.endswith("…") and webhook.startswith(message[:-1])
    assert (
        condition(status, "Degraded")["message"] == f"Deployment p-decode: FailedCreate: {message}"
    )
    for kind in ("Ready", "Progressing"):
        assert webhook[:150] in condition(status, kind)["message"]
        assert len(condition(status, kind)["message"]) < 300


def test_failure_transitions_move_only_with_status_and_clear_with_the_failure() -> None:
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2)  # pods created, not ready yet
    first = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    deps["decode"] = failing("p-decode", 2, refused=POD_SECURITY)
    refused = build_status(SPEC, Observed(1, deps), first, "T2", ENDPOINT)
    assert condition(refused, "Degraded")["lastTransitionTime"] == "T2"
    assert condition(refused, "Progressing")["lastTransitionTime"] == "T1"  # still True
    deps["decode"] = failing("p-decode", 2, refused=POD_SECURITY, timed_out=True)
    late = build_status(SPEC, Observed(1, deps), refused, "T3", ENDPOINT)
    assert condition(late, "Degraded")["lastTransitionTime"] == "T2"
    assert condition(late, "Progressing")["lastTransitionTime"] == "T3"  # True -> False
    fixed = build_status(SPEC, Observed(1, all_ready()), late, "T4", ENDPOINT)
    assert condition(fixed, "Degraded")["status"] == "False"
    assert condition(fixed, "Degraded")["lastTransitionTime"] == "T4"
    assert condition(fixed, "Progressing")["reason"] == "Complete"
    assert "message" not in fixed["decode"]  # so the status patch deletes it


def test_the_crd_keeps_why_a_role_and_the_router_fail() -> None:
    """The API server prunes what the status schema lacks (and each sync would write it again)."""
    deps = all_ready()
    deps["decode"] = failing("p-decode", 2, refused=POD_SECURITY)
    deps["router"] = failing("p-router", 1, refused=QUOTA)
    status = build_status(SPEC, Observed(1, deps), None, "T1", ENDPOINT)
    kept = InferencePoolStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True)
    assert kept["decode"] == status["decode"]
    assert kept["router"] == status["router"]


# --- apply helpers --------------------------------------------------------------------------


def test_contains_ignores_server_defaults_but_not_changed_values() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"port": 80}]}}
    live = {"spec": {"replicas": 2, "ports": [{"port": 80, "protocol": "TCP"}], "x": 1}}
    assert contains(live, desired)
    assert not contains({"spec": {"replicas": 3, "ports": [{"port": 80}]}}, desired)
    assert not contains({"spec": {"replicas": 2, "ports": []}}, desired)
    assert contains({"port": "8000"}, {"port": 8000})  # the same port, as text or number
    assert not contains({"flag": 1}, {"flag": True})


def test_merge_patch_deletes_what_the_last_applied_version_had_and_this_one_drops() -> None:
    last = {"spec": {"nodeSelector": {"gpu": "h100"}, "replicas": 2}, "metadata": {"a": 1}}
    desired = {"spec": {"replicas": 3}, "metadata": {"a": 1}}
    assert merge_patch(last, desired) == {
        "spec": {"replicas": 3, "nodeSelector": None},
        "metadata": {"a": 1},
    }
    assert merge_patch({}, desired) == desired
