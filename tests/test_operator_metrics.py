"""The operator's /metrics: the series made from its memory at each scrape, and the real
endpoint of an operator running against kmock's emulator."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.api import validate_pool
from kvpool.operator import handlers, metrics
from kvpool.operator.handlers import PoolRuntime

import test_operator_kopf as kopf_tests
from test_operator_kopf import AUTOSCALED, NS, POOL_SPEC, Kube, add_worker_pod, eventually

kube = kopf_tests.kube  # the operator, run by KopfRunner against the emulator (a fixture)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and each family's type, from exposition text."""
    found: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            found[(s.name, frozenset(s.labels.items()))] = s.value
    return found, types


def series(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def names(found: Samples) -> set[str]:
    return {name for name, _ in found}


def scrape(view: metrics.OperatorView) -> tuple[Samples, dict[str, str]]:
    registry = metrics.make_registry(lambda: view)
    return samples(generate_latest(registry).decode())


POOL = metrics.PoolView(
    namespace="llm",
    name="chat",
    phase="Ready",
    roles=(metrics.RoleView("prefill", 2, 1), metrics.RoleView("decode", 4, 4)),
    recommended={"decode": 5},
    decisions={("decode", "up", "Active"): 3, ("decode", "down", "Active"): 0},
    slo_targets={"ttft": 0.5, "itl": 0.05},
    slo_quantile=0.95,
    latency={"itl": 0.042},
)


def test_the_collector_makes_each_pool_series_from_the_view() -> None:
    found, types = scrape(metrics.OperatorView(active=True, pools=(POOL,)))
    pool = {"namespace": "llm", "pool": "chat"}
    assert series(found, "kvpool_operator_active") == 1
    assert series(found, "kvpool_operator_desired_replicas", **pool, role="prefill") == 2
    assert series(found, "kvpool_operator_desired_replicas", **pool, role="decode") == 4
    assert series(found, "kvpool_operator_ready_replicas", **pool, role="prefill") == 1
    assert series(found, "kvpool_operator_ready_replicas", **pool, role="decode") == 4
    assert series(found, "kvpool_operator_recommended_replicas", **pool, role="decode") == 5
    assert series(found, "kvpool_operator_recommended_replicas", **pool, role="prefill") is None
    decision = "kvpool_operator_scaling_decisions_total"
    assert series(found, decision, **pool, role="decode", direction="up", mode="Active") == 3
    assert series(found, decision, **pool, role="decode", direction="down", mode="Active") == 0
    assert series(found, "kvpool_operator_slo_target_seconds", **pool, metric="ttft") == 0.5
    assert series(found, "kvpool_operator_slo_target_seconds", **pool, metric="itl") == 0.05
    assert series(found, "kvpool_operator_slo_quantile", **pool) == 0.95
    assert series(found, "kvpool_operator_observed_latency_seconds", **pool, metric="itl") == 0.042
    assert series(found, "kvpool_operator_observed_latency_seconds", **pool, metric="ttft") is None
    phases = {p: series(found, "kvpool_operator_pool_phase", **pool, phase=p) for p in
              ("Pending", "Progressing", "Ready", "Degraded")}  # fmt: skip
    assert phases == {"Pending": 0, "Progressing": 0, "Ready": 1, "Degraded": 0}
    for result in ("ok", "invalid", "error"):  # there before the first reconcile
        assert series(found, "kvpool_operator_reconciles_total", result=result) is not None
    assert "kvpool_operator_reconcile_duration_seconds_count" in names(found)
    assert types["kvpool_operator_scaling_decisions"] == "counter"
    assert types["kvpool_operator_reconciles"] == "counter"
    assert types["kvpool_operator_reconcile_duration_seconds"] == "histogram"
    assert types["kvpool_operator_desired_replicas"] == "gauge"


def test_a_paused_replica_shows_only_that_it_is_paused() -> None:
    found, _ = scrape(metrics.OperatorView(active=False))
    assert series(found, "kvpool_operator_active") == 0
    assert not any(n.startswith("kvpool_operator_desired") for n in names(found))


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, str], PoolRuntime]:
    """The handlers' memory of pools, empty, in a standalone (active) operator."""
    state: dict[tuple[str, str], PoolRuntime] = {}
    monkeypatch.setattr(handlers, "_pools", state)
    monkeypatch.setattr(handlers, "_due", {})
    monkeypatch.setattr(handlers, "LEADER", None)
    monkeypatch.setattr(handlers, "_active", True)
    return state


