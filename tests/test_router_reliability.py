"""The router when workers fail: retries before the first byte, terminal SSE errors after
it, circuit breakers, timeouts, its concurrency bound, graceful shutdown, dead, draining and
mismatched workers, and the OpenAI error JSON bad input gets.

Workers that misbehave are real HTTP servers on 127.0.0.1 (:class:`FakeWorker`, uvicorn in
a thread): they answer ``/health`` and ``/v1/models`` like a vLLM worker (no
``/kvpool/info``) and do on ``/v1/completions`` what the test tells them. Dead, draining
and mismatched workers are real ``kvpool worker serve --engine sim`` processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from conftest import RunningRouter
from recording_worker import serve_in_thread

pytestmark = pytest.mark.timeout(60)

#: long enough for a prompt to fill a few blocks of 16 tokens
PROMPT = "the quick brown fox jumps over the lazy dog " * 12


class _Cut(Exception):
    """Raised inside a streamed response: uvicorn drops the connection mid-body."""


class FakeWorker:
    """A worker on 127.0.0.1 that misbehaves as told.

    ``mode`` says what ``/v1/completions`` does:

    * ``ok``: answers (a JSON completion, or three SSE chunks and ``[DONE]``);
    * ``500``, ``503``, ``429``, ``400``: answers that status with an OpenAI error body;
    * ``stall``: sends nothing until :attr:`gate` opens, then answers;
    * ``cut``: streams two chunks (or half its JSON answer), then drops the connection;
    * ``early_end``: streams two chunks, then ends the body cleanly without ``[DONE]``;
    * ``hang``: streams two chunks, then waits for :attr:`gate` before the rest.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.mode = "ok"
        self.health_status = 200
        self.completions = 0  # /v1/completions requests received
        self.gate = threading.Event()
        app = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )
        self.server, self.thread, self.port = serve_in_thread(app, "fake-worker")
        self.url = f"http://127.0.0.1:{self.port}"

    def spec(self, worker_id: str) -> str:
        return f"{self.url},id={worker_id}"

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"}, status_code=self.health_status)

    async def _models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}
        return JSONResponse({"object": "list", "data": [card]})

    async def _completions(self, request: Request) -> Response:
        self.completions += 1
        body = await request.json()
        mode = self.mode
        if mode in ("500", "503", "429", "400"):
            kind = "invalid_request_error" if mode == "400" else "server_error"
            error = {"message": f"fake {mode}", "type": kind, "param": None}
            headers = {"Retry-After": "1"} if mode == "429" else None
            return JSONResponse({"error": {**error, "code": None}}, int(mode), headers)
        if mode == "stall":
            await self._wait()
        if body.get("stream"):
            return StreamingResponse(self._stream(mode), media_type="text/event-stream")
        if mode == "cut":
            return StreamingResponse(self._half_json(), media_type="application/json")
        return JSONResponse(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "text": "abc", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            }
        )

    async def _stream(self, mode: str) -> AsyncIterator[bytes]:
        for text in ("a", "b"):
            yield _chunk(text, None)
        if mode == "cut":
            raise _Cut("the worker died mid-stream")
        if mode == "early_end":
            return
        if mode == "hang":
            await self._wait()
        yield _chunk("c", "length")
        yield b"data: [DONE]\n\n"

    async def _half_json(self) -> AsyncIterator[bytes]:
        yield b'{"id": "cmpl-fake", "choices": ['
        raise _Cut("the worker died while answering")

    async def _wait(self) -> None:
        while not self.gate.is_set():  # noqa: ASYNC110  (the gate is opened from another thread)
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        self.gate.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _chunk(text: str, finish_reason: str | None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return b"data: " + json.dumps({"id": "cmpl-fake", "choices": [choice]}).encode() + b"\n\n"


@pytest.fixture
def fake_workers(
    llama_dir: Path, start_router: Callable[..., RunningRouter]
) -> Iterator[Callable[[int], list[FakeWorker]]]:
    """Start ``n`` fake workers serving the test model's name. They stop before the routers
    (this fixture asks for ``start_router`` so it is torn down first): nothing a router
    waits on at its shutdown still hangs."""
    started: list[FakeWorker] = []

    def start(n: int) -> list[FakeWorker]:
        fakes = [FakeWorker(llama_dir.name) for _ in range(n)]
        started.extend(fakes)
        return fakes

    yield start
    for fake in started:
        fake.stop()


@pytest.fixture
def one_fake(
    fake_workers: Callable[[int], list[FakeWorker]], start_router: Callable[..., RunningRouter]
) -> Callable[..., tuple[FakeWorker, RunningRouter, str]]:
    """A router (settings as keywords) in front of one fake worker "a" in ``mode``; returns
    the worker, the router and its completions URL."""

    def start(mode: str, **settings: Any) -> tuple[FakeWorker, RunningRouter, str]:
        (fake,) = fake_workers(1)
        fake.mode = mode
        router = start_router(worker=[fake.spec("a")], **settings)
        router.wait_workers_up(1)
        return fake, router, router.url + "/v1/completions"

    return start


def body(llama_dir: Path, **extra: Any) -> dict[str, Any]:
    return {"model": llama_dir.name, "prompt": PROMPT, "max_tokens": 4, **extra}


def sse_data(lines: Iterator[str]) -> list[str]:
    """The ``data:`` payloads of an SSE stream, in order."""
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def candidate(route: dict[str, Any], worker: str) -> dict[str, Any]:
    return next(c for c in route["candidates"] if c["worker"] == worker)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    """The OpenAI error body of a response, checked for its shape."""
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- retries before the first byte ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    ("mode", "reason"), [("500", "5xx"), ("503", "5xx"), ("429", "overloaded")]
)
def test_worker_error_before_the_first_byte_is_retried_on_another_worker_unseen(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
    mode: str,
    reason: str,
    stream: bool,
) -> None:
    bad, good = fake_workers(2)
    bad.mode = mode
    # Round-robin over the ids in order: the first request goes to "a" first.
    router = start_router(worker=[bad.spec("a"), good.spec("b")], policy="round-robin")
    router.wait_workers_up(2)

    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir, stream=stream))

    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvpool-worker"] == "b"
    if stream:
        assert sse_data(resp.iter_lines())[-1] == "[DONE]"
        assert '"error"' not in resp.text
    else:
        assert resp.json()["choices"][0]["text"] == "abc"
    assert (bad.completions, good.completions) == (1, 1)
    assert router.metric("kvpool_router_retries_total", reason=reason) == 1
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="success") == 1)


