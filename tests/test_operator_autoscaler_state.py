"""The autoscaler's memory in the pool's status: an operator that restarts, or a replica
that takes over, resumes the stabilisation windows, the cooldown and the last decisions
from ``status.autoscaler`` instead of starting blind, and survives whatever it finds there.

Rounds run over a cluster stand-in and real /metrics endpoints on loopback (as in
``test_operator_scaling``), in simulated time; the status passes through the API's status
model and JSON between leaders, as it would through the API server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import test_operator_scaling as scaling_tests
from hypothesis import given, settings
from hypothesis import strategies as st
from test_operator_autoscaler import policies, role_signals

from kvpool.api import validate_pool
from kvpool.api.inferencepool import MAX_SCALING_PROPOSALS, AutoscalerStatus
from kvpool.operator.autoscaler import (
    MAX_PROPOSALS,
    AutoscalerState,
    RoleHistory,
    ScalingPolicy,
    Signals,
    decide,
)
from kvpool.operator.scaling import autoscale_step, policy_from_spec, restore, state_to_status

SPEC = scaling_tests.SPEC  # decode 2 replicas, bounds 1..6, default windows 60 s up, 300 down
Cluster = scaling_tests.Cluster
BREACH = {"kv_usage": 0.99, "waiting": 12}  # wants 6 replicas, 4 with the step limit
CALM = {"kv_usage": 0.3, "waiting": 0}  # wants 1


@dataclass
class Runtime:
    """The attributes of the operator's per-pool runtime record that a round uses."""

    scaler: Any = None
    events: list[tuple[str, str, str]] = field(default_factory=list)
    autoscaler_status: dict[str, Any] | None = None
    autoscaling: tuple[str, str, str] | None = None
    slo: tuple[str, str, str] | None = None
    latency: dict[str, float] = field(default_factory=dict)
    recommended: dict[str, int] = field(default_factory=dict)
    decisions_total: dict[tuple[str, str, str], int] = field(default_factory=dict)


def through_api(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.autoscaler as the next leader reads it: what the schema keeps, as JSON."""
    if status is None:
        return None
    kept = AutoscalerStatus.model_validate(status).model_dump(by_alias=True, exclude_none=True)
    return json.loads(json.dumps(kept))


class Leader:
    """One operator process: its runtime record, resuming from a predecessor's status."""

    def __init__(self, spec: dict[str, Any], status: dict[str, Any] | None = None) -> None:
        self.spec = validate_pool("p", spec)
        self.rt = Runtime()
        self.status = status

    def round(self, cluster: Cluster, t: float) -> dict[str, Any]:
        autoscale_step(cluster, "ns", "p", self.spec, self.rt, f"T{t:g}", 1.0,
                       clock=lambda: t, status=self.status)  # fmt: skip
        self.status = through_api(self.rt.autoscaler_status)  # sync writes it
        return self.rt.autoscaler_status["recommendation"]["decode"]


def rounds(leader: Leader, cluster: Cluster, metrics: dict[str, float], times: list[float]):
    with scaling_tests.worker_metrics(**metrics) as port:
        cluster.pod["metadata"]["annotations"]["prometheus.io/port"] = str(port)
        return [leader.round(cluster, t) for t in times]


def test_a_successor_resumes_the_scale_up_window_mid_way() -> None:
    cluster = Cluster(2, 0)
    old = Leader(SPEC)
    rounds(old, cluster, BREACH, [0.0, 15.0, 30.0])
    assert cluster.scaled == []
    new = Leader(SPEC, old.status)  # the old one is gone; a fresh process takes over
    recs = rounds(new, cluster, BREACH, [45.0, 60.0])
    assert recs[0]["desired"] == 2  # 45 s of breach: not yet
    assert cluster.scaled == [("p-decode", 4)]  # at 60 s, on evidence from both
    assert recs[1]["time"] == "T60"
    # without the status the successor would have started the window again
    blind = Leader(SPEC)
    recs = rounds(blind, Cluster(2, 0), BREACH, [45.0, 60.0])
    assert [r["desired"] for r in recs] == [2, 2]


def test_a_successor_does_not_scale_on_a_single_sample() -> None:
    cluster = Cluster(2, 0)
    old = Leader(SPEC)
    rounds(old, cluster, CALM, [0.0, 15.0, 30.0, 45.0])
    new = Leader(SPEC, old.status)
    rec = rounds(new, cluster, BREACH, [60.0])[0]
    assert cluster.scaled == []
    assert rec["desired"] == 2
    # the calm proposals the old leader saw are in the window: one breach is not sustained
    assert rec["reason"].startswith("hold: scale-up to 6 not yet sustained for 60s")
    assert new.rt.autoscaler_status["state"]["decode"]["since"] == 0  # one run, resumed


def test_the_cooldown_and_decisions_survive_a_fail_over() -> None:
    cluster = Cluster(2, 0)
    old = Leader(SPEC)
    rounds(old, cluster, BREACH, [0.0, 15.0, 30.0, 45.0, 60.0])
    assert cluster.scaled == [("p-decode", 4)]
    assert old.status["state"]["decode"]["lastChange"] == 60
    new = Leader(SPEC, old.status)
    recs = rounds(new, cluster, BREACH, [75.0, 90.0, 105.0, 120.0])
    assert all("cooldown, last change" in r["reason"] for r in recs[:3])
    assert cluster.scaled == [("p-decode", 4), ("p-decode", 6)]  # one cooldown later
    decisions = new.rt.autoscaler_status["decisions"]
    assert [(d["time"], d["current"], d["desired"]) for d in decisions] == [
        ("T60", 2, 4),
        ("T120", 4, 6),
    ]


def test_advisory_advice_given_before_a_fail_over_is_not_news_after_it() -> None:
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "mode": "Advisory"}}
    cluster = Cluster(2, 0)
    old = Leader(spec)
    rounds(old, cluster, BREACH, [0.0, 15.0, 30.0, 45.0, 60.0])
    assert [reason for _, reason, _ in old.rt.events] == ["RecommendScaleUp"]
    new = Leader(spec, old.status)
    recs = rounds(new, cluster, BREACH, [75.0, 90.0])
    assert [(r["desired"], r["applied"]) for r in recs] == [(4, False), (4, False)]
    assert cluster.scaled == []
    assert new.rt.events == []
    assert len(new.rt.autoscaler_status["decisions"]) == 1


