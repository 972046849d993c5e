"""kvpool's Grafana dashboards, as code: ``python charts/dashboards.py`` (or ``make dashboards``)
writes ``charts/kvpool/dashboards/*.json``, which the chart ships as ConfigMaps for Grafana's
dashboard sidecar. A test fails when the committed JSON differs from this file's output, and
an end-to-end test runs every panel's PromQL against a real Prometheus scraping a real stack.

Written with Grafana's own Python SDK (``grafana-foundation-sdk``). The label conventions
every query relies on:

* router and worker series carry ``namespace``, ``pool`` and ``pod`` (the chart's PodMonitor,
  or any Kubernetes scrape config, adds them), and worker series also ``role`` (``prefill``,
  ``decode`` or ``both``, from the pod label ``kvpool.io/role``);
* the operator's ``kvpool_operator_*`` series carry the pool's own ``namespace``, ``pool`` and
  ``role`` labels (the chart scrapes the operator with ``honorLabels``).

Workers export vLLM's metric names, so the worker panels read our workers and vLLM alike.
Every rate is windowed (``[5m]``); nothing divides lifetime counters.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model

OUT = Path(__file__).parent / "kvpool" / "dashboards"
WINDOW = "5m"
DS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")

# label matchers: a pool's router series, its worker series (by role), and operator series
POOL = 'namespace="$namespace", pool="$pool"'
ROLE = POOL + ', role=~"$role"'
FAILED = POOL + ', outcome!="success"'


def rate(metric: str, match: str = POOL, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{match}}}[{WINDOW}]))"


def increase(metric: str, match: str = POOL, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (increase({metric}{{{match}}}[{WINDOW}]))"


def agg(fn: str, metric: str, match: str = POOL, by: str = "") -> str:
    """An aggregation of a gauge, e.g. ``max by (worker) (metric{...})``."""
    grouping = f" by ({by})" if by else ""
    return f"{fn}{grouping} ({metric}{{{match}}})"


def quantile(q: str, histogram: str, match: str = POOL, by: str = "") -> str:
    buckets = rate(histogram + "_bucket", match, f"le, {by}" if by else "le")
    return f"histogram_quantile({q}, {buckets})"


def ratio(numerator: str, denominator: str, match: str = POOL, by: str = "") -> str:
    return f"{rate(numerator, match, by)} / {rate(denominator, match, by)}"


def slo_target(metric: str) -> str:
    return f'max(kvpool_operator_slo_target_seconds{{{POOL}, metric="{metric}"}})'


SLO_Q = f"scalar(max(kvpool_operator_slo_quantile{{{POOL}}}))"


def attainment(histogram: str, metric: str) -> str:
    """The share of the dashboard's time range in which the pool's latency at its SLO
    quantile (over 5-minute windows, at the router) was within the target."""
    measured = f"histogram_quantile({SLO_Q}, {rate(histogram + '_bucket', POOL, 'le')})"
    return f"avg_over_time(({measured} <= bool scalar({slo_target(metric)}))[$__range:1m])"


@dataclass
class Panel:
    title: str
    description: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    max: float | None = None


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)


def latency_panel(title: str, histogram: str, target: str | None, what: str) -> Panel:
    queries = [(quantile(q, histogram), f"p{q[2:].ljust(2, '0')}") for q in ("0.5", "0.9", "0.99")]
    if target:
        queries.append((slo_target(target), "SLO target"))
    return Panel(title, what, queries, unit="s", width=8)


SLO = Dashboard(
    "kvpool-slo",
    "kvpool / SLO overview",
    "Latency at the router against the pool's SLO targets, request and error rates, "
    "attainment and throughput.",
    [
        (
            "Latency",
            [
                latency_panel(
                    "Time to first token",
                    "kvpool_router_time_to_first_token_seconds",
                    "ttft",
                    "From a request's arrival at the router to its first streamed token.",
                ),
                latency_panel(
                    "Inter-token latency",
                    "kvpool_router_inter_token_latency_seconds",
                    "itl",
                    "Time between streamed chunks, at the router.",
                ),
                latency_panel(
                    "End-to-end latency",
                    "kvpool_router_e2e_request_latency_seconds",
                    None,
                    "From a request's arrival at the router to the end of its response.",
                ),
            ],
        ),
        (
            "Traffic",
            [
                Panel(
                    "Requests by outcome",
                    "Requests per second, by how they ended.",
                    [(rate("kvpool_router_requests_total", by="outcome"), "{{outcome}}")],
                    unit="reqps",
                    width=8,
                ),
                Panel(
                    "Error ratio",
                    "Share of requests that did not end in success.",
                    [
                        (
                            rate("kvpool_router_requests_total", FAILED)
                            + " / "
                            + rate("kvpool_router_requests_total"),
                            "errors",
                        )
                    ],
                    unit="percentunit",
                    width=8,
                ),
                Panel(
                    "Output tokens per second",
                    "Tokens generated by the pool's workers.",
                    [(rate("vllm:generation_tokens_total", ROLE), "generated")],
                    unit="short",
                    width=8,
                ),
            ],
        ),
        (
            "SLO attainment",
            [
                Panel(
                    "TTFT SLO attainment",
                    "Share of the time range in which TTFT at the SLO quantile (5-minute "
                    "windows) was within the target.",
                    [(attainment("kvpool_router_time_to_first_token_seconds", "ttft"), "TTFT")],
                    unit="percentunit",
                    kind="stat",
                    width=6,
                    max=1,
                ),
                Panel(
                    "ITL SLO attainment",
                    "Share of the time range in which ITL at the SLO quantile (5-minute "
                    "windows) was within the target.",
                    [(attainment("kvpool_router_inter_token_latency_seconds", "itl"), "ITL")],
                    unit="percentunit",
                    kind="stat",
                    width=6,
                    max=1,
                ),
                Panel(
                    "Cache hit ratio",
                    "Prompt tokens the workers served from their prefix cache.",
                    [
                        (
                            ratio(
                                "kvpool_router_cached_prompt_tokens_total",
                                "kvpool_router_reported_prompt_tokens_total",
                            ),
                            "hit ratio",
                        )
                    ],
                    unit="percentunit",
                    kind="stat",
                    width=6,
                    max=1,
                ),
                Panel(
                    "Requests per second",
                    "All requests the router received.",
                    [(rate("kvpool_router_requests_total"), "requests")],
                    unit="reqps",
                    kind="stat",
                    width=6,
                ),
            ],
        ),
    ],
)

ROUTING = Dashboard(
    "kvpool-routing",
    "kvpool / Routing",
    "How the router places requests: cache hits, decisions and their reasons, per-worker "
    "load, and the health of the KV event streams that feed its index.",
    [
        (
            "Cache",
            [
                Panel(
                    "Cache hit ratio",
                    "Realised: prompt tokens the workers reported as cached. Predicted: what "
                    "the index expected on the chosen worker. Workers: vLLM's prefix cache "
                    "hits over queries.",
                    [
                        (
                            ratio(
                                "kvpool_router_cached_prompt_tokens_total",
                                "kvpool_router_reported_prompt_tokens_total",
                            ),
                            "realised",
                        ),
                        (
                            ratio(
                                "kvpool_router_predicted_cache_hit_tokens_total",
                                "kvpool_router_prompt_tokens_total",
                            ),
                            "predicted",
                        ),
                        (
                            ratio(
                                "vllm:prefix_cache_hits_total",
                                "vllm:prefix_cache_queries_total",
                                ROLE,
                            ),
                            "workers",
                        ),
                    ],
                    unit="percentunit",
                    max=1,
                ),
                Panel(
                    "Decisions by reason",
                    "Routing decisions per second: prefix (cache overlap won), load, spill "
                    "(the best cache holder was overloaded), single.",
                    [(rate("kvpool_router_routing_decisions_total", by="reason"), "{{reason}}")],
                    unit="ops",
                ),
            ],
        ),
        (
            "Workers as the router sees them",
            [
                Panel(
                    "In-flight requests per worker",
                    "Requests the router has sent to each worker that have not finished.",
                    [
                        (
                            agg("sum", "kvpool_router_worker_in_flight_requests", by="worker"),
                            "{{worker}}",
                        )
                    ],
                    width=8,
                ),
                Panel(
                    "Queued prefill tokens per worker",
                    "Uncached prompt tokens sent to each worker whose first token has not "
                    "come back.",
                    [
                        (
                            agg("sum", "kvpool_router_worker_queued_prefill_tokens", by="worker"),
                            "{{worker}}",
                        )
                    ],
                    width=8,
                ),
                Panel(
                    "Decisions per worker",
                    "Requests routed to each worker per second.",
                    [(rate("kvpool_router_routing_decisions_total", by="worker"), "{{worker}}")],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
        (
            "KV events and the index",
            [
                Panel(
                    "Event lag",
                    "From a worker's event batch to its arrival in the router's index.",
                    [
                        (quantile("0.5", "kvpool_router_kv_event_lag_seconds"), "p50"),
                        (quantile("0.99", "kvpool_router_kv_event_lag_seconds"), "p99"),
                    ],
                    unit="s",
                    width=6,
                ),
                Panel(
                    "Event gaps and resyncs",
                    "Sequence gaps in a worker's event stream (lost events) and the times "
                    "its index entries were dropped for it, per 5 minutes.",
                    [
                        (
                            increase("kvpool_router_kv_event_gaps_total", by="worker"),
                            "gaps {{worker}}",
                        ),
                        (
                            increase("kvpool_router_kv_event_resyncs_total", by="worker"),
                            "resyncs {{worker}}",
                        ),
                    ],
                    width=6,
                ),
                Panel(
                    "Events per second",
                    "KV events received from each worker.",
                    [(rate("kvpool_router_kv_events_total", by="worker"), "{{worker}}")],
                    unit="ops",
                    width=6,
                ),
                Panel(
                    "Indexed blocks per worker",
                    "KV blocks the router's index holds for each worker.",
                    [
                        (
                            agg("max", "kvpool_router_worker_indexed_blocks", by="worker"),
                            "{{worker}}",
                        )
                    ],
                    width=6,
                ),
            ],
        ),
        (
            "Flow control and tenants",
            [
                Panel(
                    "Waiting in the router",
                    "Requests held in the router's queue while the pool is saturated, by "
                    "priority band.",
                    [(agg("sum", "kvpool_router_queue_depth", by="band"), "{{band}}")],
                    width=8,
                ),
                Panel(
                    "Queue wait p90",
                    "How long requests that waited spent in the router's queue before a "
                    "worker, by priority band.",
                    [(quantile("0.9", "kvpool_router_queue_wait_seconds", by="band"), "{{band}}")],
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Saturation and shedding",
                    "Requests that found the pool saturated (why), and requests flow control "
                    "gave up on (why: deadline, full queue, displaced, waited too long).",
                    [
                        (
                            rate("kvpool_router_saturated_total", by="reason"),
                            "saturated {{reason}}",
                        ),
                        (rate("kvpool_router_shed_total", by="reason"), "shed {{reason}}"),
                    ],
                    unit="reqps",
                    width=8,
                ),
                Panel(
                    "Held for a prefill",
                    "Requests held back while a request routed before them to the same "
                    "worker prefilled the prompt blocks they share, per second, by how the "
                    "wait ended (its first token, or the bound).",
                    [
                        (
                            rate("kvpool_router_prefix_wait_seconds_count", by="outcome"),
                            "{{outcome}}",
                        ),
                    ],
                    unit="reqps",
                    width=12,
                ),
                Panel(
                    "Prefill wait p90",
                    "How long requests held for a prefill they share waited.",
                    [(quantile("0.9", "kvpool_router_prefix_wait_seconds"), "p90")],
                    unit="s",
                    width=12,
                ),
                Panel(
                    "Tokens by tenant",
                    "Prompt and completion tokens served per second to each tenant, from "
                    "the answers' usage (anonymous when the router checks no keys).",
                    [(rate("kvpool_router_tenant_tokens_total", by="tenant"), "{{tenant}}")],
                    unit="short",
                ),
                Panel(
                    "Requests by tenant and outcome",
                    "Requests per second per tenant: served, failed, refused by its rate "
                    "limits, or shed by flow control.",
                    [
                        (
                            rate("kvpool_router_tenant_requests_total", by="tenant, outcome"),
                            "{{tenant}} {{outcome}}",
                        )
                    ],
                    unit="reqps",
                ),
            ],
        ),
        (
            "Router health",
            [
                Panel(
                    "Workers in rotation",
                    "Workers the router can route to, and those whose block size, hash "
                    "seed or model differ from the router's.",
                    [
                        (f"max(sum by (pod) (kvpool_router_worker_up{{{POOL}}}))", "in rotation"),
                        (
                            f"max(sum by (pod) (1 - kvpool_router_worker_compatible{{{POOL}}}))",
                            "incompatible",
                        ),
                    ],
                    width=8,
                ),
                Panel(
                    "Decision time",
                    "Index lookup and policy, per request.",
                    [
                        (quantile("0.5", "kvpool_router_decision_latency_seconds"), "p50"),
                        (quantile("0.99", "kvpool_router_decision_latency_seconds"), "p99"),
                    ],
                    unit="s",
                    width=8,
                ),
                Panel(
                    "Retries by reason",
                    "Requests sent again to another worker before any byte reached the client.",
                    [(rate("kvpool_router_retries_total", by="reason"), "{{reason}}")],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
    ],
)

WORKERS = Dashboard(
    "kvpool-workers",
    "kvpool / Workers",
    "Each worker's KV cache, queues, preemptions and token throughput (vLLM's metric names, "
    "so kvpool and vLLM workers alike).",
    [
        (
            "Cache and queues",
            [
                Panel(
                    "KV cache usage",
                    "Share of each worker's KV blocks in use.",
                    [(f"max by (pod) (vllm:kv_cache_usage_perc{{{ROLE}}})", "{{pod}}")],
                    unit="percentunit",
                    width=8,
                    max=1,
                ),
                Panel(
                    "Running requests",
                    "Requests in each worker's batch.",
                    [(f"sum by (pod) (vllm:num_requests_running{{{ROLE}}})", "{{pod}}")],
                    width=8,
                ),
                Panel(
                    "Waiting requests",
                    "Requests queued at each worker.",
                    [(f"sum by (pod) (vllm:num_requests_waiting{{{ROLE}}})", "{{pod}}")],
                    width=8,
                ),
            ],
        ),
        (
            "Throughput",
            [
                Panel(
                    "Prompt tokens per second",
                    "Prefill tokens each worker processed.",
                    [(rate("vllm:prompt_tokens_total", ROLE, "pod"), "{{pod}}")],
                    width=8,
                ),
                Panel(
                    "Generation tokens per second",
                    "Tokens each worker generated.",
                    [(rate("vllm:generation_tokens_total", ROLE, "pod"), "{{pod}}")],
                    width=8,
                ),
                Panel(
                    "Preemptions",
                    "Requests preempted per second (their KV blocks were reclaimed).",
                    [(rate("vllm:num_preemptions_total", ROLE, "pod"), "{{pod}}")],
                    unit="ops",
                    width=8,
                ),
            ],
        ),
        (
            "Latency and cache at the workers",
            [
                Panel(
                    "Worker TTFT p90",
                    "Time to first token measured inside each worker (no routing hop).",
                    [
                        (
                            quantile("0.9", "vllm:time_to_first_token_seconds", ROLE, "pod"),
                            "{{pod}}",
                        )
                    ],
                    unit="s",
                ),
                Panel(
                    "Prefix cache hit ratio",
                    "Each worker's prefix cache hits over queries, in tokens.",
                    [
                        (
                            ratio(
                                "vllm:prefix_cache_hits_total",
                                "vllm:prefix_cache_queries_total",
                                ROLE,
                                "pod",
                            ),
                            "{{pod}}",
                        )
                    ],
                    unit="percentunit",
                    max=1,
                ),
            ],
        ),
    ],
)

AUTOSCALING = Dashboard(
    "kvpool-autoscaling",
    "kvpool / Autoscaling",
    "What the operator's SLO autoscaler sees and does: replicas desired and ready per role, "
    "its decisions, and the signals it scales on.",
    [
        (
            "Replicas",
            [
                Panel(
                    "Desired and ready replicas",
                    "Desired: what the operator sets on the role's Deployment. Recommended: "
                    "the autoscaler's latest advice (also in Advisory mode). Ready: pods "
                    "passing readiness.",
                    [
                        (
                            agg("max", "kvpool_operator_desired_replicas", ROLE, "role"),
                            "desired {{role}}",
                        ),
                        (
                            agg("max", "kvpool_operator_ready_replicas", ROLE, "role"),
                            "ready {{role}}",
                        ),
                        (
                            agg("max", "kvpool_operator_recommended_replicas", ROLE, "role"),
                            "recommended {{role}}",
                        ),
                    ],
                ),
                Panel(
                    "Scaling decisions",
                    "Decisions per 5 minutes, by role and direction (Advisory: advice given).",
                    [
                        (
                            increase(
                                "kvpool_operator_scaling_decisions_total",
                                ROLE,
                                "role, direction, mode",
                            ),
                            "{{role}} {{direction}} ({{mode}})",
                        )
                    ],
                ),
            ],
        ),
        (
            "Signals",
            [
                Panel(
                    "Latency the autoscaler measured",
                    "TTFT and ITL at the SLO quantile over the autoscaler's window, against "
                    "the targets.",
                    [
                        (
                            f"max by (metric) (kvpool_operator_observed_latency_seconds{{{POOL}}})",
                            "measured {{metric}}",
                        ),
                        (
                            f"max by (metric) (kvpool_operator_slo_target_seconds{{{POOL}}})",
                            "target {{metric}}",
                        ),
                    ],
                    unit="s",
                    width=8,
                ),
                Panel(
                    "KV cache usage by role",
                    "Mean KV cache usage of the role's workers (decode scales above 0.85).",
                    [(f"avg by (role) (vllm:kv_cache_usage_perc{{{ROLE}}})", "{{role}}")],
                    unit="percentunit",
                    width=8,
                    max=1,
                ),
                Panel(
                    "Waiting requests per ready replica",
                    "Requests queued at the role's workers, over its ready replicas.",
                    [
                        (
                            agg("sum", "vllm:num_requests_waiting", ROLE, "role")
                            + " / clamp_min("
                            + agg("max", "kvpool_operator_ready_replicas", ROLE, "role")
                            + ", 1)",
                            "{{role}}",
                        )
                    ],
                    width=8,
                ),
            ],
        ),
        (
            "Operator",
            [
                Panel(
                    "Reconciles by result",
                    "Pool reconciles per second: ok, invalid spec, or error.",
                    [
                        (
                            f"sum by (result) (rate(kvpool_operator_reconciles_total[{WINDOW}]))",
                            "{{result}}",
                        )
                    ],
                    unit="ops",
                ),
                Panel(
                    "Active operator replicas",
                    "Replicas holding the leader election Lease (exactly one should).",
                    [("sum(kvpool_operator_active)", "active")],
                    kind="stat",
                ),
            ],
        ),
    ],
)

DASHBOARDS = (SLO, ROUTING, WORKERS, AUTOSCALING)


def _variables() -> list[gdash.DatasourceVariable | gdash.QueryVariable]:
    def query(name: str, label: str, q: str) -> gdash.QueryVariable:
        return (
            gdash.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query({"query": q, "refId": f"{name}-variable"})
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(model.VariableSort.ALPHABETICAL_ASC)
        )

    return [
        gdash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        query("namespace", "Namespace", "label_values(kvpool_router_requests_total, namespace)"),
        query(
            "pool",
            "Pool",
            'label_values(kvpool_router_requests_total{namespace="$namespace"}, pool)',
        ),
        query("role", "Role", f"label_values(vllm:num_requests_running{{{POOL}}}, role)")
        .multi(True)
        .include_all(True)
        .all_value(".*"),
    ]


def _panel(p: Panel) -> timeseries.Panel | stat.Panel:
    builder = timeseries.Panel() if p.kind == "timeseries" else stat.Panel()
    builder.title(p.title).description(p.description).datasource(DS).unit(p.unit)
    builder.span(p.width).height(8 if p.kind == "timeseries" else 5)
    if p.max is not None:
        builder.min(0).max(p.max)
    for i, (expr, legend) in enumerate(p.queries):
        target = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
        builder.with_target(target.datasource(DS))
    return builder


def build(d: Dashboard) -> dict[str, object]:
    builder = (
        gdash.Dashboard(d.title)
        .uid(d.uid)
        .description(d.description)
        .tags(["kvpool", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
    )
    for title, panels in d.rows:
        builder.with_row(gdash.Row(title))
        for p in panels:
            builder.with_panel(_panel(p))
    built = builder.build()
    for i, panel in enumerate(built.panels or [], 1):
        panel.id_val = i
    return json.loads(json.dumps(built, cls=JSONEncoder))


def render_all() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {
        f"{d.uid}.json": json.dumps(build(d), indent=2, sort_keys=True) + "\n" for d in DASHBOARDS
    }


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else OUT
    out.mkdir(parents=True, exist_ok=True)
    files = render_all()
    for stale in set(p.name for p in out.glob("*.json")) - set(files):
        (out / stale).unlink()
    for name, text in files.items():
        (out / name).write_text(text)
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
