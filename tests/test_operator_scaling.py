"""One autoscaling round (scrape, decide, act, record) over a cluster stand-in and real
/metrics endpoints on loopback."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvpool.api import validate_pool
from kvpool.operator.autoscaler import RoleSignals
from kvpool.operator.handlers import PoolRuntime
from kvpool.operator.scaling import autoscale_step, slo_condition
from kvpool.operator.signals import Signals

SPEC = {
    "model": {"name": "tiny", "source": {"builtin": {}}},
    "decode": {"replicas": 2},
    "slo": {"quantile": 0.9, "itlMilliseconds": 50},
    "autoscaling": {"enabled": True, "decode": {"minReplicas": 1, "maxReplicas": 6}},
}


@contextmanager
def worker_metrics(kv_usage: float, waiting: float) -> Iterator[int]:
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "KV usage", registry=registry).set(kv_usage)
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(waiting)
    body = generate_latest(registry)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


class Cluster:
    """The three calls a round makes, over in-memory Deployments and pods."""

    def __init__(self, replicas: int | None, port: int) -> None:
        self.replicas = replicas
        self.scaled: list[tuple[str, int]] = []
        self.pod = {
            "metadata": {
                "name": "p-decode-a",
                "labels": {"app.kubernetes.io/component": "worker", "kvpool.io/group": "decode"},
                "annotations": {"prometheus.io/port": str(port)},
            },
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }

    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.replicas is None:
            return None
        return {"spec": {"replicas": self.replicas}, "status": {"readyReplicas": self.replicas}}

    def pods(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [self.pod]

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self.scaled.append((name, replicas))
        self.replicas = replicas


# The rounds of one scale-up window (60 s by default): a change needs three proposals or
# more spanning it.
WINDOW = [0.0, 15.0, 30.0, 45.0, 60.0]


def run_rounds(spec: dict[str, Any], cluster: Cluster, times: list[float]) -> PoolRuntime:
    rt = PoolRuntime()
    pool = validate_pool("p", spec)
    for t in times:
        autoscale_step(cluster, "ns", "p", pool, rt, f"T{t:g}", 1.0, clock=lambda t=t: t)
    return rt


def test_active_round_scales_the_deployment_and_records_why() -> None:
    with worker_metrics(kv_usage=0.99, waiting=12) as port:
        cluster = Cluster(2, port)
        rt = run_rounds(SPEC, cluster, WINDOW)
    assert cluster.scaled == [("p-decode", 4)]  # waiting 6/replica: 3x, capped by step +2
    decision = rt.autoscaler_status["decisions"][-1]
    assert (decision["current"], decision["desired"], decision["applied"]) == (2, 4, True)
    assert decision["time"] == "T60"  # once the breach spanned the scale-up window
    assert "waiting" in decision["reason"]
    assert rt.autoscaling[0] == "True"
    assert rt.events == [("Normal", "ScaledUp", f"decode: 2 -> 4 replicas: {decision['reason']}")]


def test_advisory_keeps_advising_and_changes_nothing() -> None:
    spec = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "mode": "Advisory"}}
    with worker_metrics(kv_usage=0.99, waiting=12) as port:
        cluster = Cluster(2, port)
        rt = run_rounds(spec, cluster, [*WINDOW, 75.0])
    assert cluster.scaled == []
    rec = rt.autoscaler_status["recommendation"]["decode"]
    assert (rec["current"], rec["desired"], rec["applied"]) == (2, 4, False)  # no cooldown
    assert len(rt.autoscaler_status["decisions"]) == 1  # the same advice is not news
    assert rt.autoscaling[1] == "Advisory"
    assert [(kind, reason) for kind, reason, _ in rt.events] == [("Normal", "RecommendScaleUp")]
    # advice starts no cooldown, in the state a successor resumes either
    assert "lastChange" not in rt.autoscaler_status["state"]["decode"]


def test_a_round_waits_for_the_deployment_to_exist() -> None:
    with worker_metrics(kv_usage=0.99, waiting=12) as port:
        cluster = Cluster(None, port)
        rt = run_rounds(SPEC, cluster, [0.0])
    assert cluster.scaled == []
    assert rt.autoscaling[1] == "Waiting"
    assert rt.autoscaler_status is None


def test_a_worker_that_does_not_answer_holds_the_role() -> None:
    with worker_metrics(kv_usage=0.99, waiting=12) as port:
        pass  # the server is gone: its port refuses
    cluster = Cluster(2, port)
    rt = run_rounds(SPEC, cluster, [0.0])
    assert cluster.scaled == []
    rec = rt.autoscaler_status["recommendation"]["decode"]
    assert rec["desired"] == 2 and rec["reason"].startswith("hold")
    assert rt.autoscaling[1] == "MetricsUnavailable"


@pytest.mark.parametrize(
    ("itl", "expected"),
    [(0.04, ("True", "Met")), (0.08, ("False", "Missed")), (None, ("Unknown", "NoMetrics"))],
)
def test_slo_condition_compares_the_windowed_quantile_with_the_target(
    itl: float | None, expected: tuple[str, str]
) -> None:
    signals = Signals(time=0, ttft_s=None, itl_s=itl, decode=RoleSignals(1, 1))
    status, reason, message = slo_condition(validate_pool("p", SPEC), signals)
    assert (status, reason) == expected
    if itl is not None:
        assert message.startswith(f"ITL p90 {itl * 1000:.0f}ms")


def test_decisions_are_counted_for_metrics_by_role_label_direction_and_mode() -> None:
    advisory = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "mode": "Advisory"}}
    with worker_metrics(kv_usage=0.99, waiting=12) as port:
        active = run_rounds(SPEC, Cluster(2, port), WINDOW)
        advised = run_rounds(advisory, Cluster(2, port), [*WINDOW, 75.0, 90.0])
    # an aggregated pool: its one role is "both" on the workers' pods, so in the metrics
    assert active.decisions_total == {("both", "up", "Active"): 1, ("both", "down", "Active"): 0}
    assert active.recommended == {"both": 4}
    # the same advice three times is one decision
    assert advised.decisions_total == {
        ("both", "up", "Advisory"): 1,
        ("both", "down", "Advisory"): 0,
    }