@pytest.mark.parametrize(
    "autoscaling",
    [
        {"mode": "External"},
        {"externalRoles": ["decode"]},
    ],
)
def test_a_role_an_hpa_owns_is_advised_on_never_scaled(autoscaling: dict[str, Any]) -> None:
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], **autoscaling}}
    cluster = Cluster(2, 0)
    leader = Leader(spec)
    recs = rounds(leader, cluster, BREACH, [0.0, 15.0, 30.0, 45.0, 60.0, 75.0])
    assert cluster.scaled == []
    assert [(r["desired"], r["applied"]) for r in recs[-2:]] == [(4, False), (4, False)]
    assert [reason for _, reason, _ in leader.rt.events] == ["RecommendScaleUp"]
    assert leader.rt.autoscaling[:2] == ("False", "External")
    assert "lastChange" not in leader.status["state"]["decode"]  # no cooldown: not changed


GARBAGE: list[Any] = [
    None,
    "state",
    [],
    {"state": "x"},
    {"state": {"decode": "x"}},
    {"state": {"decode": {"proposals": "x", "since": 0}}},
    {"state": {"decode": {"proposals": [[1]], "since": 0}}},
    {"state": {"decode": {"proposals": [["a", 2]], "since": 0}}},
    {"state": {"decode": {"proposals": [[1, True]], "since": 0}}},
    {"state": {"decode": {"proposals": [[1, -1]], "since": 0}}},
    {"state": {"decode": {"proposals": [[1, 2.5]], "since": 0}}},
    {"state": {"decode": {"proposals": [[1, "2"]], "since": 0}}},
    {"state": {"decode": {"proposals": [[2, 1], [1, 1]], "since": 0}}},  # out of order
    {"state": {"decode": {"proposals": [[1, 1]], "since": 5}}},  # before the run began
    {"state": {"decode": {"proposals": [[1, 1]]}}},  # no start
    {"state": {"decode": {"proposals": [[10**400, 1]], "since": 0}}},
    {"state": {"decode": {"proposals": [[float("nan"), 1]], "since": 0}}},
    {"state": {"decode": {"proposals": [[1, 1]] * (MAX_PROPOSALS + 1), "since": 0}}},
    {"state": {"decode": {"lastChange": "yesterday", "since": True}}},
    {"decisions": "x"},
    {"decisions": [{"time": 1}, "x", None, {"role": "decode", "current": True}]},
]


