"""The Grafana dashboards, read as a user's Grafana reads them (the JSON the chart ships).

Whether every panel returns data is proven against a real Prometheus in
``e2e/test_dashboards_prometheus.py``; here, what can be checked without one: the committed
JSON is what ``charts/dashboards.py`` writes, every rate is windowed, every panel is scoped
by the dashboard's variables, and each dashboard shows what it promises.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "charts" / "kvpool" / "dashboards"
# series that describe the operator itself, not a pool
UNSCOPED = ("kvpool_operator_active", "kvpool_operator_reconciles_total")
METRIC = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})(\[[^\]]*\])?")


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "kvpool_dashboards", ROOT / "charts/dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(FOLDER.glob("*.json"))}


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query."""
    return [
        (panel["title"], t["expr"])
        for panel in dashboard["panels"]
        for t in panel.get("targets", [])
    ]


def test_the_committed_json_is_what_the_generator_writes() -> None:
    files = _generator().render_all()
    committed = {p.name: p.read_text() for p in FOLDER.glob("*.json")}
    assert set(committed) == set(files), "run `make dashboards`"
    for name, text in files.items():
        assert committed[name] == text, f"{name} is stale: run `make dashboards`"


def test_the_generator_writes_into_a_folder_and_removes_stale_files(tmp_path: Path) -> None:
    (tmp_path / "old-dashboard.json").write_text("{}")
    assert _generator().main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        p.name for p in FOLDER.glob("*.json")
    )


@pytest.mark.parametrize("uid", sorted(dashboards()))
def test_every_counter_and_histogram_is_read_over_a_window(uid: str) -> None:
    for title, expr in targets(dashboards()[uid]):
        for name, _, window in METRIC.findall(expr):
            if name.endswith(("_total", "_bucket", "_sum", "_count")):
                assert window == "[5m]", f"{uid} / {title}: {name} is not read over [5m]: {expr}"
        # a lifetime average (sum over count without a rate) is refused as well
        assert not re.search(r"_sum\{[^}]*\}\s*/", expr), f"{uid} / {title}: {expr}"


@pytest.mark.parametrize("uid", sorted(dashboards()))
def test_every_query_is_scoped_by_the_dashboard_variables(uid: str) -> None:
    dashboard = dashboards()[uid]
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "namespace", "pool", "role"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for t in panel["targets"]:
            for name, matchers, _ in METRIC.findall(t["expr"]):
                if name in UNSCOPED:
                    continue
                where = f"{uid} / {panel['title']}: {name}"
                assert 'namespace="$namespace"' in matchers, where
                assert 'pool="$pool"' in matchers, where
                if name.startswith("vllm:"):  # worker series: the role selector applies
                    assert 'role=~"$role"' in matchers, where


def test_panel_ids_and_grid_positions_are_unique_within_a_dashboard() -> None:
    for uid, dashboard in dashboards().items():
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), uid
        cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
        assert len(cells) == len(set(cells)), uid
        assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
        assert dashboard["uid"] == uid


# What each dashboard promises (the list), as the metrics its queries must read.
PROMISED = {
    "kvpool-slo": [
        "kvpool_router_time_to_first_token_seconds_bucket",
        "kvpool_router_inter_token_latency_seconds_bucket",
        "kvpool_router_e2e_request_latency_seconds_bucket",
        "kvpool_operator_slo_target_seconds",  # target lines
        "kvpool_router_requests_total",  # request and error rates
        "kvpool_operator_slo_quantile",  # attainment at the pool's quantile
    ],
    "kvpool-routing": [
        "kvpool_router_cached_prompt_tokens_total",  # cache hit ratio
        "kvpool_router_routing_decisions_total",  # decisions by reason
        "kvpool_router_worker_in_flight_requests",
        "kvpool_router_kv_event_lag_seconds_bucket",
        "kvpool_router_kv_event_gaps_total",
        # flow control and tenants
        "kvpool_router_queue_depth",
        "kvpool_router_queue_wait_seconds_bucket",
        "kvpool_router_shed_total",
        "kvpool_router_tenant_tokens_total",
    ],
    "kvpool-workers": [
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ],
    "kvpool-autoscaling": [
        "kvpool_operator_desired_replicas",
        "kvpool_operator_ready_replicas",
        "kvpool_operator_scaling_decisions_total",
    ],
}


@pytest.mark.parametrize("uid", sorted(PROMISED))
def test_each_dashboard_shows_what_it_promises(uid: str) -> None:
    read = {name for _, expr in targets(dashboards()[uid]) for name, _, _ in METRIC.findall(expr)}
    missing = [m for m in PROMISED[uid] if m not in read]
    assert not missing, f"{uid} reads none of {missing}"


def test_latency_panels_show_p50_p90_p99_against_the_target() -> None:
    slo = dashboards()["kvpool-slo"]
    for title in ("Time to first token", "Inter-token latency"):
        panel = next(p for p in slo["panels"] if p["title"] == title)
        legends = [t["legendFormat"] for t in panel["targets"]]
        assert legends == ["p50", "p90", "p99", "SLO target"], title
        quantiles = [
            re.match(r"histogram_quantile\(([\d.]+),", t["expr"]) for t in panel["targets"][:3]
        ]
        assert [q.group(1) for q in quantiles if q] == ["0.5", "0.9", "0.99"], title
