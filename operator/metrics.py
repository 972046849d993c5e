"""The operator's own Prometheus metrics, served on ``/metrics``.

The pool series are made at scrape time from the operator's memory (:class:`OperatorView`,
taken by the handlers), not kept in labelled gauges: a deleted pool's series go with it,
and nothing is left behind for a pool another replica now runs. The reconcile counter and
histogram are ordinary prometheus-client metrics.

Labels: ``namespace`` and ``pool`` are the InferencePool's (the chart scrapes with
``honor_labels``), ``role`` is the workers' ``kvpool.io/role`` value (``prefill``,
``decode``, or ``both`` for an aggregated pool's one role), so one ``$role`` filters the
workers' series and these alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PHASES = ("Pending", "Progressing", "Ready", "Degraded")
DIRECTIONS = ("up", "down")
RESULTS = ("ok", "invalid", "error")

RECONCILES = Counter(
    "kvpool_operator_reconciles",
    "Reconciles of a pool (ok; invalid: the spec was refused; error: applying failed)",
    ["result"],
    registry=None,
)
for _result in RESULTS:
    RECONCILES.labels(_result)
RECONCILE_DURATION = Histogram(
    "kvpool_operator_reconcile_duration_seconds",
    "Time to reconcile a pool: read, render, apply, prune, write status",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    registry=None,
)


@dataclass(frozen=True)
class RoleView:
    role: str  # the workers' kvpool.io/role
    desired: int  # the Deployment's spec.replicas, as the operator sets it
    ready: int  # its status.readyReplicas


@dataclass(frozen=True)
class PoolView:
    namespace: str
    name: str
    phase: str | None = None
    roles: tuple[RoleView, ...] = ()
    recommended: Mapping[str, int] = field(default_factory=dict)  # role -> replicas
    decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    # ^ (role, direction, mode) -> decisions counted
    slo_targets: Mapping[str, float] = field(default_factory=dict)  # ttft/itl -> seconds
    slo_quantile: float | None = None
    latency: Mapping[str, float] = field(default_factory=dict)  # ttft/itl -> seconds


@dataclass(frozen=True)
class OperatorView:
    active: bool
    pools: tuple[PoolView, ...] = ()


class OperatorCollector(Collector):
    """The series of :class:`OperatorView` ``snapshot()``, at each scrape."""

    def __init__(self, snapshot: Callable[[], OperatorView]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # names are not checked at registration: collect() reads live state

    def collect(self) -> Iterator[Metric]:
        view = self.snapshot()
        yield GaugeMetricFamily(
            "kvpool_operator_active",
            "1 while this replica is the active one (alone, or holding the leader election Lease)",
            value=1 if view.active else 0,
        )
        pool_labels = ["namespace", "pool"]
        role_labels = [*pool_labels, "role"]
        desired = GaugeMetricFamily(
            "kvpool_operator_desired_replicas",
            "Replicas the operator sets on the role's Deployment",
            labels=role_labels,
        )
        ready = GaugeMetricFamily(
            "kvpool_operator_ready_replicas",
            "Ready replicas of the role's Deployment",
            labels=role_labels,
        )
        recommended = GaugeMetricFamily(
            "kvpool_operator_recommended_replicas",
            "The autoscaler's latest recommendation for the role (Active and Advisory)",
            labels=role_labels,
        )
        decisions = CounterMetricFamily(
            "kvpool_operator_scaling_decisions",
            "Scaling decisions recorded (in Advisory mode, each new advice)",
            labels=[*role_labels, "direction", "mode"],
        )
        slo_target = GaugeMetricFamily(
            "kvpool_operator_slo_target_seconds",
            "The pool's SLO target of a latency (spec.slo)",
            labels=[*pool_labels, "metric"],
        )
        slo_quantile = GaugeMetricFamily(
            "kvpool_operator_slo_quantile",
            "The quantile the pool's SLO targets are set at",
            labels=pool_labels,
        )
        latency = GaugeMetricFamily(
            "kvpool_operator_observed_latency_seconds",
            "The autoscaler's latest windowed latency at the SLO quantile",
            labels=[*pool_labels, "metric"],
        )
        phase = GaugeMetricFamily(
            "kvpool_operator_pool_phase",
            "1 for the pool's current status.phase, 0 for the others",
            labels=[*pool_labels, "phase"],
        )
        for pool in view.pools:
            ids = [pool.namespace, pool.name]
            for role in pool.roles:
                desired.add_metric([*ids, role.role], role.desired)
                ready.add_metric([*ids, role.role], role.ready)
            for role, replicas in sorted(pool.recommended.items()):
                recommended.add_metric([*ids, role], replicas)
            for (role, direction, mode), count in sorted(pool.decisions.items()):
                decisions.add_metric([*ids, role, direction, mode], count)
            for metric, seconds in sorted(pool.slo_targets.items()):
                slo_target.add_metric([*ids, metric], seconds)
            if pool.slo_quantile is not None:
                slo_quantile.add_metric(ids, pool.slo_quantile)
            for metric, seconds in sorted(pool.latency.items()):
                latency.add_metric([*ids, metric], seconds)
            if pool.phase is not None:
                for name in PHASES:
                    phase.add_metric([*ids, name], 1 if name == pool.phase else 0)
        yield from (desired, ready, recommended, decisions, slo_target, slo_quantile, latency)
        yield phase


def make_registry(snapshot: Callable[[], OperatorView]) -> CollectorRegistry:
    """A registry of the operator's own (not the process's default one)."""
    registry = CollectorRegistry()
    registry.register(OperatorCollector(snapshot))
    registry.register(RECONCILES)
    registry.register(RECONCILE_DURATION)
    return registry


def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``registry`` on ``/metrics`` in a daemon thread; the server has
    ``server_port`` and ``shutdown()``."""
    server, _ = start_http_server(port, addr=addr, registry=registry)
    log.info("operator metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