@pytest.mark.parametrize("saved", GARBAGE)
def test_restore_starts_empty_from_garbage(saved: Any) -> None:
    policy = policy_from_spec(validate_pool("p", SPEC))
    state, decisions = restore(saved, policy, 100.0)
    assert state == AutoscalerState()
    assert decisions == []


def test_a_round_survives_a_garbage_status_and_overwrites_it() -> None:
    cluster = Cluster(2, 0)
    leader = Leader(SPEC, {"state": {"decode": {"proposals": [[1, "x"]]}}, "decisions": 7})
    rec = rounds(leader, cluster, BREACH, [100.0])[0]
    assert rec["desired"] == 2
    assert leader.status["state"] == {"decode": {"proposals": [[100, 6]], "since": 100}}


def test_restore_drops_what_lies_outside_the_windows() -> None:
    decision = {"role": "decode", "current": 1, "desired": 2, "reason": "r", "applied": True}
    policy = policy_from_spec(validate_pool("p", SPEC))  # longest window 300 s
    saved = {
        "state": {
            "decode": {
                "since": 0,
                "lastChange": 5000,  # a clock ahead of ours: the cooldown counts from now
                "proposals": [[0, 3], [100, 2], [500, 4], [1001, 5]],  # 1001: ahead of now
            },
            "prefill": {"since": 0, "proposals": [[900, 1]]},  # not a role of this pool
        },
        "decisions": [dict(decision, time=f"T{i}", extra=1) for i in range(7)],
    }
    state, decisions = restore(saved, policy, 1000.0)
    # nothing inside the 300 s window: the run starts afresh; the cooldown is kept
    assert state.roles == {"decode": RoleHistory((), None, 1000.0)}
    assert [d["time"] for d in decisions] == ["T2", "T3", "T4", "T5", "T6"]
    assert "extra" not in decisions[0]
    saved["state"]["decode"]["proposals"] = [[0, 3], [750, 2], [900, 4]]
    state, _ = restore(saved, policy, 1000.0)
    assert state.roles["decode"] == RoleHistory(((750.0, 2), (900.0, 4)), 0.0, 1000.0)


def test_the_state_in_status_is_bounded_by_the_schema() -> None:
    assert MAX_SCALING_PROPOSALS == MAX_PROPOSALS
    state = AutoscalerState({"decode": RoleHistory(tuple((float(t), t) for t in range(64)), 0.0)})
    status = {"state": state_to_status(state)}
    assert through_api(status)["state"]["decode"]["proposals"][-1] == [63, 63]


# -- a fail-over changes no decision ------------------------------------------------------


@settings(max_examples=150, deadline=None, report_multiple_bugs=False)
@given(
    policy=policies(),
    gap=st.sampled_from([None, 30.0]),
    steps=st.lists(
        st.tuples(
            st.sampled_from([1, 15, 15, 15, 60, 400]),
            st.none() | st.floats(0, 20, allow_nan=False),
            role_signals(),
            role_signals(),
        ),
        min_size=2,
        max_size=40,
    ),
    data=st.data(),
)
def test_a_fail_over_at_any_round_changes_no_decision(
    policy: ScalingPolicy, gap: float | None, steps: list, data: st.DataObject
) -> None:
    policy = replace(policy, max_gap_s=gap)
    fail_over = data.draw(st.integers(1, len(steps) - 1))
    t = 0
    signals = []
    for dt, ttft, decode, prefill in steps:
        t += dt
        signals.append(Signals(float(t), ttft, None, decode=decode, prefill=prefill))

    def run(handover: int | None) -> list[Any]:
        state, recs = AutoscalerState(), []
        for i, s in enumerate(signals):
            if i == handover:
                saved = through_api({"state": state_to_status(state)})
                state, _ = restore(saved, policy, s.time)
            r, state = decide(policy, s, state)
            recs.append(r)
        return recs

    assert run(fail_over) == run(None)
