"""A pool's status, computed from what the cluster shows (pure), and the apply helpers."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.api import validate_pool
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