def test_the_handlers_state_becomes_series_and_a_deleted_pool_leaves_none(
    pools: dict[tuple[str, str], PoolRuntime],
) -> None:
    spec = validate_pool("agg", AUTOSCALED)  # aggregated: one role, labelled "both"
    rt = handlers.runtime("llm", "agg")
    handlers._record_for_metrics(
        rt,
        spec,
        {"decode": {"spec": {"replicas": 3}, "status": {"readyReplicas": 2}}},
        {"phase": "Progressing"},
    )
    handlers.pool_seen(event={"type": "ADDED"}, namespace="llm", name="other")
    found, _ = scrape(handlers.metrics_snapshot())
    agg = {"namespace": "llm", "pool": "agg"}
    assert series(found, "kvpool_operator_desired_replicas", **agg, role="both") == 3
    assert series(found, "kvpool_operator_ready_replicas", **agg, role="both") == 2
    assert series(found, "kvpool_operator_slo_target_seconds", **agg, metric="itl") == 0.05
    assert series(found, "kvpool_operator_slo_quantile", **agg) == 0.9
    decision = "kvpool_operator_scaling_decisions_total"
    for direction in ("up", "down"):  # ready for rate() before any decision
        labels = {**agg, "role": "both", "direction": direction, "mode": "Active"}
        assert series(found, decision, **labels) == 0
    assert series(found, "kvpool_operator_pool_phase", **agg, phase="Progressing") == 1

    handlers.pool_seen(event={"type": "DELETED"}, namespace="llm", name="agg")
    found, _ = scrape(handlers.metrics_snapshot())
    assert not [key for key in found if ("pool", "agg") in key[1]]


# --- the endpoint of a running operator -----------------------------------------------------


async def scrape_operator() -> Samples:
    port = handlers.metrics_port()
    assert port is not None, "the operator serves no /metrics"
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert r.status_code == 200
    return samples(r.text)[0]


@pytest.mark.slow
async def test_the_running_operator_shows_replicas_slo_and_decisions(kube: Kube) -> None:
    tiny = {"namespace": NS, "pool": "tiny"}
    spec = {**POOL_SPEC, "slo": {"ttftMilliseconds": 800}}
    await kube.create_pool("tiny", spec)
    await eventually(lambda: kopf_tests.all_children_exist(kube, "tiny", spec), "every child")
    await kube.become_ready("tiny-decode", 2)

    async def replicas_shown() -> Samples | None:
        found = await scrape_operator()
        wanted = {
            ("kvpool_operator_desired_replicas", "prefill"): 1,
            ("kvpool_operator_desired_replicas", "decode"): 2,
            ("kvpool_operator_ready_replicas", "prefill"): 0,
            ("kvpool_operator_ready_replicas", "decode"): 2,
        }
        shown = {key: series(found, key[0], **tiny, role=key[1]) for key in wanted}
        return found if shown == wanted else None

    found = await eventually(replicas_shown, "desired and ready replicas per role")
    assert series(found, "kvpool_operator_active") == 1
    assert series(found, "kvpool_operator_slo_target_seconds", **tiny, metric="ttft") == 0.8
    assert series(found, "kvpool_operator_slo_quantile", **tiny) == 0.9
    assert series(found, "kvpool_operator_reconciles_total", result="ok") >= 1

    auto = {"namespace": NS, "pool": "auto", "role": "both", "mode": "Active"}
    decision = "kvpool_operator_scaling_decisions_total"
    with kopf_tests.metrics_server(kv_usage=0.99, waiting=12) as port:
        await kube.create_pool("auto", AUTOSCALED)
        await eventually(lambda: kube.child("Deployment", "auto-decode"), "the decode Deployment")

        async def precreated() -> Samples | None:
            found = await scrape_operator()
            return found if series(found, decision, **auto, direction="up") == 0 else None

        found = await eventually(precreated, "the decision counters at 0")
        assert series(found, decision, **auto, direction="down") == 0
        await kube.become_ready("auto-decode", 2)
        await add_worker_pod(kube, "auto", "decode", "auto-decode-a", port)

        async def counted() -> Samples | None:
            found = await scrape_operator()
            return found if (series(found, decision, **auto, direction="up") or 0) >= 1 else None

        found = await eventually(counted, "a scale-up counted", timeout=20)
    dep = await kube.child("Deployment", "auto-decode")
    assert dep is not None and dep["spec"]["replicas"] > 2
    role = {"namespace": NS, "pool": "auto", "role": "both"}
    assert series(found, decision, **auto, direction="down") == 0
    assert series(found, "kvpool_operator_recommended_replicas", **role) == dep["spec"]["replicas"]

    async def desired_follows() -> bool:
        shown = series(await scrape_operator(), "kvpool_operator_desired_replicas", **role)
        return shown == dep["spec"]["replicas"]

    await eventually(desired_follows, "desired replicas to follow the autoscaler")

    r = await kube.http.delete(f"{kopf_tests.API}/namespaces/{NS}/inferencepools/tiny")
    assert r.status_code == 200, r.text

    async def gone() -> bool:
        found = await scrape_operator()
        return not [key for key in found if ("pool", "tiny") in key[1]]

    await eventually(gone, "the deleted pool's series gone")