def test_refused_connection_is_retried_on_another_worker_and_marks_the_first_down(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    dead, good = fake_workers(2)
    # Health checks too rare to notice the death first: the request finds it.
    router = start_router(
        worker=[dead.spec("a"), good.spec("b")], policy="round-robin", health_interval_s=60
    )
    router.wait_workers_up(2)
    dead.stop()

    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir))

    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvpool-worker"] == "b"
    assert router.metric("kvpool_router_retries_total", reason="connect") == 1
    assert router.workers()["a"]["status"] == "down"


def test_all_workers_failing_gives_openai_error_json_after_bounded_attempts_with_backoff(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    fakes = fake_workers(3)
    for fake in fakes:
        fake.mode = "500"
    router = start_router(
        worker=[f.spec(n) for f, n in zip(fakes, "abc", strict=True)],
        max_attempts=2,
        retry_backoff_s=0.3,
    )
    router.wait_workers_up(3)

    t0 = time.monotonic()
    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir), timeout=10)
    elapsed = time.monotonic() - t0

    assert resp.status_code == 502
    err = error_of(resp)
    assert (err["type"], err["code"]) == ("server_error", "worker_unavailable")
    assert "2 worker(s)" in err["message"] and "500 fake 500" in err["message"]
    assert sum(f.completions for f in fakes) == 2  # max_attempts, not every worker
    assert 0.3 <= elapsed < 3.0  # one backoff, and no hang
    assert router.metric("kvpool_router_retries_total", reason="5xx") == 1
    assert router.metric("kvpool_router_requests_total", outcome="worker_error") == 1


def test_a_lone_failing_worker_is_not_counted_as_retried(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    (fake,) = fake_workers(1)
    fake.mode = "503"
    router = start_router(worker=[fake.spec("a")])
    router.wait_workers_up(1)

    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir))

    assert resp.status_code == 502
    assert error_of(resp)["code"] == "worker_unavailable"
    assert fake.completions == 1
    assert router.metric("kvpool_router_retries_total", reason="5xx") == 0


