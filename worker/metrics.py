"""Prometheus metrics with vLLM's names and types (contract 5), plus the worker's own
``kvpool_worker_*`` series for the KV hand-off.

Series that mirror the engine's state (running, waiting, KV usage, prefix-cache and token
counters) are read from the engine loop's latest statistics at scrape time, so a scrape
and the engine can never disagree. Latency histograms are observed per request by
:class:`RequestTimer`. Each worker has its own registry, so one process can host many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import EngineStats, RequestOutput

# vLLM's buckets, so that dashboards and recording rules built for vLLM read ours alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], info: dict[str, str]):
        self.model_name = model_name
        self.stats = stats
        self.info = info

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", s.num_running
        )
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        yield gauge(
            "kvpool_worker_waiting_prompt_tokens",
            "Prompt tokens of requests waiting for admission.",
            s.waiting_tokens,
        )
        yield gauge(
            "kvpool_worker_pinned_requests",
            "Finished prefills whose KV blocks wait for a decode worker.",
            s.pinned_requests,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache config.", labels=list(self.info)
        )
        info.add_metric(list(self.info.values()), 1.0)
        yield info


class WorkerMetrics:
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats], cache_info: dict[str, str]
    ) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(model_name, stats, cache_info))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            E2E_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            TOKEN_BUCKETS,
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "kvpool_worker_rejected_requests",
            "Requests refused before reaching the engine, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "kvpool_worker_kv_transfer_bytes",
            "KV bytes moved between workers, by direction.",
            ["model_name", "direction"],
            registry=r,
        )
        self.kv_transfer_blocks = Counter(
            "kvpool_worker_kv_transfer_blocks",
            "KV blocks moved between workers, by direction.",
            ["model_name", "direction"],
            registry=r,
        )
        self.kv_transfer_fallbacks = Counter(
            "kvpool_worker_kv_transfer_fallbacks",
            "Remote prefills that failed and were computed here.",
            labels,
            registry=r,
        ).labels(model_name)
        self.kv_pins_expired = Counter(
            "kvpool_worker_kv_pins_expired",
            "Pinned prefills freed because nobody pulled them in time.",
            labels,
            registry=r,
        ).labels(model_name)
        self.kv_pull_seconds = histogram(
            "kvpool_worker_kv_pull_seconds",
            "Time to pull a remote prefill's KV blocks.",
            TTFT_BUCKETS,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def transferred(self, direction: str, blocks: int, nbytes: int) -> None:
        self.kv_transfer_blocks.labels(self.model_name, direction).inc(blocks)
        self.kv_transfer_bytes.labels(self.model_name, direction).inc(nbytes)


class RequestTimer:
    """Latency of one engine request, observed as its outputs arrive."""

    def __init__(self, metrics: WorkerMetrics, arrival: float) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.first: float | None = None  # when its first token came
        self.last: float | None = None
        self.end: float | None = None  # when its last output came
        self.finish_reason: str | None = None

    def observe(self, output: RequestOutput, at: float) -> None:
        m = self.metrics
        if output.new_token_ids:
            if self.last is None:
                m.ttft.observe(at - self.arrival)
                self.first = at
            else:
                m.itl.observe((at - self.last) / len(output.new_token_ids))
            self.last = at
        if output.finished:
            self.end, self.finish_reason = at, output.finish_reason
            m.e2e.observe(at - self.arrival)
            m.request_prompt_tokens.observe(output.num_prompt_tokens)
            m.request_generation_tokens.observe(output.num_output_tokens)
            m.request_success.labels(m.model_name, output.finish_reason or "stop").inc()
