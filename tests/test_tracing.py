"""OpenTelemetry traces: one trace across the router and the worker, off unless asked for.

The router, the workers and the test share one process here, so one SDK provider with an
in-memory exporter (installed with :func:`kvpool.tracing.use_provider`) captures every
side's spans; across processes the same trace is joined through the ``traceparent`` header.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kvpool import tracing

from conftest import TEST_POOL_SECRET, RunningRouter, RunningWorker
from recording_worker import RecordingWorker

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"

ROUTER_SPANS = {
    "kvpool.router.proxy.request",
    "kvpool.router.tokenize",
    "kvpool.router.decide",
    "kvpool.router.proxy.upstream",
}
WORKER_SPANS = {
    "kvpool.worker.request",
    "kvpool.worker.queue",
    "kvpool.worker.prefill",
    "kvpool.worker.decode",
}

PROMPT = (
    "A router in front of a pool of inference workers reads every prompt, cuts it into blocks "
    "of sixteen tokens, and hashes each block together with the hash of the block before it."
)  # 56 tokens


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, every finished span kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


def trace_of(
    exporter: InMemorySpanExporter, trace_id: str, names: set[str], timeout: float = 20.0
) -> dict[str, list[ReadableSpan]]:
    """The finished spans of one trace by name, once all of ``names`` are among them (the
    last of a streamed answer's spans end just after the client has read it)."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[str, list[ReadableSpan]] = {}
        for s in exporter.get_finished_spans():
            if s.context is not None and f"{s.context.trace_id:032x}" == trace_id:
                found.setdefault(s.name, []).append(s)
        if names <= set(found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"spans missing from trace {trace_id}: {names - set(found)}")
        time.sleep(0.02)


def one(found: dict[str, list[ReadableSpan]], name: str) -> ReadableSpan:
    assert len(found[name]) == 1, [s.name for s in found[name]]
    return found[name][0]


def span_id(s: ReadableSpan) -> int:
    assert s.context is not None
    return s.context.span_id


def parent_id(s: ReadableSpan) -> int | None:
    return s.parent.span_id if s.parent is not None else None


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """A request's usage (streamed or not), after reading the whole answer."""
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


@pytest.fixture
def pool(
    start_worker: Callable[..., RunningWorker], start_router: Callable[..., RunningRouter]
) -> tuple[RunningRouter, RunningWorker]:
    worker = start_worker()
    router = start_router(worker=[worker.url])
    router.wait_workers_up(1)
    return router, worker


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_router_and_worker_spans_share_the_clients_trace(
    spans: InMemorySpanExporter, pool: tuple[RunningRouter, RunningWorker], stream: bool
) -> None:
    router, worker = pool
    body = {"model": worker.worker.model_name, "prompt": PROMPT, "max_tokens": 5}
    body |= {"temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    usage = post(router.url, "/v1/completions", body, {"traceparent": TRACEPARENT})

    found = trace_of(spans, TRACE_ID, ROUTER_SPANS | WORKER_SPANS)
    request = one(found, "kvpool.router.proxy.request")
    upstream = one(found, "kvpool.router.proxy.upstream")
    decide = one(found, "kvpool.router.decide")
    worker_request = one(found, "kvpool.worker.request")
    queue, prefill, decode = (
        one(found, f"kvpool.worker.{phase}") for phase in ("queue", "prefill", "decode")
    )
    # The client's span is the router's parent; the router's attempt is the worker's.
    assert parent_id(request) == int(CLIENT_SPAN_ID, 16)
    assert parent_id(one(found, "kvpool.router.tokenize")) == span_id(request)
    assert parent_id(decide) == span_id(request)
    assert parent_id(worker_request) == span_id(upstream)
    for phase in (queue, prefill, decode):
        assert parent_id(phase) == span_id(worker_request)
    # The decision says why.
    assert decide.attributes is not None and decide.attributes["kvpool.reason"]
    assert decide.attributes["kvpool.worker"] == upstream.attributes["kvpool.worker"]  # type: ignore[index]
    # The worker's request names the same request and what it did.
    attrs = worker_request.attributes
    assert attrs is not None and request.attributes is not None
    assert attrs["kvpool.request_id"] == request.attributes["kvpool.request_id"]
    assert attrs["kvpool.prompt_tokens"] == usage["prompt_tokens"] == 56
    assert attrs["kvpool.output_tokens"] == usage["completion_tokens"] == 5
    assert attrs["kvpool.cached_tokens"] == 0
    assert attrs["kvpool.finish_reason"] == "length"
    assert attrs["kvpool.stream"] is stream
    # The phases follow each other without a gap, inside the worker's request.
    assert worker_request.start_time is not None and worker_request.end_time is not None
    assert queue.start_time is not None and queue.end_time is not None
    assert prefill.end_time is not None and decode.end_time is not None
    assert worker_request.start_time <= queue.start_time <= queue.end_time
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert decode.end_time == worker_request.end_time
    assert prefill.start_time < prefill.end_time and decode.start_time < decode.end_time  # type: ignore[operator]
    assert all(s.status.status_code is not StatusCode.ERROR for v in found.values() for s in v)


def test_a_cached_prompt_shows_in_the_workers_prefill_span(
    spans: InMemorySpanExporter, pool: tuple[RunningRouter, RunningWorker]
) -> None:
    router, worker = pool
    body = {"model": worker.worker.model_name, "prompt": PROMPT, "max_tokens": 2}
    post(router.url, "/v1/completions", body, {})
    again = f"00-{'ab' * 16}-{'cd' * 8}-01"
    post(router.url, "/v1/completions", body, {"traceparent": again})
    found = trace_of(spans, "ab" * 16, WORKER_SPANS)
    prefill = one(found, "kvpool.worker.prefill").attributes
    assert prefill is not None
    assert prefill["kvpool.prompt_tokens"] == 56
    assert prefill["kvpool.cached_tokens"] == 48  # three full blocks of 16
    assert one(found, "kvpool.router.decide").attributes["kvpool.cached_tokens"] == 48  # type: ignore[index]


def test_a_request_without_traceparent_starts_its_own_trace(
    spans: InMemorySpanExporter, pool: tuple[RunningRouter, RunningWorker]
) -> None:
    router, worker = pool
    body = {"model": worker.worker.model_name, "prompt": "hello there", "max_tokens": 2}
    post(router.url, "/v1/completions", body, {})
    deadline = time.monotonic() + 20
    while not any(s.name == "kvpool.worker.request" for s in spans.get_finished_spans()):
        assert time.monotonic() < deadline, "no worker span"
        time.sleep(0.02)
    root = next(s for s in spans.get_finished_spans() if s.name == "kvpool.router.proxy.request")
    assert root.parent is None and root.context is not None
    found = trace_of(spans, f"{root.context.trace_id:032x}", ROUTER_SPANS | WORKER_SPANS)
    assert parent_id(one(found, "kvpool.worker.request")) == span_id(
        one(found, "kvpool.router.proxy.upstream")
    )


def test_an_aborted_stream_still_leaves_its_worker_spans(
    spans: InMemorySpanExporter, start_worker: Callable[..., RunningWorker]
) -> None:
    # A slow simulated engine (50 ms a decode step): the client leaves long before the end.
    worker = start_worker(engine="sim", sim_d=50.0)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        worker.url + "/v1/completions",
        json=body,
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    found = trace_of(spans, TRACE_ID, WORKER_SPANS)
    request = one(found, "kvpool.worker.request")
    assert parent_id(request) == int(CLIENT_SPAN_ID, 16)
    assert request.attributes is not None
    assert request.attributes["kvpool.finish_reason"] == "abort"
    assert 1 <= request.attributes["kvpool.output_tokens"] < 400  # type: ignore[operator]
    assert one(found, "kvpool.worker.decode").end_time == request.end_time


def test_each_prompt_of_a_batched_completion_gets_its_own_phases(
    spans: InMemorySpanExporter, start_worker: Callable[..., RunningWorker]
) -> None:
    worker = start_worker()
    r = httpx.post(
        worker.url + "/v1/completions",
        json={"prompt": ["hello there", PROMPT], "max_tokens": 3, "ignore_eos": True},
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    found = trace_of(spans, TRACE_ID, WORKER_SPANS)
    request = one(found, "kvpool.worker.request")
    assert request.attributes is not None
    assert request.attributes["kvpool.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert request.attributes["kvpool.output_tokens"] == 6
    for phase in ("queue", "prefill", "decode"):
        phases = found[f"kvpool.worker.{phase}"]
        assert sorted(s.attributes["kvpool.choice"] for s in phases) == [0, 1]  # type: ignore[index]
        assert all(parent_id(s) == span_id(request) for s in phases)


def test_an_engine_failure_marks_the_workers_request_span_as_an_error(
    spans: InMemorySpanExporter, start_worker: Callable[..., RunningWorker], llama_dir: Any
) -> None:
    from kvpool.worker.engine import EngineConfig
    from kvpool.worker.sim import SimEngine

    def broken(sink: Any) -> SimEngine:
        engine = SimEngine.from_model_dir(llama_dir, EngineConfig(num_blocks=128), event_sink=sink)

        def fail(batch: Any) -> Any:
            raise RuntimeError("the device fell over")

        engine._execute = fail  # type: ignore[method-assign]
        return engine

    worker = start_worker(engine="sim", engine_factory=broken)
    r = httpx.post(
        worker.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 3},
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    )
    assert r.status_code == 500
    found = trace_of(spans, TRACE_ID, {"kvpool.worker.request", "kvpool.worker.prefill"})
    request = one(found, "kvpool.worker.request")
    assert request.attributes is not None
    assert request.attributes["kvpool.finish_reason"] == "error"
    assert request.status.status_code is StatusCode.ERROR
    assert "kvpool.worker.decode" not in found  # it never made a token


def test_a_split_request_traces_both_legs_and_the_kv_pull(
    spans: InMemorySpanExporter,
    start_worker: Callable[..., RunningWorker],
    start_router: Callable[..., RunningRouter],
) -> None:
    def pd_worker(role: str) -> RunningWorker:
        return start_worker(
            role=role, kv_events_endpoint="tcp://127.0.0.1:*", pool_secret=TEST_POOL_SECRET
        )

    p, d = pd_worker("prefill"), pd_worker("decode")
    router = start_router(
        pool_secret=TEST_POOL_SECRET,
        worker=[f"{p.url},role=prefill", f"{d.url},role=decode"],
        pd_mode="Auto",
        pd_threshold_tokens=40,
    )
    router.wait_workers_up(2)
    body = {"model": p.worker.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    post(router.url, "/v1/completions", body, {"traceparent": TRACEPARENT})
    names = {"kvpool.router.prefill_leg", "kvpool.worker.kv_pull"} | WORKER_SPANS
    found = trace_of(spans, TRACE_ID, names)
    by_role = {s.attributes["kvpool.role"]: s for s in found["kvpool.worker.request"]}  # type: ignore[index]
    assert set(by_role) == {"prefill", "decode"}
    assert parent_id(by_role["prefill"]) == span_id(one(found, "kvpool.router.prefill_leg"))
    assert parent_id(by_role["decode"]) == span_id(one(found, "kvpool.router.proxy.upstream"))
    pull = one(found, "kvpool.worker.kv_pull")
    assert parent_id(pull) == span_id(by_role["decode"])
    assert pull.attributes is not None and pull.attributes["kvpool.blocks"] == 3
    assert pull.status.status_code is not StatusCode.ERROR
    # The decode worker's queue starts once the pulled blocks are in.
    decode_queue = next(
        s for s in found["kvpool.worker.queue"] if parent_id(s) == span_id(by_role["decode"])
    )
    assert pull.end_time is not None and decode_queue.start_time is not None
    assert pull.end_time <= decode_queue.start_time
    assert by_role["decode"].attributes["kvpool.cached_tokens"] == 48  # type: ignore[index]


# -- off by default, and the standard variables --------------------------------------------


@pytest.fixture
def tracing_reset() -> Iterator[None]:
    tracing.use_provider(None)
    yield
    tracing.use_provider(None)


def test_tracing_is_off_without_otel_variables(tracing_reset: None) -> None:
    assert tracing.configure("kvpool-test", env={}) is False
    assert tracing.tracer() is None
    headers: dict[str, str] = {}
    tracing.inject(headers)
    assert headers == {}  # nothing to pass on
    with tracing.span("kvpool.test") as s:
        assert s is None


def test_otel_traces_exporter_turns_tracing_on_with_the_service_name(
    tracing_reset: None,
) -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "my-router"}
    assert tracing.configure("kvpool-router", env=env) is True
    tracer = tracing.tracer()
    assert tracer is not None
    assert tracer.resource.attributes["service.name"] == "my-router"
    # Another component in the same process keeps the provider there is.
    assert tracing.configure("kvpool-worker", env=env) is True
    assert tracing.tracer() is tracer


def test_an_otlp_endpoint_alone_turns_tracing_on(tracing_reset: None) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracing.configure("kvpool-worker", env=env) is True
    assert tracing.tracer().resource.attributes["service.name"] == "kvpool-worker"


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"},
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
    ],
    ids=["sdk-disabled", "exporter-none"],
)
def test_otel_variables_that_say_off_keep_tracing_off(
    tracing_reset: None, env: dict[str, str]
) -> None:
    assert tracing.configure("kvpool-router", env=env) is False
    assert tracing.tracer() is None


def test_an_unknown_exporter_is_logged_and_leaves_tracing_off(
    tracing_reset: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvpool.tracing"):
        assert tracing.configure("kvpool-router", env={"OTEL_TRACES_EXPORTER": "zipkin"}) is False
    assert tracing.tracer() is None
    assert "OTEL_TRACES_EXPORTER=zipkin" in caplog.text


@pytest.mark.parametrize(
    ("protocol", "says"),
    [
        ("grpc", "pip install opentelemetry-exporter-otlp-proto-grpc"),
        ("http/json", "OTLP protocol 'http/json' is not one kvpool sends"),
    ],
)
def test_an_otlp_protocol_it_cannot_send_is_logged_not_sent_the_wrong_way(
    tracing_reset: None, caplog: pytest.LogCaptureFixture, protocol: str, says: str
) -> None:
    # gRPC on port 4317 answers nothing to HTTP: sending protobuf over HTTP there anyway
    # would lose every span without a word. (The grpc exporter is not in the extra.)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = protocol
    with caplog.at_level(logging.WARNING, logger="kvpool.tracing"):
        assert tracing.configure("kvpool-router", env=env) is False
    assert tracing.tracer() is None
    assert says in caplog.text


def test_with_tracing_off_the_router_passes_the_clients_trace_headers_on_unchanged(
    tracing_reset: None, start_router: Callable[..., RunningRouter], llama_dir: Any
) -> None:
    with RecordingWorker(name=llama_dir.name) as worker:
        router = start_router(worker=[worker.spec("a")])
        router.wait_workers_up(1)
        sent = {"traceparent": TRACEPARENT, "tracestate": "vendor=opaque"}
        body = {"model": llama_dir.name, "prompt": "hello there", "max_tokens": 2}
        post(router.url, "/v1/completions", body, sent)
        (got,) = worker.generation_requests()
        assert got.headers["traceparent"] == TRACEPARENT
        assert got.headers["tracestate"] == "vendor=opaque"
        router.stop()


def test_with_tracing_off_a_worker_request_takes_no_trace_times(
    tracing_reset: None, start_worker: Callable[..., RunningWorker]
) -> None:
    worker = start_worker()
    seen: list[Any] = []
    engine = worker.engine
    submit = engine.submit

    def spy(prepared: Any, stream: Any) -> None:
        seen.append(prepared.seq)
        submit(prepared, stream)

    engine.submit = spy
    r = httpx.post(
        worker.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 2},
        headers={"traceparent": TRACEPARENT},
        timeout=30,
    )
    assert r.status_code == 200
    (seq,) = seen
    assert seq.traced is False and seq.scheduled_at is None