def test_worker_dying_while_writing_a_json_answer_is_retried_on_another_worker(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    bad, good = fake_workers(2)
    bad.mode = "cut"  # 200 and its headers, then half the body and a dropped connection
    router = start_router(worker=[bad.spec("a"), good.spec("b")], policy="round-robin")
    router.wait_workers_up(2)

    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir))

    # Nothing had reached the client: it sees the other worker's whole answer.
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvpool-worker"] == "b"
    assert resp.json()["choices"][0]["text"] == "abc"
    assert (bad.completions, good.completions) == (1, 1)
    assert router.metric("kvpool_router_retries_total", reason="connection") == 1


# -- circuit breaker -----------------------------------------------------------------------


def test_circuit_breaker_keeps_a_failing_worker_out_until_its_cooldown_passes(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    bad, good = fake_workers(2)
    bad.mode = "500"
    cooldown = 1.5
    router = start_router(
        worker=[bad.spec("a"), good.spec("b")],
        policy="round-robin",
        breaker_failures=2,
        breaker_cooldown_s=cooldown,
    )
    router.wait_workers_up(2)
    url = router.url + "/v1/completions"

    # Round-robin tries "a" first for both: two failures in a row open its breaker.
    assert httpx.post(url, json=body(llama_dir)).status_code == 200
    opened = time.monotonic()  # a little before the second failure
    assert httpx.post(url, json=body(llama_dir)).status_code == 200
    assert bad.completions == 2
    assert router.workers()["a"]["circuit_open"] is True
    assert candidate(router.route(body(llama_dir)), "a")["filtered"] == "healthy: circuit_open"

    for _ in range(4):
        resp = httpx.post(url, json=body(llama_dir))
        assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "b"
    assert bad.completions == 2
    assert time.monotonic() - opened < cooldown  # all of that was within the cooldown

    # After the cooldown one trial request may go to "a"; it succeeds and closes the breaker.
    bad.mode = "ok"
    router.wait_for(lambda: not router.workers()["a"]["circuit_open"], timeout=cooldown + 5)
    assert time.monotonic() - opened >= cooldown
    served = {httpx.post(url, json=body(llama_dir)).headers["x-kvpool-worker"] for _ in range(2)}
    assert served == {"a", "b"}
    assert bad.completions == 3
    assert candidate(router.route(body(llama_dir)), "a")["filtered"] is None


def test_a_request_that_fails_on_every_worker_opens_no_circuit_breaker(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    """A request that makes every worker answer 500 is more likely bad than every worker
    broken: a few of them must not shut the whole pool out."""
    fakes = fake_workers(3)
    for fake in fakes:
        fake.mode = "500"
    router = start_router(
        worker=[f.spec(n) for f, n in zip(fakes, "abc", strict=True)], breaker_failures=2
    )
    router.wait_workers_up(3)
    url = router.url + "/v1/completions"
    for _ in range(3):
        assert httpx.post(url, json=body(llama_dir)).status_code == 502
    assert not any(w["circuit_open"] for w in router.workers().values())
    for fake in fakes:
        fake.mode = "ok"
    assert httpx.post(url, json=body(llama_dir)).status_code == 200


@pytest.mark.parametrize("trial", ["429", "400", "client_left"])
def test_breaker_trial_ending_without_a_verdict_does_not_keep_the_worker_out_for_good(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
    trial: str,
) -> None:
    """The half-open trial may end in neither a success nor a worker failure: the worker
    was busy (429), the request was bad (400), or the client left. Another trial follows."""
    (worker,) = fake_workers(1)
    worker.mode = "cut"  # its answer breaks off: the worker's own failure
    cooldown = 0.5
    router = start_router(
        worker=[worker.spec("a")], breaker_failures=1, breaker_cooldown_s=cooldown
    )
    router.wait_workers_up(1)
    url = router.url + "/v1/completions"
    assert httpx.post(url, json=body(llama_dir)).status_code == 502
    assert router.workers()["a"]["circuit_open"] is True
    router.wait_for(lambda: not router.workers()["a"]["circuit_open"], timeout=5)

    if trial == "client_left":
        worker.mode = "hang"
        with (
            httpx.Client(timeout=5) as client,
            client.stream("POST", url, json=body(llama_dir, stream=True)) as resp,
        ):
            assert next(resp.iter_lines()).startswith("data:")
        worker.gate.set()
    else:
        worker.mode = trial
        assert httpx.post(url, json=body(llama_dir)).status_code == int(trial)
    assert worker.completions == 2

    worker.mode = "ok"
    router.wait_for(lambda: not router.workers()["a"]["circuit_open"], timeout=cooldown + 5)
    resp = httpx.post(url, json=body(llama_dir))
    assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "a"
    assert worker.completions == 3


# -- failures after the first byte ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["cut", "early_end"], ids=["connection_dropped", "no_done"])
def test_worker_failing_mid_stream_ends_the_stream_with_an_error_event_and_done(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
    mode: str,
) -> None:
    (fake,) = fake_workers(1)
    fake.mode = mode
    router = start_router(worker=[fake.spec("a")])
    router.wait_workers_up(1)

    t0 = time.monotonic()
    with (
        httpx.Client(timeout=5) as client,  # a hang would be a ReadTimeout
        client.stream(
            "POST", router.url + "/v1/completions", json=body(llama_dir, stream=True)
        ) as resp,
    ):
        assert resp.status_code == 200
        events = sse_data(resp.iter_lines())
    assert time.monotonic() - t0 < 3

    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert len(events) == 4 and events[-1] == "[DONE]"
    err = json.loads(events[2])["error"]
    assert (err["type"], err["code"]) == ("server_error", "worker_failed")
    assert "a" in err["message"]
    assert fake.completions == 1  # never retried: the client had its first bytes
    router.wait_for(
        lambda: router.metric("kvpool_router_requests_total", outcome="stream_error") == 1
    )
    assert router.router.active == 0
    assert router.workers()["a"]["in_flight"] == 0


# -- the request timeout -------------------------------------------------------------------


def test_worker_that_never_answers_gets_a_504_at_the_request_timeout(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    stalled, other = fake_workers(2)
    stalled.mode = other.mode = "stall"
    router = start_router(
        worker=[stalled.spec("a"), other.spec("b")], policy="round-robin", request_timeout_s=0.5
    )
    router.wait_workers_up(2)

    t0 = time.monotonic()
    resp = httpx.post(router.url + "/v1/completions", json=body(llama_dir), timeout=10)
    elapsed = time.monotonic() - t0

    assert resp.status_code == 504, resp.text
    err = error_of(resp)
    assert (err["type"], err["code"]) == ("server_error", "timeout")
    assert 0.5 <= elapsed < 2.0
    # The request's time was spent: it is not sent on to another worker.
    assert (stalled.completions, other.completions) == (1, 0)
    assert router.metric("kvpool_router_retries_total", reason="timeout") == 0
    assert router.metric("kvpool_router_requests_total", outcome="timeout") == 1


def test_stream_that_stalls_after_its_first_chunk_ends_with_a_timeout_event(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    (fake,) = fake_workers(1)
    fake.mode = "hang"
    router = start_router(worker=[fake.spec("a")], stream_idle_timeout_s=1.0)
    router.wait_workers_up(1)

    t0 = time.monotonic()
    with (
        httpx.Client(timeout=5) as client,
        client.stream(
            "POST", router.url + "/v1/completions", json=body(llama_dir, stream=True)
        ) as resp,
    ):
        assert resp.status_code == 200
        events = sse_data(resp.iter_lines())
    elapsed = time.monotonic() - t0

    assert 1.0 <= elapsed < 3.0
    assert len(events) == 4 and events[-1] == "[DONE]"
    err = json.loads(events[2])["error"]
    assert (err["type"], err["code"]) == ("server_error", "timeout")
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="timeout") == 1)
    assert router.router.active == 0


# -- the concurrency bound -----------------------------------------------------------------


def test_request_over_the_concurrency_limit_gets_429_with_retry_after(
    llama_dir: Path,
    one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]],
) -> None:
    # Without flow control the bound refuses at once (with it, the request waits: below).
    fake, router, url = one_fake("hang", max_concurrency=1, flow_control=False)

    with (
        httpx.Client(timeout=5) as client,
        client.stream("POST", url, json=body(llama_dir, stream=True)) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")  # the stream is in flight

        refused = httpx.post(url, json=body(llama_dir))
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        err = error_of(refused)
        assert (err["type"], err["code"]) == ("rate_limit_error", "too_many_requests")

        fake.gate.set()
        assert sse_data(lines)[-1] == "[DONE]"

    assert fake.completions == 1  # the refused request never reached a worker
    assert router.metric("kvpool_router_requests_total", outcome="overloaded") == 1
    # The slot is free again once the stream is over.
    router.wait_for(lambda: router.router.active == 0)
    assert httpx.post(url, json=body(llama_dir)).status_code == 200


def test_request_over_the_concurrency_limit_waits_its_turn_with_flow_control(
    llama_dir: Path,
    one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]],
) -> None:
    fake, router, url = one_fake("hang", max_concurrency=1)

    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", url, json=body(llama_dir, stream=True)) as resp,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")  # the stream holds the only slot
        waiting = pool.submit(httpx.post, url, json=body(llama_dir), timeout=10)
        router.wait_for(
            lambda: router.metric("kvpool_router_queue_depth", band="normal") == 1, timeout=5
        )
        assert fake.completions == 1  # it waits in the router, not at the worker
        fake.gate.set()
        assert sse_data(lines)[-1] == "[DONE]"
        assert waiting.result().status_code == 200

    assert fake.completions == 2
    assert router.metric("kvpool_router_requests_total", outcome="overloaded") == 0
    assert router.metric("kvpool_router_saturated_total", reason="concurrency") == 1
    assert router.metric("kvpool_router_queue_wait_seconds_count", band="normal") == 1
    router.wait_for(lambda: router.router.active == 0)


