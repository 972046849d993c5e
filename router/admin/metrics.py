"""The router's Prometheus series, ``kvpool_router_*``.

Latencies are measured at the router, so they include the hop and the queueing a client
sees. Per-worker state (in flight, queued prefill tokens, indexed blocks, up, event
counters) is read from the pool at scrape time, so a removed worker's series go with it.
The cache hit ratio a dashboard shows is
``rate(kvpool_router_cached_prompt_tokens_total[5m])`` over
``rate(kvpool_router_reported_prompt_tokens_total[5m])``: every answer counts, streamed or
not, since the router asks for usage on every stream (and keeps it from clients that did
not ask for it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ..routing.planner import PD_REASONS
from ..state.worker import WorkerState
from .siblings import EVENT_FAMILIES, FLAG_CAUSES, SHARE_S, Rows, Siblings, added, own_rows

# The workers' (vLLM's) buckets, so router and worker latencies line up on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

#: the outcomes ``kvpool_router_requests_total`` counts
OUTCOMES = (
    "success",  # the worker's answer reached the client in full
    "client_error",  # a 4xx from the router's checks or from the worker
    "overloaded",  # 429: the router's concurrency bound, or every worker refused
    "no_worker",  # 503: no worker could take it
    "worker_error",  # workers failed before the first byte, attempts exhausted
    "stream_error",  # a worker failed mid-stream: ended with an SSE error event
    "timeout",  # the request timeout passed
    "cancelled",  # the client went away
    "unauthorized",  # 401: no key, or a key the router does not know
    "rate_limited",  # 429: the tenant's requests or tokens limit
    "shed",  # 429/503: flow control gave up on it (deadline, full queue, waited too long)
)

#: the priority bands of flow control, highest first
BANDS = ("high", "normal", "low")
#: why flow control shed a request (``kvpool_router_shed_total``)
SHED_REASONS = (
    "deadline",  # its predicted wait, or its wait so far, passed its TTFT deadline
    "queue_full",  # the queue was at its bound in requests
    "queue_bytes",  # the queue was at its bound in bytes
    "displaced",  # it gave its place in a full queue to a more deserving request
    "queue_timeout",  # it waited the longest a request may wait
)
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


#: why ``kvpool_router_retries_total`` sent a request again
RETRY_REASONS = (
    "connect",  # could not connect
    "connection",  # the connection failed before the answer began
    "timeout",  # no whole answer before the request timeout
    "ttft_timeout",  # no first token before the time-to-first-token limit
    "no_token",  # the stream ended or errored before its first token
    "down",  # the worker failed its health check while the request waited on it
    "overloaded",  # 429
    "5xx",
)

#: how ``kvpool_router_pd_requests_total`` counts a request's way through the pool
PD_PATHS = (
    "disaggregated",  # prefilled on a prefill worker, decoded on another
    "aggregated",  # served whole by one worker, as planned
    "fallback",  # planned as a split, served whole: no prefill leg succeeded
)

#: why a prefill leg failed (``kvpool_router_prefill_leg_failures_total``)
PREFILL_FAILURES = (*RETRY_REASONS, "refused", "no_params")


class _PoolCollector(Collector):
    def __init__(
        self,
        workers: Callable[[], list[WorkerState]],
        indexed_blocks: Callable[[str], int],
        rows: Callable[[], Rows],
        prefill_rates: Callable[[], Mapping[str, float]],
    ) -> None:
        self.workers = workers
        self.indexed_blocks = indexed_blocks  # all of a worker's data-parallel ranks
        self.rows = rows  # the additive figures: this process's, plus its siblings'
        self.prefill_rates = prefill_rates  # the ones routing uses; none before a TTFT

    def collect(self) -> Iterator[Metric]:
        families = {
            "up": GaugeMetricFamily(
                "kvpool_router_worker_up",
                "1 while the worker is in rotation (healthy, registered, not draining).",
                labels=["worker"],
            ),
            "compatible": GaugeMetricFamily(
                "kvpool_router_worker_compatible",
                "0 when the worker's block size, hash seed or model differ from the router's "
                "(it gets no cache credit).",
                labels=["worker"],
            ),
            "in_flight": GaugeMetricFamily(
                "kvpool_router_worker_in_flight_requests",
                "Requests the router has sent to the worker that have not finished.",
                labels=["worker"],
            ),
            "queued": GaugeMetricFamily(
                "kvpool_router_worker_queued_prefill_tokens",
                "Uncached prompt tokens sent to the worker whose first token has not come back.",
                labels=["worker"],
            ),
            "blocks": GaugeMetricFamily(
                "kvpool_router_worker_indexed_blocks",
                "KV blocks the index holds for the worker, from its events.",
                labels=["worker"],
            ),
            "rate": GaugeMetricFamily(
                "kvpool_router_worker_prefill_rate_tokens_per_second",
                "The prefill rate routing uses for the worker: learned from its TTFTs, or "
                "its peers' while it has few; absent until the router has seen a TTFT.",
                labels=["worker"],
            ),
            "events": CounterMetricFamily(
                "kvpool_router_kv_events",
                "KV events received from the worker.",
                labels=["worker"],
            ),
            "gaps": CounterMetricFamily(
                "kvpool_router_kv_event_gaps",
                "Sequence gaps in the worker's KV event stream.",
                labels=["worker"],
            ),
            "decisions": CounterMetricFamily(
                "kvpool_router_routing_decisions",
                "Routing decisions by chosen worker and reason (prefix, spill, affinity, the "
                "deciding scorer when every worker held as much of the prompt, tie, single, "
                "or the baseline policy's name).",
                labels=["worker", "reason"],
            ),
            "mismatches": CounterMetricFamily(
                "kvpool_router_worker_hash_mismatches",
                "Registrations of the worker with a block size, hash seed or model other than "
                "the router's.",
                labels=["worker"],
            ),
            "cache_flags": CounterMetricFamily(
                "kvpool_router_worker_cache_flags",
                "Times the worker's reported cached tokens were found to disagree with the "
                "router's predictions (it lost cache credit).",
                labels=["worker"],
            ),
            "cache_flagged": GaugeMetricFamily(
                "kvpool_router_worker_cache_flagged",
                "1 while the worker's reported cached tokens disagree with the router's "
                "predictions (it gets no cache credit); cause: unseen (its events name other "
                "blocks: hash seed, block size) or over-predicted (it has less than credited).",
                labels=["worker", "cause"],
            ),
            "cache_agreement": GaugeMetricFamily(
                "kvpool_router_worker_cache_agreement",
                "Cached prompt tokens the worker reported and the router predicted alike, over "
                "those either claimed, in its last answers (0..1).",
                labels=["worker"],
            ),
            "resyncs": CounterMetricFamily(
                "kvpool_router_kv_event_resyncs",
                "Times the worker's index entries were dropped because events were lost.",
                labels=["worker"],
            ),
        }
        rows = self.rows()
        rates = self.prefill_rates()
        for s in self.workers():
            w = [s.id]
            families["up"].add_metric(w, 1.0 if s.routable else 0.0)
            families["compatible"].add_metric(w, 1.0 if s.compatible else 0.0)
            families["in_flight"].add_metric(w, rows.in_flight.get(s.id, 0))
            families["queued"].add_metric(w, rows.queued.get(s.id, 0))
            families["blocks"].add_metric(w, self.indexed_blocks(s.id))
            if s.id in rates:
                families["rate"].add_metric(w, rates[s.id])
            check = s.agreement
            if check is not None:
                code = rows.events["cache_flagged"].get(s.id, 0)
                families["cache_flagged"].add_metric(
                    [s.id, FLAG_CAUSES.get(code, "")], min(code, 1)
                )
                if (ratio := check.ratio) is not None:
                    families["cache_agreement"].add_metric(w, ratio)
            for family in EVENT_FAMILIES:
                if family != "cache_flagged":
                    families[family].add_metric(w, rows.events[family].get(s.id, 0))
            for reason, count in rows.decisions.get(s.id, {}).items():
                families["decisions"].add_metric([s.id, reason], count)
        yield from families.values()
        # the flow-control queue, from the same rows (one read of the siblings' a scrape)
        queue = GaugeMetricFamily(
            "kvpool_router_queue_depth",
            "Requests waiting in the router's flow-control queue, by priority band.",
            labels=["band"],
        )
        for band in BANDS:
            queue.add_metric([band], rows.queue.get(band, 0))
        yield queue


class RouterMetrics:
    def __init__(
        self,
        workers: Callable[[], list[WorkerState]],
        indexed_blocks: Callable[[str], int],
        shared: str | None = None,
        prefill_rates: Callable[[], Mapping[str, float]] | None = None,
    ) -> None:
        """``shared``: the runtime directory of a router of several processes
        (:mod:`.processes`), whose ``/metrics`` then adds up every process's figures;
        ``prefill_rates``: the rate routing uses for each worker (by default, each one's
        own model's)."""
        self.workers = workers
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpool_router_requests",
            "Requests by outcome.",
            ["outcome"],
            registry=r,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.retries = Counter(
            "kvpool_router_retries",
            "Requests sent again to another worker before any byte reached the client.",
            ["reason"],
            registry=r,
        )
        for reason in RETRY_REASONS:  # a dashboard's rate() reads 0, not nothing
            self.retries.labels(reason)
        self.pd_requests = Counter(
            "kvpool_router_pd_requests",
            "Requests by the way they were served: disaggregated (prefill worker, then "
            "decode worker), aggregated (one worker), fallback (a planned split served whole "
            "because no prefill leg succeeded).",
            ["path"],
            registry=r,
        )
        self.pd_path = {path: self.pd_requests.labels(path) for path in PD_PATHS}
        self.pd_decisions = Counter(
            "kvpool_router_pd_decisions",
            "Prefill/decode split decisions by reason.",
            ["reason"],
            registry=r,
        )
        self.pd_reason = {reason: self.pd_decisions.labels(reason) for reason in PD_REASONS}
        self.prefill_leg = Histogram(
            "kvpool_router_prefill_leg_seconds",
            "Time from sending a prefill leg to a prefill worker to its answer (the KV "
            "transfer parameters), successful legs only.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefill_failures = Counter(
            "kvpool_router_prefill_leg_failures",
            "Prefill legs that failed, by reason; the request went to another prefill worker "
            "or was served whole.",
            ["reason"],
            registry=r,
        )
        for reason in PREFILL_FAILURES:
            self.prefill_failures.labels(reason)
        self.ttft = Histogram(
            "kvpool_router_time_to_first_token_seconds",
            "Time from the request's arrival at the router to its first streamed token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvpool_router_inter_token_latency_seconds",
            "Time between streamed chunks of a response, at the router.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvpool_router_e2e_request_latency_seconds",
            "Time from the request's arrival at the router to the end of its response.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.decision_latency = Histogram(
            "kvpool_router_decision_latency_seconds",
            "Time to look up a request's blocks in the index and run the policy (after "
            "tokenizing and hashing).",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpool_router_prompt_tokens",
            "Prompt tokens of routed requests.",
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "kvpool_router_predicted_cache_hit_tokens",
            "Prompt tokens the index said the chosen worker held.",
            registry=r,
        )
        self.realised_hit_tokens = Counter(
            "kvpool_router_cached_prompt_tokens",
            "Prompt tokens the workers reported as served from their cache "
            "(usage.prompt_tokens_details.cached_tokens).",
            registry=r,
        )
        self.reported_prompt_tokens = Counter(
            "kvpool_router_reported_prompt_tokens",
            "Prompt tokens of the answers, from their usage (the denominator of the "
            "realised hit ratio; the router asks for usage on every stream).",
            registry=r,
        )
        self.event_lag = Histogram(
            "kvpool_router_kv_event_lag_seconds",
            "Time from a worker's event batch to its arrival in the index.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        # tenants and flow control
        self.tenant_tokens = Counter(
            "kvpool_router_tenant_tokens",
            "Tokens served per tenant, from the answers' usage (kind: prompt or completion).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "kvpool_router_tenant_requests",
            "Requests per tenant that reached the router's checks, by outcome.",
            ["tenant", "outcome"],
            registry=r,
        )
        self.rate_limited = Counter(
            "kvpool_router_rate_limited",
            "Requests refused with 429 by a tenant's limit (limit: requests or tokens).",
            ["tenant", "limit"],
            registry=r,
        )
        self.shed = Counter(
            "kvpool_router_shed",
            "Requests flow control gave up on, by reason.",
            ["reason", "band"],
            registry=r,
        )
        for reason in SHED_REASONS:
            for band in BANDS:
                self.shed.labels(reason, band)
        self.queue_wait = Histogram(
            "kvpool_router_queue_wait_seconds",
            "Time requests waited in the router's flow-control queue before going to a "
            "worker, by priority band (requests that did not wait are not counted).",
            ["band"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        for band in BANDS:
            self.queue_wait.labels(band)
        self.prefix_wait = Histogram(
            "kvpool_router_prefix_wait_seconds",
            "Time requests were held back for a request still prefilling the prompt blocks "
            "they share on their worker (outcome: prefilled, or timeout when its first "
            "token came later than predicted).",
            ["outcome"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        for outcome in ("prefilled", "timeout"):
            self.prefix_wait.labels(outcome)
        self.saturated = Counter(
            "kvpool_router_saturated",
            "Requests that found the pool saturated (every eligible worker over the TTFT "
            "bound, or its decode guard tripped) and were queued in the router.",
            ["reason"],
            registry=r,
        )
        for reason in ("ttft", "guard", "concurrency"):
            self.saturated.labels(reason)
        self._queue_depth: Callable[[], dict[str, int]] = lambda: {}
        self.siblings = Siblings(shared) if shared else None
        if self.siblings is not None:
            # Counters and histograms: prometheus_client's multiprocess files (the process
            # was started with PROMETHEUS_MULTIPROC_DIR), added up across processes.
            r = self.exposed = CollectorRegistry()
            MultiProcessCollector(r)
        else:
            self.exposed = r
        rates = prefill_rates or (lambda: {s.id: s.prefill.rate for s in workers()})
        r.register(_PoolCollector(workers, indexed_blocks, self._rows, rates))

    def watch_queue(self, depth: Callable[[], dict[str, int]]) -> None:
        """Where ``kvpool_router_queue_depth`` reads each band's waiting requests."""
        self._queue_depth = depth

    def _rows(self) -> Rows:
        rows = own_rows(self.workers(), self._queue_depth())
        return added(rows, self.siblings.others()) if self.siblings is not None else rows

    async def share(self) -> None:
        """Write this process's rows for its siblings' scrapes, every :data:`SHARE_S`."""
        if self.siblings is None:
            return
        while True:
            with contextlib.suppress(OSError):
                self.siblings.write(own_rows(self.workers(), self._queue_depth()))
            await asyncio.sleep(SHARE_S)

    def render(self) -> bytes:
        return generate_latest(self.exposed)