def test_client_leaving_mid_stream_frees_its_slot_and_its_worker(
    llama_dir: Path,
    one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]],
) -> None:
    fake, router, url = one_fake("hang", max_concurrency=1)

    with (
        httpx.Client(timeout=5) as client,
        client.stream("POST", url, json=body(llama_dir, stream=True)) as resp,
    ):
        assert next(resp.iter_lines()).startswith("data:")
    # The client closed its connection with the worker still hanging.

    router.wait_for(lambda: router.router.active == 0, timeout=5)
    assert router.workers()["a"]["in_flight"] == 0
    router.wait_for(lambda: router.metric("kvpool_router_requests_total", outcome="cancelled") == 1)
    fake.mode = "ok"
    assert httpx.post(url, json=body(llama_dir)).status_code == 200


# -- graceful shutdown ---------------------------------------------------------------------


def test_shutdown_lets_the_stream_in_flight_finish_and_refuses_new_requests(
    llama_dir: Path,
    one_fake: Callable[..., tuple[FakeWorker, RunningRouter, str]],
) -> None:
    fake, router, url = one_fake("hang", drain_timeout_s=10)

    with (
        httpx.Client(timeout=5) as client,
        client.stream("POST", url, json=body(llama_dir, stream=True)) as resp,
    ):
        lines = resp.iter_lines()
        assert next(lines).startswith("data:")

        router.server.handle_exit(signal.SIGTERM, None)  # what SIGTERM does

        # New work is refused: a 503 while the socket is open, a refused connection after
        # (or one reset, when it was accepted just as the listening socket closed).
        refusals = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)
        try:
            health = httpx.get(router.url + "/health", timeout=5)
        except refusals:
            pass
        else:
            assert health.status_code == 503 and health.json()["status"] == "draining"
        try:
            refused = httpx.post(url, json=body(llama_dir), timeout=5)
        except refusals:
            pass
        else:
            assert refused.status_code == 503
            assert error_of(refused)["code"] == "draining"
        router.wait_for(lambda: not _accepts_connections(router.url), timeout=5)
        assert router.thread.is_alive()  # still draining the stream

        fake.gate.set()
        rest = sse_data(lines)
    assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)
    assert fake.completions == 1
    router.thread.join(timeout=10)
    assert not router.thread.is_alive()


def _accepts_connections(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return False  # refused, or reset as the listening socket closed
    return True


# -- dead, draining and mismatched workers (real sim worker processes) ---------------------


@pytest.mark.timeout(120)
def test_killed_worker_is_out_of_rotation_within_2_s_and_gets_no_cache_credit(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    worker_processes: Callable[..., list[Any]],
    start_router: Callable[..., RunningRouter],
) -> None:
    (sim,) = worker_processes(1)
    (other,) = fake_workers(1)
    router = start_router(worker=[f"{sim.url},id=a", other.spec("b")], policy="round-robin")
    router.wait_workers_up(2)
    url = router.url + "/v1/completions"
    resp = httpx.post(url, json=body(llama_dir))
    assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "a"
    router.wait_for(lambda: router.workers()["a"]["indexed_blocks"] > 0)  # from its events
    held = router.workers()["a"]["indexed_blocks"]

    sim.kill()
    killed = time.monotonic()
    router.wait_for(lambda: router.workers()["a"]["status"] == "down", timeout=2.0)
    assert time.monotonic() - killed < 2.0

    # Out of rotation, so nothing is credited to it; its entries wait for evidence that its
    # cache is gone (a new boot when it registers again: test_router_health_cache.py).
    assert router.workers()["a"]["indexed_blocks"] == held
    route = router.route(body(llama_dir))
    assert candidate(route, "a")["filtered"] == "healthy: unhealthy"
    assert route["worker"] == "b"  # what it held is no reason to send it anything
    assert router.metric("kvpool_router_worker_up", worker="a") == 0
    for _ in range(3):
        resp = httpx.post(url, json=body(llama_dir))
        assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "b"


@pytest.mark.timeout(120)
def test_draining_worker_gets_no_new_requests(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    worker_processes: Callable[..., list[Any]],
    start_router: Callable[..., RunningRouter],
) -> None:
    (sim,) = worker_processes(1)
    (other,) = fake_workers(1)
    router = start_router(worker=[f"{sim.url},id=a", other.spec("b")], policy="round-robin")
    router.wait_workers_up(2)
    url = router.url + "/v1/completions"
    served = {httpx.post(url, json=body(llama_dir)).headers["x-kvpool-worker"] for _ in range(2)}
    assert served == {"a", "b"}

    assert httpx.post(sim.url + "/drain", timeout=10).json()["drained"] is True
    router.wait_for(lambda: router.workers()["a"]["status"] == "unavailable", timeout=2.0)

    assert candidate(router.route(body(llama_dir)), "a")["filtered"] == "healthy: unhealthy"
    before = other.completions
    for _ in range(4):
        resp = httpx.post(url, json=body(llama_dir))
        assert resp.status_code == 200 and resp.headers["x-kvpool-worker"] == "b"
    assert other.completions == before + 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "problem"),
    [({"hash_seed": "other-seed"}, "hash seed"), ({"block_size": 32}, "block size")],
    ids=["hash_seed", "block_size"],
)
def test_worker_hashing_differently_is_reported_and_gets_no_cache_credit(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    worker_processes: Callable[..., list[Any]],
    start_router: Callable[..., RunningRouter],
    flags: dict[str, Any],
    problem: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (sim,) = worker_processes(1, **flags)
    (other,) = fake_workers(1)  # no /kvpool/info: taken to hash like the router
    router = start_router(worker=[f"{sim.url},id=a", other.spec("b")], policy="round-robin")
    router.wait_workers_up(2)

    row = router.workers()["a"]
    assert row["compatible"] is False
    assert problem in row["mismatch"]
    assert router.workers()["b"]["compatible"] is True
    assert router.metric("kvpool_router_worker_hash_mismatches_total", worker="a") == 1
    assert router.metric("kvpool_router_worker_compatible", worker="a") == 0
    logged = [
        r
        for r in caplog.records
        if r.name == "kvpool.router.state.pool" and "a: " in r.getMessage()
    ]
    assert any(r.levelno == logging.ERROR and problem in r.getMessage() for r in logged)

    # Both serve the prompt; only the compatible one is credited with it afterwards.
    prompt = body(llama_dir, prompt=PROMPT + uuid.uuid4().hex)
    url = router.url + "/v1/completions"
    served = {httpx.post(url, json=prompt).headers["x-kvpool-worker"] for _ in range(2)}
    assert served == {"a", "b"}
    route = router.route(prompt)
    assert candidate(route, "a")["filtered"] is None  # it still gets requests
    assert candidate(route, "a")["cached_tokens"] == 0
    assert candidate(route, "b")["cached_tokens"] > 0
    assert router.workers()["a"]["indexed_blocks"] == 0


# -- bad input -----------------------------------------------------------------------------

BAD_INPUT = {
    # name: (path, content, status, type, code, param); the router answers these itself
    "malformed_json": (
        "/v1/completions",
        b'{"prompt": "hi", ',
        400,
        "invalid_request_error",
        "invalid_json",
        None,
    ),
    "chat_without_messages": (
        "/v1/chat/completions",
        {"max_tokens": 3},
        400,
        "invalid_request_error",
        "invalid_value",
        "messages",
    ),
    "too_large": (
        "/v1/completions",
        {"prompt": "x" * 2000},
        413,
        "invalid_request_error",
        "request_too_large",
        None,
    ),
    "unknown_model": (
        "/v1/completions",
        {"prompt": "hi", "model": "no-such-model"},
        404,
        "NotFoundError",  # as vLLM answers it
        404,
        "model",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_the_same_openai_error_json_as_from_a_worker(
    start_worker: Callable[..., Any],
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
    case: str,
) -> None:
    path, content, status, kind, code, param = BAD_INPUT[case]
    worker = start_worker(engine="sim", max_request_body_bytes=1024)
    (fake,) = fake_workers(1)
    router = start_router(worker=[fake.spec("a")], max_request_body_bytes=1024)
    router.wait_workers_up(1)
    send: dict[str, Any] = (
        {"content": content, "headers": {"content-type": "application/json"}}
        if isinstance(content, bytes)
        else {"json": content}
    )

    answers = {
        "router": httpx.post(router.url + path, **send, timeout=10),
        "worker": httpx.post(worker.url + path, **send, timeout=10),
    }

    for who, resp in answers.items():
        assert resp.status_code == status, (who, resp.text)
        err = error_of(resp)
        assert (err["type"], err["code"], err["param"]) == (kind, code, param), (who, err)
    if param is not None and code != 404:
        assert param in answers["router"].json()["error"]["message"]
    assert fake.completions == 0  # nothing bad reaches a worker through the router
    assert router.metric("kvpool_router_requests_total", outcome="client_error") == 1


#: refusing a field is the worker's job: the router forwards these, and the worker's answer
#: reaches the client as the worker sent it
WORKER_REFUSES = {
    # (an unknown field is served, as vLLM serves it; one the engine cannot do is refused)
    "unsupported_field": ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    "bad_value": ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
}


@pytest.mark.parametrize("case", list(WORKER_REFUSES))
def test_a_field_the_router_does_not_read_is_the_workers_to_refuse(
    start_worker: Callable[..., Any],
    start_router: Callable[..., RunningRouter],
    case: str,
) -> None:
    content, param = WORKER_REFUSES[case]
    worker = start_worker(engine="sim")
    router = start_router(worker=[f"{worker.url},id=a"])
    router.wait_workers_up(1)

    through = httpx.post(router.url + "/v1/completions", json=content, timeout=10)
    direct = httpx.post(worker.url + "/v1/completions", json=content, timeout=10)

    assert through.status_code == direct.status_code == 400
    assert through.json() == direct.json()
    assert error_of(through)["param"] == param
    assert router.metric("kvpool_router_requests_total", outcome="client_error") == 1
    # the client's mistake is not the worker's failure
    assert router.workers()["a"]["circuit_open"] is False


def test_client_supplied_kv_transfer_params_are_refused(
    llama_dir: Path,
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
) -> None:
    (fake,) = fake_workers(1)
    router = start_router(worker=[fake.spec("a")])
    router.wait_workers_up(1)

    resp = httpx.post(
        router.url + "/v1/completions",
        json=body(llama_dir, kv_transfer_params={"do_remote_decode": True}),
    )

    assert resp.status_code == 400
    err = error_of(resp)
    assert (err["type"], err["param"]) == ("invalid_request_error", "kv_transfer_params")
    assert fake.completions == 0


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/completions", 404),
        ("GET", "/v1/completions", 405),
    ],
)
def test_unknown_path_or_method_gets_openai_error_json(
    fake_workers: Callable[[int], list[FakeWorker]],
    start_router: Callable[..., RunningRouter],
    method: str,
    path: str,
    status: int,
) -> None:
    (fake,) = fake_workers(1)
    router = start_router(worker=[fake.spec("a")])

    resp = httpx.request(method, router.url + path, json={})

    assert resp.status_code == status
    err = error_of(resp)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert path in err["message"]
