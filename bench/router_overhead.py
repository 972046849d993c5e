"""Router overhead: the latency the router adds, the request rate it sustains, and its
routing decision time, beside today's peer routers in the same run: the SGLang router
(``sglang-router``, ``cache_aware``), its successor the Shepherd Model Gateway (``smg``,
``cache_aware``) and vLLM's router (``vllm-router``, ``kv_aware``; the stub publishes no KV
events, so it routes on what it knows without them, as kvpool's router does here).

**Added latency and highest rate.** Four zero-latency workers (a stub in this file: it
answers ``/v1/completions`` at once, streamed or not, and the endpoints both routers probe)
serve the same open-loop load (Poisson arrivals, the same requests at the same times) sent
four ways: straight to the workers (the baseline), through a bare Python proxy (uvicorn and
kvpool's client to the workers, nothing else: the floor under any router built like
kvpool's), through ``kvpool router serve`` and through ``sglang-router launch --policy
cache_aware`` and the other peers. Added latency is a router's client
latency less the baseline's, at 200 requests/s, non-streamed completions and chats (and
streamed: time to the first body byte), over several rounds that take the targets in turn.
**Streams**: 500-token streams at ``--stream-rate`` (the stub writes each event on its own,
2 ms apart, as a decoding worker does); a router's CPU per streamed chunk is what a
500-token stream costs it beyond a 16-token one, over the 484 chunks between. The highest
sustained rate comes from a ramp of the offered load: a step is sustained when 95% of its requests
complete within the step and their p99 stays under ``--p99-limit-ms``.

On a small machine the load generator, the router and the workers compete for cores, so
the router gets one core of its own and the load generator and the workers share the rest
(``--no-pin`` turns this off); each router's CPU time per request is measured too, which
says what one core of it sustains wherever it runs. The workers are a stub, not
``kvpool worker sim-fleet --sim-time-scale 0``: a simulated worker still runs its engine
loop and costs ~3 ms of CPU per request, enough to hide a router's cost behind its own. The
stub publishes no KV events, so the kvpool router tracks it from its own decisions
(speculative entries), as it tracks a vLLM without events.

**Decision time.** The router's own pieces, in process, without HTTP: a block index of
64 workers holding a million (block, worker) entries (8k-token conversations on 64 shared
prefixes of Zipf popularity, the hot ones on many workers), then, for 8k-token prompts
(512 blocks of 16 tokens: new questions on a shared prefix, follow-ups of a cached
conversation, cold prompts), the time of what the router's decision-latency metric covers
(worker views, index lookup, policy) and, apart, of hashing the prompt and of recording
the speculative entries after it.

Writes bench/results/router_overhead.{md,json,png}. ``--quick``: a smoke run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ME = str(Path(__file__).resolve())
KVPOOL = [sys.executable, "-c", "import sys; from kvpool.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PYTHONSAFEPATH": "1"}  # never import the repository's operator/
HOST = "127.0.0.1"
MODEL_NAME = "tiny-model"

#: the peer routers (part one), by their name here and in the JSON's keys
PEERS = {"sglang": "sglang-router", "smg": "smg", "vllm-router": "vllm-router"}
#: part one's targets, taken in turn each round: the baseline, the floor, the routers
TARGETS = ("direct", "bare", "kvpool", *PEERS)
#: the output tokens of a long stream (issue 43: 500 a stream)
LONG_STREAM_TOKENS = 500

GOAL_ADDED_P50_MS = 0.5  # issue 43
GOAL_ADDED_P99_MS = 5.0
GOAL_DECISION_P99_MS = 1.0
GOAL_CPU_MS = 0.40  # router CPU per non-streamed request (issue 43)
GOAL_CPU_US_PER_CHUNK = 2.0  # router CPU per streamed chunk, end to end (issue 43)
GOAL_PROCESSES_RATIO = 1.6  # 2 processes against 1, on this machine (issue 43)


# -- the zero-latency worker ------------------------------------------------------------------


def serve_stub_workers(base_port: int, count: int, chunk_gap_s: float = 0.002) -> None:
    """``count`` stub workers on consecutive ports, one event loop: ``/v1/completions``
    answered at once (a whole body, or every SSE event in one write), plus what the routers
    ask a worker at start-up and while running (health, models, ``/kvpool/info`` without KV
    events, load gauges). Anything else is a 404."""
    import httptools
    import uvloop

    from kvpool import __version__
    from kvpool.hashing import DEFAULT_BLOCK_SIZE, DEFAULT_HASH_SEED, HASH_ALGORITHM
    from kvpool.openai_api import WorkerInfo

    info = WorkerInfo(
        served_model_name=MODEL_NAME,
        engine="sim",
        role="both",
        block_size=DEFAULT_BLOCK_SIZE,
        hash_seed=DEFAULT_HASH_SEED,
        hash_algo=HASH_ALGORITHM,
        max_model_len=32768,
        num_blocks=28000,
        kv_events=None,
        kv_transfer_engine_id="stub",
        version=__version__,
    )
    card = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "kvpool"}
    gauges = "".join(
        f'vllm:{name}{{model_name="{MODEL_NAME}"}} 0.0\n'
        for name in ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running")
    )
    fixed = {
        b"/health": b'{"status":"ok"}',
        b"/kvpool/info": info.model_dump_json().encode(),
        b"/v1/models": json.dumps({"object": "list", "data": [card]}).encode(),
        b"/metrics": gauges.encode(),
    }

    def tokenize(body: bytes) -> bytes:
        """vLLM's ``/tokenize`` answer (vLLM's router asks it for a prompt's tokens): one
        token a word, numbered by the word's length."""
        req = json.loads(body)
        text = req.get("prompt") or " ".join(
            str(m.get("content", "")) for m in req.get("messages") or ()
        )
        tokens = [len(w) for w in str(text).split()]
        answer = {"count": len(tokens), "max_model_len": 32768, "tokens": tokens}
        return whole(200, json.dumps(answer).encode())

    def whole(status: int, body: bytes, kind: bytes = b"application/json") -> bytes:
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        reason = b"OK" if status == 200 else b"Not Found"
        return head % (status, reason, kind, len(body)) + body

    def completion(body: bytes, chat: bool = False) -> bytes:
        req = json.loads(body)
        if chat and req.get("stream"):
            return chat_stream(int(req.get("max_tokens") or 16))
        n = int(req.get("max_tokens") or 16)
        rid = "cmpl-" + uuid.uuid4().hex
        if chat and not req.get("stream"):
            message = {"role": "assistant", "content": " tok" * n}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
            out = {"id": rid, "object": "chat.completion", "created": int(time.time())}
            out |= {"model": MODEL_NAME, "choices": [choice], "usage": usage}
            return whole(200, json.dumps(out).encode())
        if not req.get("stream"):
            choice = {"index": 0, "text": " tok" * n, "finish_reason": "length"}
            usage = {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}
            out = {"id": rid, "object": "text_completion", "created": int(time.time())}
            out |= {"model": MODEL_NAME, "choices": [choice], "usage": usage}
            return whole(200, json.dumps(out).encode())
        parts = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"]
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        for i in range(n):
            choice = {"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}
            event = {"id": rid, "object": "text_completion", "created": 0, "model": MODEL_NAME}
            data = b"data: " + json.dumps(event | {"choices": [choice]}).encode() + b"\n\n"
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
        parts.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return b"".join(parts)

    async def paced(transport: Any, response: bytes) -> None:
        """A long stream as a decoding worker sends it: its head and each event in a write
        of its own, ``chunk_gap_s`` apart."""
        head, _, rest = response.partition(b"\r\n\r\n")
        transport.write(head + b"\r\n\r\n")
        chunks = rest.split(b"\r\n")
        pieces = [b"\r\n".join(chunks[i : i + 2]) + b"\r\n" for i in range(0, len(chunks) - 1, 2)]
        for piece in pieces:
            await asyncio.sleep(chunk_gap_s)
            if transport.is_closing():
                return
            transport.write(piece)

    def chat_stream(n: int) -> bytes:
        rid = "chatcmpl-" + uuid.uuid4().hex
        parts = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"]
        parts.append(b"transfer-encoding: chunked\r\n\r\n")
        for i in range(n):
            delta = {"role": "assistant", "content": " tok"} if i == 0 else {"content": " tok"}
            choice = {"index": 0, "delta": delta, "finish_reason": "length" if i == n - 1 else None}
            event = {"id": rid, "object": "chat.completion.chunk", "created": 0}
            event |= {"model": MODEL_NAME, "choices": [choice]}
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
        parts.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        return b"".join(parts)

    tasks: set[asyncio.Future[None]] = set()

    class Worker(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpRequestParser(self)
            self.transport: Any = None
            self.url = b""
            self.body: list[bytes] = []

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_begin(self) -> None:
            self.url, self.body = b"", []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            path = self.url.split(b"?", 1)[0]
            if path == b"/v1/completions" and self.parser.get_method() == b"POST":
                body = b"".join(self.body)
                answer = completion(body)
                req = json.loads(body)
                if req.get("stream") and int(req.get("max_tokens") or 16) > 64:
                    tasks.add(task := asyncio.ensure_future(paced(self.transport, answer)))
                    task.add_done_callback(tasks.discard)
                else:
                    self.transport.write(answer)
            elif path == b"/tokenize" and self.parser.get_method() == b"POST":
                self.transport.write(tokenize(b"".join(self.body)))
            elif path == b"/v1/chat/completions" and self.parser.get_method() == b"POST":
                self.transport.write(completion(b"".join(self.body), chat=True))
            elif path in fixed:
                kind = b"text/plain" if path == b"/metrics" else b"application/json"
                self.transport.write(whole(200, fixed[path], kind))
            else:
                self.transport.write(whole(404, b'{"error":{"message":"not found"}}'))
            if not self.parser.should_keep_alive():
                self.transport.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in range(base_port, base_port + count):
            await loop.create_server(Worker, HOST, port, backlog=4096)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()

    uvloop.run(main())


# -- the load generator -----------------------------------------------------------------------


def serve_bare_proxy(port: int, workers: list[str]) -> None:
    """The floor under any router built like kvpool's: uvicorn (uvloop, httptools) and an
    ASGI app that passes each request to the next worker in turn with kvpool's own client
    to the workers (``router/proxy/upstream.py``), and the answer back, streamed or whole. No
    parsing, tokenizing, hashing, admission, policy, metrics or retries: what is left of a
    router's cost per request when all of that costs nothing."""
    import uvicorn

    from kvpool.router.proxy.upstream import Upstream

    client: Upstream | None = None
    turn = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal client, turn
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if client is None:
            client = Upstream(connect_timeout_s=2.0)
        turn += 1
        resp = await client.post(
            workers[turn % len(workers)], scope["path"], body, {"content-type": "application/json"}
        )
        kind = resp.headers.get("content-type", "application/json").encode()
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [(b"content-type", kind)],
            }
        )
        async for chunk in resp.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        resp.release()

    uvicorn.run(
        app,
        host=HOST,
        port=port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
        lifespan="on",
    )


class _Request:
    __slots__ = ("done", "first", "headers", "scheduled", "sent", "status")

    def __init__(self, scheduled: float) -> None:
        self.scheduled = scheduled
        self.sent = self.headers = self.first = self.done = 0.0
        self.status = 0


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, its responses parsed by httptools (C)."""

    def __init__(self, client: Client) -> None:
        import httptools

        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.request: _Request | None = None
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, request: _Request, payload: bytes) -> None:
        self.request = request
        request.sent = time.monotonic()
        self.transport.write(payload)

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_headers_complete(self) -> None:
        if self.request is not None:
            self.request.headers = time.monotonic()

    def on_body(self, body: bytes) -> None:
        if self.request is not None and not self.request.first:
            self.request.first = time.monotonic()

    def on_message_complete(self) -> None:
        request, self.request = self.request, None
        if request is None:
            return
        request.done = time.monotonic()
        request.status = self.parser.get_status_code()
        keep = self.parser.should_keep_alive()
        self.client.finished(self if keep else None, request)
        if not keep:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.client.connections -= 1
        request, self.request = self.request, None
        if request is not None:
            request.done = time.monotonic()
            request.status = -1
            self.client.finished(None, request)


class Client:
    """An open-loop HTTP client: a request is sent when it is due, on an idle keep-alive
    connection or a new one (to ``ports`` in turn), never waiting for another's answer.
    Costs ~30 us of CPU per request, so that it takes little from the processes measured."""

    def __init__(self, ports: Sequence[int], limit: int = 4096) -> None:
        self.ports = list(ports)
        self.limit = limit
        self.idle: list[_Connection] = []
        self.backlog: deque[tuple[_Request, bytes]] = deque()
        self.connections = 0
        self.outstanding = 0
        self.on_done: Callable[[_Request], None] | None = None
        self._next_port = 0
        self._drained: asyncio.Event | None = None

    def submit(self, request: _Request, payload: bytes) -> None:
        self.outstanding += 1
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost:
                conn.send(request, payload)
                return
        if self.connections < self.limit:
            self.connections += 1
            port = self.ports[self._next_port % len(self.ports)]
            self._next_port += 1
            asyncio.get_running_loop().create_task(self._open(port, request, payload))
        else:
            self.backlog.append((request, payload))

    async def _open(self, port: int, request: _Request, payload: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), HOST, port)
        except OSError:
            self.connections -= 1
            request.done, request.status = time.monotonic(), -1
            self.finished(None, request)
            return
        conn.send(request, payload)

    def finished(self, conn: _Connection | None, request: _Request) -> None:
        self.outstanding -= 1
        if conn is not None and not conn.lost:
            if self.backlog:
                conn.send(*self.backlog.popleft())
            else:
                self.idle.append(conn)
        if self.on_done is not None:
            self.on_done(request)
        if self.outstanding == 0 and self._drained is not None:
            self._drained.set()

    async def drain(self, timeout: float) -> bool:
        """Wait until every request sent has its answer (or ``timeout`` seconds)."""
        if self.outstanding > 0:
            self._drained = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), timeout)
            self._drained = None
        return self.outstanding <= 0

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


def http_post(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: {HOST}\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(data)}\r\n\r\n").encode() + data


@dataclass
class Phase:
    """One stretch of load: what was offered, what came back, and when."""

    rate: float
    duration: float
    sent: int
    ok: int  # 200s
    in_time: int  # 200s that ended within the stretch (plus 100 ms)
    latency_ms: list[float]  # sent -> last byte, 200s only, sorted
    ttft_ms: list[float]  # sent -> first body byte, 200s only, sorted
    lag_p99_ms: float  # how late the client sent (its own scheduling), p99
    body_after_headers_ms: list[float]  # headers -> first body byte, 200s only, sorted
    cpu_ms: dict[str, float] = field(default_factory=dict)  # process -> CPU ms per request

    def q(self, p: float, which: str = "latency") -> float:
        xs = self.latency_ms if which == "latency" else self.ttft_ms
        return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")

    def sustained(self, p99_limit_ms: float) -> bool:
        ok = self.in_time >= 0.95 * self.sent and self.ok >= 0.95 * self.sent
        return ok and self.q(0.99) <= p99_limit_ms


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every process, every core)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads, and of its live child
    processes (a router of several processes is a supervisor and its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.update(int(c) for c in f.read().split())
    for child in children:
        with contextlib.suppress(OSError):
            own += process_cpu_s(child)
    return own


async def run_phase(
    client: Client,
    payloads: Sequence[bytes],
    rate: float,
    duration: float,
    seed: int,
    pids: dict[str, int] | None = None,
) -> Phase:
    """Poisson arrivals at ``rate`` for ``duration`` seconds (the same times and requests
    for the same seed); waits for the answers (at most a few seconds more)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    n = max(1, round(rate * duration))
    start = loop.time() + 0.05
    t, requests = start, []
    for _ in range(n):
        requests.append(_Request(t))
        t += rng.expovariate(rate)
    first = rng.randrange(len(payloads))
    remaining = n
    done = asyncio.Event()

    def on_done(request: _Request) -> None:
        nonlocal remaining
        remaining -= 1
        if remaining == 0:
            done.set()

    position = 0

    def fire() -> None:
        # The loop's timers have millisecond resolution: send what is due within it.
        nonlocal position
        now = loop.time() + 0.001
        while position < n and requests[position].scheduled <= now:
            client.submit(requests[position], payloads[(first + position) % len(payloads)])
            position += 1
        if position < n:
            loop.call_at(requests[position].scheduled, fire)

    pids = pids or {}
    cpu0 = {k: process_cpu_s(p) for k, p in pids.items()}
    cpu0["client"] = time.process_time()
    busy0 = machine_busy_s()
    client.on_done = on_done
    gc.disable()  # no collection pauses in the client while it measures
    try:
        loop.call_at(start, fire)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), duration + 5.0)
    finally:
        gc.enable()
        client.on_done = None
    cpu = {k: process_cpu_s(p) for k, p in pids.items()}
    cpu["client"] = time.process_time()
    # What the rest of the machine did meanwhile: other people's processes compete too.
    cpu["others"] = machine_busy_s() - sum(cpu.values())
    cpu0["others"] = busy0 - sum(cpu0.values())
    end = start + duration + 0.1
    ok = [r for r in requests if r.status == 200]
    lag = sorted(r.sent - r.scheduled for r in requests if r.sent)
    return Phase(
        rate=rate,
        duration=duration,
        sent=n,
        ok=len(ok),
        in_time=sum(1 for r in ok if r.done <= end),
        latency_ms=sorted((r.done - r.sent) * 1000 for r in ok),
        ttft_ms=sorted((r.first - r.sent) * 1000 for r in ok if r.first),
        lag_p99_ms=lag[min(int(0.99 * len(lag)), len(lag) - 1)] * 1000 if lag else float("nan"),
        body_after_headers_ms=sorted((r.first - r.headers) * 1000 for r in ok if r.first),
        cpu_ms={k: (cpu[k] - cpu0[k]) * 1000 / n for k in cpu},
    )


# -- the processes ----------------------------------------------------------------------------


def free_ports(count: int) -> int:
    from kvpool.stack import free_port_range

    return free_port_range(count)


def start(argv: list[str], cpus: set[int] | None, log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # the child keeps its own copy
    proc = subprocess.Popen(argv, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    if cpus:
        # Set before the child starts any thread (its start-up takes far longer), so that
        # every thread it starts inherits it.
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def start_stubs(
    count: int, cpus: set[int] | None, log: Path
) -> tuple[subprocess.Popen[bytes], list[int], list[str]]:
    """The stub workers' process, their ports and their URLs."""
    base = free_ports(count)
    proc = start([sys.executable, ME, "--stub-workers", str(base), str(count)], cpus, log)
    ports = [base + i for i in range(count)]
    return proc, ports, [f"http://{HOST}:{p}" for p in ports]


def stop(proc: subprocess.Popen[bytes]) -> None:
    from kvpool.stack import stop_process

    stop_process(proc, timeout=10)


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def post(url: str, body: dict[str, Any], timeout: float = 5.0) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    from kvpool.stack import wait_until

    wait_until(check, proc, what)


#: each peer as the tables name it
PEER_LABELS = {
    "sglang": "SGLang router (cache_aware)",
    "smg": "smg (cache_aware)",
    "vllm-router": "vLLM router (kv_aware)",
}


def _routing() -> Any:
    """bench/routing.py, whose peer command lines these are."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # asked once per router started: put it there once
        sys.path.insert(0, here)
    import routing

    return routing


@dataclass
class Target:
    """Where the client sends: the workers themselves, or a router in front of them."""

    name: str
    label: str
    ports: list[int]
    proc: subprocess.Popen[bytes] | None = None


def start_router(
    name: str,
    model: Path,
    workers: list[str],
    cpus: set[int] | None,
    logs: Path,
    processes: int = 1,
) -> Target:
    port = free_ports(1)
    url = f"http://{HOST}:{port}"
    if name == "kvpool":
        argv = [*KVPOOL, "router", "serve", "--model", str(model), "--port", str(port)]
        argv += ["--processes", str(processes)]
        for w in workers:
            argv += ["--worker", w]
        proc = start(argv, cpus, logs / "kvpool-router.log")

        def ready() -> bool:  # every process with every worker (health checks go to any)
            up = {}
            for _ in range(20 * processes):
                status, body = get(url + "/health")
                if status != 200:
                    return False
                answer = json.loads(body)
                up[answer.get("process", 0)] = answer.get("workers_up")
            return len(up) == processes and all(n == len(workers) for n in up.values())

        label = "kvpool router"
    elif name == "bare":
        proc = start(
            [sys.executable, ME, "--bare-proxy", str(port), ",".join(workers)],
            cpus,
            logs / "bare-proxy.log",
        )

        def ready() -> bool:
            return get(url + "/health")[0] == 200

        label = "bare Python proxy"
    else:  # a peer, as bench/routing.py starts it (its metrics on the next port)
        port = free_ports(2)
        url = f"http://{HOST}:{port}"
        from kvpool.hashing import DEFAULT_BLOCK_SIZE

        routing = _routing()
        fleet = routing.Fleet(workers, [], [], [], DEFAULT_BLOCK_SIZE)  # no KV events
        argv, _ = routing.peer_router(PEERS[name], port, fleet, MODEL_NAME)
        proc = start(argv, cpus, logs / f"{name}.log")

        def ready() -> bool:  # a peer's /health may say OK before it has workers
            body = {"model": MODEL_NAME, "prompt": "ready?", "max_tokens": 1}
            return post(url + "/v1/completions", body) == 200

        label = PEER_LABELS[name]
    wait_until(ready, proc, label)
    return Target(name, label, [port], proc)


# -- the request mix --------------------------------------------------------------------------

WORDS = (
    "the order ships within two days unless the item is marked as made to order in which "
    "case the customer gets an estimate by email returns are accepted for thirty days with "
    "the original receipt refunds go back to the card used for payment support answers in "
    "the language of the question and cites the policy section it relies on"
).split()


def request_mix(
    tokenizer: Any, count: int, system_tokens: int, question_tokens: tuple[int, int], seed: int
) -> tuple[list[str], list[int]]:
    """Prompts as a chat service sends them: one of 16 system prompts of ~``system_tokens``
    tokens (shared prefixes) and a question of its own. Returns the prompts and their
    token counts (with the workers' tokenizer)."""
    rng = random.Random(seed)

    def text(tokens: int, r: random.Random) -> str:
        words = r.choices(WORDS, k=tokens // 3)
        while len(tokenizer.encode(" ".join(words))) < tokens:
            words += r.choices(WORDS, k=4)
        return " ".join(words)

    systems = [f"System prompt {g}. " + text(system_tokens, random.Random(g)) for g in range(16)]
    prompts = []
    for i in range(count):
        question = f" Question {i}: " + text(rng.randint(*question_tokens), rng)
        prompts.append((systems[rng.randrange(16)] if system_tokens else "") + question)
    return prompts, [len(tokenizer.encode(p)) for p in prompts]


def payloads(prompts: list[str], stream: bool, max_tokens: int) -> list[bytes]:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "stream": stream}
    return [http_post("/v1/completions", body | {"prompt": p}) for p in prompts]


def chat_payloads(prompts: list[str], max_tokens: int) -> list[bytes]:
    """The same prompts as non-streamed chats: the system prompt, then the question."""
    out = []
    for p in prompts:
        system, _, question = p.partition(" Question ")
        messages = [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": "Question " + question})
        body = {"model": MODEL_NAME, "max_tokens": max_tokens, "messages": messages}
        out.append(http_post("/v1/chat/completions", body))
    return out


# -- part 1: added latency and highest sustained rate -----------------------------------------


async def ramp(
    client: Client,
    mix: list[bytes],
    args: argparse.Namespace,
    pids: dict[str, int],
    refine: int = 2,
) -> tuple[float, list[dict[str, Any]]]:
    """Raise the offered rate 1.5x a step until a step is not sustained (twice), or lower
    it until one is, then halve the gap ``refine`` times; returns the highest rate
    sustained (0 if none from 10 req/s) and every step."""
    steps: list[dict[str, Any]] = []

    async def step(rate: float) -> bool:
        phase = await run_phase(client, mix, rate, args.step_s, seed=len(steps), pids=pids)
        ok = phase.sustained(args.p99_limit_ms)
        steps.append(
            {
                "offered": round(rate, 1),
                "completed_per_s": round(phase.in_time / phase.duration, 1),
                "p50_ms": round(phase.q(0.5), 3),
                "p99_ms": round(phase.q(0.99), 3),
                "sustained": ok,
                "cpu_ms_per_request": {k: round(v, 4) for k, v in phase.cpu_ms.items()},
            }
        )
        print(f"    ramp {rate:8.1f}/s: {json.dumps(steps[-1])}", file=sys.stderr, flush=True)
        if not await client.drain(20.0):
            print("    (answers still outstanding after 20 s)", file=sys.stderr)
        return ok

    async def sustained(rate: float) -> bool:
        return await step(rate) or await step(rate)  # one bad step may be noise: try again

    good, bad = 0.0, None
    rate = args.ramp_start
    if await sustained(rate):
        good, rate = rate, rate * 1.5
        while rate <= args.ramp_max:
            if not await sustained(rate):
                bad = rate
                break
            good, rate = rate, rate * 1.5
    else:  # not even the first step: down until one is
        bad, rate = rate, rate / 1.5
        while rate >= 10:
            if await sustained(rate):
                good = rate
                break
            bad, rate = rate, rate / 1.5
    if bad is not None and good:
        for _ in range(refine):
            mid = (good * bad) ** 0.5
            if await step(mid):
                good = mid
            else:
                bad = mid
    return good, steps


async def measure_target(
    target: Target,
    mixes: dict[str, list[bytes]],
    args: argparse.Namespace,
    round_: int,
    pids: dict[str, int],
    with_ramp: bool,
) -> dict[str, Any]:
    client = Client(target.ports)
    try:
        await run_phase(client, mixes["main"], args.rate, args.warmup_s, seed=999)
        await client.drain(10.0)
        out: dict[str, Any] = {}
        for mix, duration in (("main", args.phase_s), ("stream", args.short_phase_s)):
            out[mix] = await run_phase(
                client, mixes[mix], args.rate, duration, seed=round_, pids=pids
            )
            await client.drain(10.0)
        out["short"] = await run_phase(
            client, mixes["short"], args.rate, args.short_phase_s, seed=round_, pids=pids
        )
        await client.drain(10.0)
        out["chat"] = await run_phase(
            client, mixes["chat"], args.rate, args.short_phase_s, seed=round_, pids=pids
        )
        await client.drain(10.0)
        out["long_stream"] = await run_phase(
            client,
            mixes["long_stream"],
            args.stream_rate,
            args.short_phase_s,
            seed=round_,
            pids=pids,
        )
        await client.drain(10.0)
        if with_ramp:
            out["max_rps"], out["ramp"] = await ramp(client, mixes["main"], args, pids)
        return out
    finally:
        client.close()


async def part_one(
    args: argparse.Namespace, model: Path, logs: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    from kvpool.tokenization import load_tokenizer

    cpus = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cpus) >= 2
    load_cpus = set(cpus[:-1]) if pinned else None
    router_cpus = {cpus[-1]} if pinned else None
    if load_cpus:
        os.sched_setaffinity(0, load_cpus)

    tokenizer = load_tokenizer(model)
    prompts, tokens = request_mix(tokenizer, 400, args.system_tokens, (10, 100), seed=1)
    short, short_tokens = request_mix(tokenizer, 400, 0, (20, 60), seed=2)
    mixes = {
        "main": payloads(prompts, False, args.max_tokens),
        "stream": payloads(prompts, True, args.max_tokens),
        "short": payloads(short, False, args.max_tokens),
        "chat": chat_payloads(prompts, args.max_tokens),
        "long_stream": payloads(prompts, True, LONG_STREAM_TOKENS),
    }
    setup = {
        "cores": len(cpus),
        "pinned": pinned,
        "load_cpus": sorted(load_cpus) if load_cpus else None,
        "router_cpus": sorted(router_cpus) if router_cpus else None,
        "prompt_tokens_mean": statistics.mean(tokens),
        "prompt_chars_mean": statistics.mean(len(p) for p in prompts),
        "short_prompt_tokens_mean": statistics.mean(short_tokens),
    }

    stub, ports, workers = start_stubs(args.workers, load_cpus, logs / "stub-workers.log")
    results: dict[str, dict[str, Any]] = {name: {} for name in TARGETS}
    try:
        for url in workers:
            wait_until(lambda url=url: get(url + "/health")[0] == 200, stub, "the stub workers")
        for round_ in range(args.rounds):
            last = round_ == args.rounds - 1
            for name in TARGETS:
                if name == "direct":
                    target = Target("direct", "straight to the workers", ports)
                else:
                    target = await asyncio.to_thread(
                        start_router, name, model, workers, router_cpus, logs
                    )
                pids = {"workers": stub.pid}
                if target.proc is not None:
                    pids["router"] = target.proc.pid
                print(f"round {round_ + 1}: {target.label}", file=sys.stderr, flush=True)
                try:
                    r = await measure_target(target, mixes, args, round_, pids, with_ramp=last)
                finally:
                    if target.proc is not None:
                        stop(target.proc)
                results[name][round_] = r
                main = r["main"]
                print(
                    f"  p50 {main.q(0.5):.3f} ms, p99 {main.q(0.99):.3f} ms, "
                    f"cpu/request {json.dumps({k: round(v, 3) for k, v in main.cpu_ms.items()})}",
                    file=sys.stderr,
                    flush=True,
                )
        if args.profile_s > 0:
            setup["profile"] = await profile_router(
                model, workers, router_cpus, logs, mixes["main"], args
            )
    finally:
        stop(stub)
        if load_cpus:
            os.sched_setaffinity(0, set(cpus))
    return results, setup


# -- where the kvpool router's time goes ------------------------------------------------------

#: the innermost frame that matches one of these (file or function, in order) names a
#: sample's part; a sample with no Python frame under the loop's is the event loop's own
#: work in C (uvloop, sockets, httptools' parser, callbacks)
PROFILE_PARTS = (
    ("tokenizing the prompt", ("kvpool/tokenization.py", "tokenizers", "router/routing/tokens.py")),
    ("hashing the prompt's blocks", ("kvpool/hashing.py",)),
    ("the index (match, speculate)", ("router/state/index.py", "router/state/feed.py")),
    (
        "planning (views, policy)",
        ("router/routing/policy.py", "router/state/pool.py", "router/state/load.py"),
    ),
    (
        "admission and tenants",
        ("router/admission/gate.py", "router/admission/tenants.py", "router/admission/flow.py"),
    ),
    ("parsing the request", ("router/proxy/request.py", "kvpool/openai_api.py", "json/")),
    ("the client to the workers", ("router/proxy/upstream.py",)),
    (
        "forwarding and relaying",
        ("router/proxy/forward.py", "router/proxy/relay.py", "router/proxy/sse.py"),
    ),
    ("metrics (prometheus_client)", ("prometheus_client", "router/admin/metrics.py")),
    ("uvicorn and Starlette", ("uvicorn/", "starlette/", "fastapi/", "kvpool/httpguard.py")),
    ("the rest of the gateway", ("router/",)),
)
LOOP_FRAMES = ("Runner.run", "asyncio_run", "Server.run", "Server.serve", "<module>")


def profile_parts(raw: str) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int]:
    """py-spy's raw (folded) samples: each part's share, the top functions by own share,
    and the sample count."""
    parts: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + n
        part = "other Python (asyncio, the standard library)"
        if leaf.split(" (")[0] in LOOP_FRAMES:
            part = "the event loop in C (no Python frame)"
        else:
            for frame in reversed(frames):
                where = frame.rsplit("(", 1)[-1]
                found = next(
                    (name for name, keys in PROFILE_PARTS if any(k in where for k in keys)), None
                )
                if found is not None:
                    part = found
                    break
        parts[part] = parts.get(part, 0) + n
    share = lambda d: sorted(((k, v / total) for k, v in d.items()), key=lambda kv: -kv[1])  # noqa: E731
    return (share(parts), share(own)[:15], total) if total else ([], [], 0)


def start_py_spy(pid: int, seconds: float, out: Path, log: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording ``pid`` for ``seconds`` into ``out`` (raw folded stacks, 100
    samples a second, sampled from outside without stopping the process); None when py-spy
    is not installed."""
    import shutil

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():
        return None
    argv = [spy, "record", "--nonblocking", "-r", "100", "-f", "raw", "-o", str(out)]
    argv += ["-d", str(round(seconds)), "-p", str(pid)]
    with log.open("wb") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)


async def profile_router(
    model: Path,
    workers: list[str],
    cpus: set[int] | None,
    logs: Path,
    mix: list[bytes],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The kvpool router at ``args.rate`` under py-spy, after the measured rounds: what its
    CPU per request goes to. Says why when there is no profile (py-spy missing, or not
    allowed to attach)."""
    target = await asyncio.to_thread(start_router, "kvpool", model, workers, cpus, logs)
    assert target.proc is not None
    out, log = logs / "router-profile.txt", logs / "py-spy.log"
    client = Client(target.ports)
    try:
        await run_phase(client, mix, args.rate, args.warmup_s, seed=999)
        await client.drain(10.0)
        recorder = await asyncio.to_thread(start_py_spy, target.proc.pid, args.profile_s, out, log)
        if recorder is None:
            return {"error": "py-spy is not installed (pip install py-spy)"}
        pids = {"router": target.proc.pid}
        phase = await run_phase(client, mix, args.rate, args.profile_s, seed=7, pids=pids)
        await client.drain(10.0)
        await asyncio.to_thread(recorder.wait, 30)
        raw = await asyncio.to_thread(lambda: out.read_text() if out.is_file() else "")
        if not raw:
            why = await asyncio.to_thread(log.read_text)
            return {"error": why[-300:].strip() or "no samples"}
    finally:
        client.close()
        stop(target.proc)
    parts, top, samples = profile_parts(raw)
    return {
        "rate": args.rate,
        "seconds": args.profile_s,
        "samples": samples,
        "cpu_ms_per_request": phase.cpu_ms["router"],
        "parts": [[k, round(v, 4)] for k, v in parts],
        "top": [[k, round(v, 4)] for k, v in top],
    }


def render_profile(prof: dict[str, Any]) -> list[str]:
    if "error" in prof:
        return [f"(no profile: {prof['error']})"]
    cpu = prof["cpu_ms_per_request"]
    lines = [
        f"The kvpool router at {prof['rate']:g} req/s for {prof['seconds']:g} s under py-spy "
        f"({prof['samples']:,} samples of its busy time; {cpu:.3f} ms of CPU per request "
        f"meanwhile). A part is the innermost frame of a sample that belongs to it.",
        "",
        "| part of the router's CPU | share | ms per request |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {v:.0%} | {v * cpu:.3f} |" for k, v in prof["parts"]]
    lines += ["", "| function (own time) | share |", "|---|---:|"]
    lines += [f"| `{k}` | {v:.1%} |" for k, v in prof["top"]]
    return lines


# -- part 3: long prompts ----------------------------------------------------------------------

LONG_SIZES = {"1k": 1024, "4k": 4096, "16k": 16384}


async def one_request(client: Client, payload: bytes) -> _Request:
    """Send one request and wait for its answer; its times are on the returned request."""
    done = asyncio.get_running_loop().create_future()
    client.on_done = lambda r: done.done() or done.set_result(r)
    client.submit(_Request(time.monotonic()), payload)
    return await done


async def long_prompts(
    target: Target, prompts: dict[str, list[bytes]], huge: bytes, small: list[bytes]
) -> dict[str, Any]:
    """Streamed chats of each size one at a time on an idle fleet: time to the first body
    byte, median. Then a huge prompt among small requests sent every 10 ms: its answer
    time and the small requests' worst latency, beside theirs before it."""
    client = Client(target.ports)
    out: dict[str, Any] = {"ttfb_ms": {}, "headers_ms": {}}
    try:
        for payload in small[:5]:  # warm: connections, the router's own first requests
            await one_request(client, payload)
        for size, payloads_ in prompts.items():
            times, heads = [], []
            for payload in payloads_:
                r = await one_request(client, payload)
                assert r.status == 200, f"{target.label}: {size} prompt answered {r.status}"
                times.append((r.first - r.sent) * 1000)
                heads.append((r.headers - r.sent) * 1000)
            out["ttfb_ms"][size] = statistics.median(times)
            out["headers_ms"][size] = statistics.median(heads)
        if target.name == "direct":
            return out
        client.on_done = None
        latencies: list[tuple[float, float]] = []  # (sent, ms)
        loop = asyncio.get_running_loop()

        def done(r: _Request) -> None:
            if r is huge_request:
                huge_done.set_result(r)
            else:
                latencies.append((r.sent, (r.done - r.sent) * 1000))

        huge_done: asyncio.Future[_Request] = loop.create_future()
        huge_request = _Request(0.0)
        client.on_done = done
        start = time.monotonic()
        for i in range(200):
            if i == 50:
                client.submit(huge_request, huge)
            client.submit(_Request(time.monotonic()), small[i % len(small)])
            await asyncio.sleep(0.01)
        answer = await asyncio.wait_for(huge_done, 120)
        await client.drain(30)
        before = [ms for sent, ms in latencies if sent < huge_request.sent]
        during = [ms for sent, ms in latencies if huge_request.sent <= sent <= answer.done]
        out["huge"] = {
            "status": answer.status,
            "answer_ms": (answer.done - answer.sent) * 1000,
            "small_p50_before_ms": statistics.median(before),
            "small_max_before_ms": max(before),
            "small_max_during_ms": max(during, default=0.0),
            "small_during": len(during),
            "elapsed_s": time.monotonic() - start,
        }
        return out
    finally:
        client.close()


def chat_payload(text: str) -> bytes:
    body = {"model": MODEL_NAME, "max_tokens": 4, "stream": True}
    body["messages"] = [{"role": "user", "content": text}]
    return http_post("/v1/chat/completions", body)


async def part_three(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    from kvpool.tokenization import load_tokenizer

    tokenizer = load_tokenizer(model)
    rng = random.Random(3)
    prompts: dict[str, list[bytes]] = {}
    tokens: dict[str, float] = {}
    base = " ".join(rng.choices(WORDS, k=40_000))
    for size, n in LONG_SIZES.items():
        ids = tokenizer.encode(base)[:n]
        text = tokenizer.decode(ids)
        # each prompt distinct from its first word: nothing cached, the worst case
        texts = [f"Conversation {size}-{i}: {text}" for i in range(args.long_prompts)]
        prompts[size] = [chat_payload(t) for t in texts]
        tokens[size] = statistics.mean(len(tokenizer.encode(t)) for t in texts)
    huge_text = f"Huge: {base} " * (4 * 2**20 // (len(base) + 1))
    huge = chat_payload(huge_text[: 4 * 2**20])
    small, _ = request_mix(tokenizer, 50, 0, (20, 60), seed=5)
    small_payloads = payloads(small, False, 4)

    stub, ports, workers = start_stubs(args.workers, None, logs / "stub-workers-long.log")
    out: dict[str, Any] = {"prompt_tokens": tokens, "huge_bytes": len(huge)}
    try:
        for url in workers:
            wait_until(lambda url=url: get(url + "/health")[0] == 200, stub, "the stub workers")
        for name in ("direct", "kvpool", "sglang"):
            if name == "direct":
                target = Target("direct", "straight to the workers", ports)
            else:
                target = await asyncio.to_thread(start_router, name, model, workers, None, logs)
            print(f"long prompts: {target.label}", file=sys.stderr, flush=True)
            try:
                out[name] = await long_prompts(target, prompts, huge, small_payloads)
            finally:
                if target.proc is not None:
                    stop(target.proc)
    finally:
        stop(stub)
    for name in ("kvpool", "sglang"):
        for key, times in (("added_ttft_ms", "ttfb_ms"), ("added_headers_ms", "headers_ms")):
            out[name][key] = {k: out[name][times][k] - out["direct"][times][k] for k in LONG_SIZES}
    return out


# -- part 4: every core -----------------------------------------------------------------------


async def part_four(args: argparse.Namespace, model: Path, logs: Path) -> dict[str, Any]:
    """Each router given the whole machine (nothing pinned; the load generator and the
    workers share it): the kvpool router with 1 and with 2 processes, and the SGLang
    router (its own threads), through the same ramp."""
    from kvpool.tokenization import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts, _ = request_mix(tokenizer, 400, args.system_tokens, (10, 100), seed=1)
    mix = payloads(prompts, False, args.max_tokens)
    stub, _, workers = start_stubs(args.workers, None, logs / "stub-workers-cores.log")
    out: dict[str, Any] = {}
    try:
        for url in workers:
            wait_until(lambda url=url: get(url + "/health")[0] == 200, stub, "the stub workers")
        for label, name, processes in (
            ("kvpool_1proc", "kvpool", 1),
            ("kvpool_2proc", "kvpool", 2),
            ("sglang", "sglang", 1),
        ):
            print(f"every core: {label}", file=sys.stderr, flush=True)
            target = await asyncio.to_thread(
                start_router, name, model, workers, None, logs, processes
            )
            assert target.proc is not None
            client = Client(target.ports)
            try:
                await run_phase(client, mix, args.rate, args.warmup_s, seed=999)
                await client.drain(10.0)
                pids = {"router": target.proc.pid}
                # two more halvings than the other ramps: the ratio of two rates is the
                # figure here, and two halvings leave each within ~10%
                rate, steps = await ramp(client, mix, args, pids, refine=4)
            finally:
                client.close()
                stop(target.proc)
            out[label] = {"max_rps": rate, "ramp": steps}
    finally:
        stop(stub)
    return out


# -- part 2: decision time --------------------------------------------------------------------


def decision_in_a_fresh_process(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`part_two` in a process of its own, as the router's decisions are: this one
    holds the load generator's records of every request sent (hundreds of thousands of
    objects), whose memory and garbage are not the router's."""
    argv = [sys.executable, ME, "--only-decision", "--decisions", str(args.decisions)]
    argv += ["--indexed-blocks", str(args.indexed_blocks)]
    done = subprocess.run(argv, env=ENV, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def part_two(args: argparse.Namespace) -> dict[str, Any]:
    """Decision time over 64 workers and a million indexed (block, worker) entries."""
    import numpy as np

    from kvpool.hashing import BlockHasher, block_key
    from kvpool.router.routing.inputs import RouteRequest
    from kvpool.router.routing.planner import Planner, SplitConfig
    from kvpool.router.routing.policy import POLICIES
    from kvpool.router.state.discovery import WorkerEndpoint
    from kvpool.router.state.index import BlockIndex
    from kvpool.router.state.pool import WorkerPool
    from kvpool.router.state.worker import PoolConfig, WorkerState

    block, prompt_blocks, vocab = 16, 512, 32000
    prompt_tokens = prompt_blocks * block
    n_workers, per_worker = 64, args.indexed_blocks // 64
    rng = random.Random(3)
    hasher = BlockHasher(block_size=block)
    clock = [1000.0]  # the index's: 5 ms a request, as at 200 requests/s
    index = BlockIndex(clock=lambda: clock[0])
    ids = [f"worker-{i:02d}" for i in range(n_workers)]
    for w in ids:
        index.add_worker(w)

    def tokens(seed: int, n: int) -> list[int]:
        return np.random.default_rng(seed).integers(0, vocab, n).tolist()

    # 64 shared prefixes (system prompts, documents) of 16-384 blocks; prefix s is the
    # (s+1)-th most popular (Zipf) and cached on ~32/(s+1) workers.
    prefixes = []
    popularity = [1 / (s + 1) for s in range(64)]
    holders: dict[str, list[int]] = {w: [] for w in ids}
    for s in range(64):
        toks = tokens(10_000 + s, rng.randint(16, 384) * block)
        prefixes.append((toks, hasher.hash_prompt(toks)))
        for w in rng.sample(ids, max(1, round(32 * popularity[s]))):
            holders[w].append(s)

    # Each worker's cache: 8k-token conversations on its prefixes until it holds its share;
    # a conversation's own blocks (past the prefix) are what its worker evicts first.
    conversations: list[tuple[int, int]] = []  # (prefix, seed of the rest)
    evictable: dict[str, deque[list[int]]] = {w: deque() for w in ids}
    t0 = time.perf_counter()
    for w in ids:
        mine = holders[w] or [rng.randrange(64)]
        while index.num_blocks(w) < per_worker:
            s = rng.choice(mine)
            ptoks, pdigests = prefixes[s]
            chain = hasher.chain()
            chain.digests = list(pdigests)
            seed = len(conversations)
            chain.extend(tokens(seed, prompt_tokens - len(ptoks)))
            keys = [block_key(d) for d in chain.digests]
            index.store(w, keys)
            evictable[w].append(keys[len(pdigests) :])
            conversations.append((s, seed))
    populate_s = time.perf_counter() - t0

    pool = WorkerPool(PoolConfig(block_size=block, hash_seed=hasher.hash_seed), index, None)  # type: ignore[arg-type]
    for i, w in enumerate(ids):
        state = WorkerState(endpoint=WorkerEndpoint(id=w, url=f"http://10.0.{i}.1:8000"))
        state.status = "up"
        state.kv_usage, state.waiting, state.running = rng.uniform(0.2, 0.9), 0.0, 4.0
        if i >= 4:  # the first four joined lately: not learned yet, priced like their peers
            for _ in range(12):
                n = rng.randint(100, 8000)
                state.prefill.observe(n, 0.02 + n / rng.uniform(9000, 11000))
        pool.workers[w] = state
    config = POLICIES["kvpool"]
    planner = Planner(config, SplitConfig())  # the router plans a split or not
    decide: Callable[[Any, list[Any]], Any] = lambda req, views: planner.plan(req, views)  # noqa: E731

    def query(q: int) -> tuple[list[int], int]:
        """An 8k-token prompt and how many of its blocks are shared with earlier ones."""
        kind = q % 4
        if kind < 2:  # a new question on a shared prefix
            s = rng.choices(range(64), popularity)[0]
            ptoks = prefixes[s][0]
            return ptoks + tokens(1_000_000 + q, prompt_tokens - len(ptoks)), len(ptoks) // block
        if kind == 2:  # a follow-up: a cached conversation, a new last turn
            s, seed = rng.choice(conversations)
            ptoks = prefixes[s][0]
            whole = ptoks + tokens(seed, prompt_tokens - len(ptoks))
            keep = rng.randint(448, 508) * block
            return whole[:keep] + tokens(2_000_000 + q, prompt_tokens - keep), keep // block
        return tokens(3_000_000 + q, prompt_tokens), 0  # cold

    pauses: list[float] = []
    gc_start = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - gc_start[0]) * 1000)

    hash_ms, decide_ms, spec_ms, matched = [], [], [], []
    tickets: deque[tuple[WorkerState, Any]] = deque()
    routed: deque[tuple[str, list[int], int]] = deque()
    gc.collect()  # what building the index left behind is not the decisions' to pay
    gc.callbacks.append(on_gc)
    try:
        for q in range(args.decisions):
            toks, shared = query(q)
            if q % 200 == 0:  # the scrape loop's fresh load readings
                for st in pool.workers.values():
                    st.scraped_at = time.monotonic()
            t0 = time.perf_counter()
            keys = hasher.prompt_keys(toks)
            t1 = time.perf_counter()
            views = pool.views()
            req = RouteRequest(
                num_tokens=len(toks), block_size=block, matched_blocks=index.match(keys)
            )
            decision = decide(req, views)
            t2 = time.perf_counter()
            worker = decision.worker
            index.speculate(worker, keys)
            t3 = time.perf_counter()
            hash_ms.append((t1 - t0) * 1000)
            decide_ms.append((t2 - t1) * 1000)
            spec_ms.append((t3 - t2) * 1000)
            matched.append(max(req.matched_blocks.values(), default=0))
            # What follows a decision, untimed: the worker's load grows until the request
            # ends; its KV events confirm the blocks ~40 ms later, and it evicts its oldest
            # blocks to make room, so the index stays at its size; time passes.
            state = pool.workers[worker]
            cached = req.matched_blocks.get(worker, 0) * block
            tickets.append((state, state.begin(len(toks) - cached, 0.5, time.monotonic())))
            if len(tickets) > 64:
                old, ticket = tickets.popleft()
                old.end(ticket)
            routed.append((worker, keys, shared))
            if len(routed) > 8:
                w, ks, sh = routed.popleft()
                index.store(w, ks)
                evictable[w].append(ks[sh:])
                while evictable[w] and index.num_blocks(w) - len(evictable[w][0]) >= per_worker:
                    index.remove(w, evictable[w].popleft())
            clock[0] += 0.005
    finally:
        gc.callbacks.remove(on_gc)

    def stats(xs: list[float]) -> dict[str, float]:
        s = sorted(xs)
        return {
            "p50": s[len(s) // 2],
            "p99": s[min(int(0.99 * len(s)), len(s) - 1)],
            "max": s[-1],
            "mean": statistics.mean(s),
        }

    total = [a + b + c for a, b, c in zip(hash_ms, decide_ms, spec_ms, strict=True)]
    summary = index.summary()
    return {
        "workers": n_workers,
        "entries": index.num_entries(),
        "distinct_blocks": summary["distinct_blocks"],
        "index_mb": summary["approx_bytes"] / 2**20,
        "populate_s": populate_s,
        "prompts": args.decisions,
        "prompt_tokens": prompt_tokens,
        "matched_blocks_mean": statistics.mean(matched),
        "decision_ms": stats(decide_ms),
        "hash_ms": stats(hash_ms),
        "speculate_ms": stats(spec_ms),
        "total_ms": stats(total),
        "gc_pauses_over_1ms": sum(1 for p in pauses if p >= 1.0),
        "gc_pause_max_ms": max(pauses, default=0.0),
        "decider": "Planner.plan",
    }


# -- report -----------------------------------------------------------------------------------


def pooled(rounds: dict[int, dict[str, Any]], mix: str) -> Phase:
    """Every round's samples of one mix, as one phase."""
    phases = [r[mix] for r in rounds.values()]
    return Phase(
        rate=phases[0].rate,
        duration=sum(p.duration for p in phases),
        sent=sum(p.sent for p in phases),
        ok=sum(p.ok for p in phases),
        in_time=sum(p.in_time for p in phases),
        latency_ms=sorted(x for p in phases for x in p.latency_ms),
        ttft_ms=sorted(x for p in phases for x in p.ttft_ms),
        lag_p99_ms=max(p.lag_p99_ms for p in phases),
        body_after_headers_ms=sorted(x for p in phases for x in p.body_after_headers_ms),
        cpu_ms={k: statistics.median(p.cpu_ms[k] for p in phases) for k in phases[0].cpu_ms},
    )


#: part one's request mixes, and which latency each is judged by
MIXES = (
    ("main", "latency"),
    ("stream", "ttft"),
    ("short", "latency"),
    ("chat", "latency"),
    ("long_stream", "latency"),
)


def figures(results: dict[str, dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    direct = results["direct"]
    for name in TARGETS:
        f: dict[str, Any] = {}
        for mix, which in MIXES:
            mine = pooled(results[name], mix)
            # Per round, against the baseline's same round; the median of the rounds, so
            # that one round disturbed by the rest of the machine does not make the figure.
            for p, tag in ((0.5, "p50"), (0.99, "p99")):
                rounds = [results[name][k][mix].q(p, which) for k in direct]
                added = [x - direct[k][mix].q(p, which) for k, x in enumerate(rounds)]
                f[f"{mix}_{tag}_ms"] = statistics.median(rounds)
                f[f"{mix}_added_{tag}_ms"] = statistics.median(added)
                f[f"{mix}_added_{tag}_ms_range"] = [min(added), max(added)]
            f[f"{mix}_ok_fraction"] = mine.ok / mine.sent
            f[f"{mix}_client_lag_p99_ms"] = mine.lag_p99_ms
            gaps = mine.body_after_headers_ms
            f[f"{mix}_body_after_headers_p50_ms"] = gaps[len(gaps) // 2] if gaps else None
            f[f"{mix}_cpu_ms_per_request"] = mine.cpu_ms
        f["others_cores"] = [
            max(r[mix].cpu_ms["others"], 0.0) * r[mix].rate / 1000
            for r in results[name].values()
            for mix in ("main", "stream", "short")
        ]
        # a stream's chunks beyond a short stream's: what each costs the router's CPU
        long_cpu = f["long_stream_cpu_ms_per_request"].get("router")
        short_cpu = f["stream_cpu_ms_per_request"].get("router")
        f["cpu_us_per_chunk"] = (
            (long_cpu - short_cpu) * 1000 / (LONG_STREAM_TOKENS - max_tokens)
            if long_cpu is not None and short_cpu is not None
            else None
        )
        last = results[name][max(results[name])]
        f["max_rps"] = last["max_rps"]
        f["ramp"] = last["ramp"]
        out[name] = f
    return out


def _ms(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:,.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 and a == a and b == b else "-"


def top_step(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The ramp's step at its highest sustained rate (its CPU figures), if any."""
    steps = [s for s in entry["ramp"] if s["sustained"]]
    return max(steps, key=lambda s: s["offered"]) if steps else None


def render_cores(cores_all: dict[str, Any]) -> list[str]:
    """The every-core table: each router given the whole machine, and where the CPU went
    at its highest sustained rate (the router's processes, the load generator, the rest
    of the machine: the workers and everything else)."""
    one = cores_all["kvpool_1proc"]["max_rps"]
    rows = [
        "| the whole machine to each router (load generator and workers share it) "
        "| highest sustained rate, req/s | vs one kvpool process "
        "| there: router CPU per request, ms | cores: router / load generator / rest |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, name in (
        ("kvpool_1proc", "kvpool router, 1 process"),
        ("kvpool_2proc", "kvpool router, `--processes 2`"),
        ("sglang", "SGLang router (its own threads)"),
    ):
        rate = cores_all[label]["max_rps"]
        top = top_step(cores_all[label])
        cpu, cores = "-", "-"
        if top is not None:
            c = top["cpu_ms_per_request"]
            per_s = top["completed_per_s"] / 1000
            cpu = f"{c['router']:.3f}"
            cores = " / ".join(
                f"{max(c.get(k, 0.0), 0.0) * per_s:.2f}" for k in ("router", "client", "others")
            )
        rows.append(f"| {name} | {rate:,.0f} | {rate / max(one, 1e-9):.2f}x | {cpu} | {cores} |")
    return rows


def render_long(long: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The long-prompt table and the huge prompt's lines."""
    kv, sg, di = long["kvpool"], long["sglang"], long["direct"]
    rows = [
        f"| streamed chat, {args.long_prompts} distinct prompts a size, one at a time "
        "| tokens | straight to the workers: first byte, ms | kvpool: added, ms "
        "| SGLang: added, ms | kvpool / SGLang | SGLang: added to its headers, ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for size in LONG_SIZES:
        a, b = kv["added_ttft_ms"][size], sg["added_ttft_ms"][size]
        rows.append(
            f"| {size} | {long['prompt_tokens'][size]:,.0f} | {_ms(di['ttfb_ms'][size])} "
            f"| {_ms(a)} | {_ms(b)} | {_ratio(a, b)} | {_ms(sg['added_headers_ms'][size])} |"
        )
    mb = long["huge_bytes"] / 2**20
    rows += [
        "",
        f"| a {mb:.1f} MB chat prompt among small requests every 10 ms | its answer "
        "| its answer, ms | small requests' worst latency meanwhile, ms "
        "| small requests before it: p50 / worst, ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, label in (("kvpool", "kvpool router"), ("sglang", "SGLang router")):
        h = long[name]["huge"]
        rows.append(
            f"| {label} | {h['status']} | {h['answer_ms']:,.1f} | "
            f"{h['small_max_during_ms']:,.1f} ({h['small_during']} requests) | "
            f"{h['small_p50_before_ms']:.2f} / {h['small_max_before_ms']:.2f} |"
        )
    return rows


def render(
    fig: dict[str, Any], decision: dict[str, Any], setup: dict[str, Any], args: argparse.Namespace
) -> tuple[str, dict[str, bool]]:
    kv, sg, di, ba = fig["kvpool"], fig["sglang"], fig["direct"], fig["bare"]
    profile = setup.get("profile")

    def added(f: dict[str, Any], mix: str, tag: str) -> str:
        lo, hi = f[f"{mix}_added_{tag}_ms_range"]
        spread = f" ({_ms(lo)} to {_ms(hi)})" if args.rounds > 1 else ""
        return _ms(f[f"{mix}_added_{tag}_ms"]) + spread

    def pair(f: dict[str, Any], mix: str) -> str:
        return f"{_ms(f[f'{mix}_p50_ms'])} / {_ms(f[f'{mix}_p99_ms'])}"

    def pair_added(f: dict[str, Any], mix: str) -> str:
        return f"{_ms(f[f'{mix}_added_p50_ms'])} / {_ms(f[f'{mix}_added_p99_ms'])}"

    cpu_kv = kv["main_cpu_ms_per_request"]["router"]
    cpu_sg = sg["main_cpu_ms_per_request"]["router"]
    rig = di["max_rps"]
    sg_rate = f"{sg['max_rps']:,.0f}" + (" (the rig's ceiling)" if sg["max_rps"] >= rig else "")
    tokens = setup["prompt_tokens_mean"]
    cpu_ba = ba["main_cpu_ms_per_request"]["router"]
    rows = [
        "| at 200 req/s unless said | straight to the workers | bare Python proxy (floor) "
        "| kvpool router | SGLang router (cache_aware) | kvpool / SGLang |",
        "|---|---:|---:|---:|---:|---:|",
        f"| latency p50 / p99, ms (~{tokens:.0f}-token prompts) | {pair(di, 'main')} "
        f"| {pair(ba, 'main')} | {pair(kv, 'main')} | {pair(sg, 'main')} | |",
        f"| **added p50, ms** | - | {added(ba, 'main', 'p50')} | {added(kv, 'main', 'p50')} "
        f"| {added(sg, 'main', 'p50')} "
        f"| {_ratio(kv['main_added_p50_ms'], sg['main_added_p50_ms'])} |",
        f"| **added p99, ms** | - | {added(ba, 'main', 'p99')} | {added(kv, 'main', 'p99')} "
        f"| {added(sg, 'main', 'p99')} "
        f"| {_ratio(kv['main_added_p99_ms'], sg['main_added_p99_ms'])} |",
        f"| streamed, first byte: added p50 / p99, ms | - | {pair_added(ba, 'stream')} "
        f"| {pair_added(kv, 'stream')} | {pair_added(sg, 'stream')} | |",
        f"| ~{setup['short_prompt_tokens_mean']:.0f}-token prompts: added p50 / p99, ms | - "
        f"| {pair_added(ba, 'short')} | {pair_added(kv, 'short')} | {pair_added(sg, 'short')} "
        "| |",
        f"| router CPU per request, ms | - | {cpu_ba:.3f} | {cpu_kv:.3f} | {cpu_sg:.3f} "
        f"| {_ratio(cpu_kv, cpu_sg)} |",
        f"| **highest sustained rate, req/s** | {rig:,.0f} (the rig's ceiling) "
        f"| {ba['max_rps']:,.0f} | {kv['max_rps']:,.0f} | {sg_rate} "
        f"| {kv['max_rps'] / sg['max_rps']:.2f}x |",
    ]
    peer_rows = [
        "| at 200 req/s unless said | added p50, ms | chats: added p50, ms "
        "| streamed: first byte added p50, ms "
        f"| router CPU per request, ms | chats: CPU per request, ms "
        f"| CPU per streamed chunk, µs ({LONG_STREAM_TOKENS}-token streams at "
        f"{args.stream_rate:g}/s) | highest sustained rate, req/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {"bare": "bare Python proxy (floor)", "kvpool": "kvpool router", **PEER_LABELS}
    for name in ("bare", "kvpool", *PEERS):
        f = fig[name]
        chunk = f["cpu_us_per_chunk"]
        peer_rows.append(
            f"| {labels[name]} "
            f"| {_ms(f['main_added_p50_ms'])} | {_ms(f['chat_added_p50_ms'])} "
            f"| {_ms(f['stream_added_p50_ms'])} "
            f"| {f['main_cpu_ms_per_request']['router']:.3f} "
            f"| {f['chat_cpu_ms_per_request']['router']:.3f} "
            f"| {'-' if chunk is None else f'{chunk:.2f}'} | {f['max_rps']:,.0f} |"
        )
    d = decision
    drows = [
        f"| {d['workers']} workers, {d['entries'] / 1e6:.2f}M indexed entries, "
        f"{d['prompts']:,} prompts of {d['prompt_tokens']:,} tokens | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
    ]
    for key, name in (
        ("decision_ms", f"**decision**: worker views + index lookup + `{d['decider']}`"),
        ("hash_ms", "hashing the prompt (512 blocks), before it"),
        ("speculate_ms", "speculative index entries, after it"),
        ("total_ms", "all three"),
    ):
        s = d[key]
        drows.append(f"| {name} | {s['p50']:.3f} | {s['p99']:.3f} | {s['max']:.3f} |")

    goals = {
        "added_p50": kv["main_added_p50_ms"] <= GOAL_ADDED_P50_MS,
        "added_p99": kv["main_added_p99_ms"] <= GOAL_ADDED_P99_MS,
        "decision_p99": d["decision_ms"]["p99"] <= GOAL_DECISION_P99_MS,
        "cpu_per_request": cpu_kv <= GOAL_CPU_MS,
        "cpu_per_chunk": (kv["cpu_us_per_chunk"] or math.inf) <= GOAL_CPU_US_PER_CHUNK,
        "rate": kv["max_rps"] >= sg["max_rps"],
    }
    cores_all = setup.get("cores_all")
    if cores_all is not None:
        one, two = cores_all["kvpool_1proc"]["max_rps"], cores_all["kvpool_2proc"]["max_rps"]
        goals["processes"] = two >= GOAL_PROCESSES_RATIO * one
    long = setup.get("long")
    if long is not None:
        goals["long_prompts"] = all(
            long["kvpool"]["added_ttft_ms"][k] <= long["sglang"]["added_ttft_ms"][k]
            for k in LONG_SIZES
        )
        # the same goal against the peer's routing work alone (its time to headers): its
        # first byte waits ~40 ms for a delayed ACK, which the goal above counts for it
        goals["long_prompts_routing_work"] = all(
            long["kvpool"]["added_ttft_ms"][k] <= long["sglang"]["added_headers_ms"][k]
            for k in LONG_SIZES
        )

    def met(ok: bool) -> str:
        return "met" if ok else "**missed**"

    goal_lines = [
        f"- added latency p50 <= {GOAL_ADDED_P50_MS:g} ms at 200 req/s: "
        f"{met(goals['added_p50'])} ({kv['main_added_p50_ms']:.2f} ms)",
        f"- added latency p99 <= {GOAL_ADDED_P99_MS:g} ms at 200 req/s: "
        f"{met(goals['added_p99'])} ({kv['main_added_p99_ms']:.2f} ms)",
        f"- decision time p99 <= {GOAL_DECISION_P99_MS:g} ms: {met(goals['decision_p99'])} "
        f"({d['decision_ms']['p99']:.3f} ms)",
        f"- router CPU per request <= {GOAL_CPU_MS:g} ms: {met(goals['cpu_per_request'])} "
        f"({cpu_kv:.3f} ms; the SGLang router's {cpu_sg:.3f} ms)",
        f"- router CPU per streamed chunk <= {GOAL_CPU_US_PER_CHUNK:g} µs: "
        f"{met(goals['cpu_per_chunk'])} ({kv['cpu_us_per_chunk'] or math.nan:.2f} µs)",
        f"- sustained rate on one core at least the SGLang router's: {met(goals['rate'])} "
        f"({kv['max_rps']:,.0f} vs {sg['max_rps']:,.0f} req/s)",
    ]
    if cores_all is not None:
        goal_lines.append(
            f"- 2 processes sustain >= {GOAL_PROCESSES_RATIO:g}x one on this machine: "
            f"{met(goals['processes'])} ({two:,.0f} vs {one:,.0f} req/s, "
            f"{two / max(one, 1e-9):.2f}x)"
        )
    if long is not None:
        goal_lines.append(
            "- added TTFT of 1k, 4k and 16k-token streamed chats at most the SGLang router's: "
            f"{met(goals['long_prompts'])} (its first chunk waits for a delayed ACK); against "
            "its time to headers, the routing work alone: "
            f"{met(goals['long_prompts_routing_work'])} ("
            + ", ".join(
                f"{k} {long['kvpool']['added_ttft_ms'][k]:.1f} vs "
                f"{long['sglang']['added_headers_ms'][k]:.1f} ms"
                for k in LONG_SIZES
            )
            + ")"
        )
    cores = setup["cores"]
    others = [x for f in fig.values() for x in f["others_cores"]]
    load = setup["loadavg"]
    busy = (
        f" Other processes on the machine (not the benchmark's) used "
        f"{statistics.mean(others):.2f} cores on average during the 200 req/s stretches, "
        f"{max(others):.2f} at most in one (1-minute load average {load[0]:.2f} at the "
        f"start, {load[1]:.2f} at the end)."
    )
    if setup["pinned"]:
        layout = (
            f"The router runs alone on core {setup['router_cpus'][0]}; the load generator and "
            f"the workers share core(s) {', '.join(map(str, setup['load_cpus']))}, in the "
            f"baseline too, so the difference is the router's own work plus one more loopback "
            f"hop, not a fight for a core."
        )
    else:
        layout = "Nothing is pinned: the router, the workers and the load generator share them."
    spread = " (in brackets, the lowest and the highest round)" if args.rounds > 1 else ""
    client_ms = di["main_cpu_ms_per_request"]["client"]
    gap = sg["stream_body_after_headers_p50_ms"]
    nagle = ""
    if gap is not None and gap > 20:
        nagle = (
            f" The SGLang router's streamed answers start with their headers at once and their "
            f"first body bytes {gap:.0f} ms later (p50): the first chunk waits for the "
            f"client's delayed acknowledgement of the headers (Nagle's algorithm on the "
            f"router's socket), which any client of it sees."
        )
    notes = (
        f"{args.workers} zero-latency stub workers (in this script, one process); one "
        f"load-generator process (uvloop, httptools, keep-alive connections; {client_ms:.2f} ms "
        f"of CPU per request at 200 req/s). Requests: `/v1/completions`, `max_tokens` "
        f"{args.max_tokens}, prompts of one of 16 shared system prompts and a question of "
        f"their own (~{tokens:.0f} tokens with the tiny model's tokenizer, "
        f"~{setup['prompt_chars_mean']:.0f} characters); Poisson arrivals, the same requests "
        f"at the same times for all four. Latency: from writing the request to the last byte "
        f"of the answer (streamed: to the first body byte), at the client; added = the "
        f"router's quantile minus the baseline's in the same round, the median of "
        f"{args.rounds} round(s) of {args.phase_s:g} s per target, the four taken in "
        f"turn{spread}.{nagle} Highest "
        f"sustained rate: offered load raised 1.5x a step ({args.step_s:g} s each, a failed "
        f"step tried twice, then the gap halved twice) while 95% of a step's requests complete "
        f"within it with p99 <= {args.p99_limit_ms:g} ms; the baseline's is the ceiling of "
        f"the load generator and the workers, which caps every column.\n\n"
        f"**On this {cores}-core machine.** {layout}{busy} So each router's figures are what "
        f"one core of it does. The kvpool router is one Python process (one event loop): one "
        f"core is all it can use anywhere. The SGLang router (Rust, a thread per core) would "
        f"use more cores where it has them. Router CPU per request is the figure that carries "
        f"to other machines: one core sustains at most 1000 / that many requests a second "
        f"({1000 / cpu_kv:,.0f} for kvpool, {1000 / cpu_sg:,.0f} for SGLang here), less as "
        f"queueing sets in; at 200 req/s the kvpool router's core is "
        f"{cpu_kv * args.rate / 10:.0f}% busy, so most of its added latency is waiting behind "
        f"other requests. The workers answer in microseconds, so every millisecond above is "
        f"routing and proxying: a real worker's tens to hundreds of milliseconds would dwarf "
        f"it, but the router is in every request's path.\n\n"
        f"Decision time: `kvpool.router`'s index, pool views and policy in a process of its "
        f"own, no HTTP; {d['distinct_blocks']:,} distinct blocks, ~{d['index_mb']:.0f} MB of index "
        f"(built in {d['populate_s']:.1f} s); prompts: half new questions on a shared prefix "
        f"(Zipf), a quarter follow-ups of a cached conversation, a quarter cold (longest "
        f"match {d['matched_blocks_mean']:.0f} blocks on average); each decision's blocks are "
        f"confirmed as KV events would be 8 decisions later, and its worker evicts to keep "
        f"its share; the default policy, 60 workers with learned prefill rates and 4 new "
        f"ones, 64 requests in flight; garbage collection on, as in the router "
        f"({d['gc_pauses_over_1ms']} pauses of 1 ms or more while timing, longest "
        f"{d['gc_pause_max_ms']:.1f} ms)."
    )
    text = "\n".join(
        [
            "## Added latency and highest sustained rate",
            "",
            *rows,
            "",
            "## Beside today's peers: chats and long streams",
            "",
            *peer_rows,
            "",
            "## Routing decision time",
            "",
            *drows,
            "",
            *(["## Long prompts", "", *render_long(long, args), ""] if long else []),
            *(["## Every core", "", *render_cores(cores_all), ""] if cores_all else []),
            *(
                ["## Where the kvpool router's time goes", "", *render_profile(profile), ""]
                if profile
                else []
            ),
            "## Goals",
            "",
            *goal_lines,
            "",
            notes,
        ]
    )
    return text, goals


def plot(results: dict[str, dict[str, Any]], fig: dict[str, Any], path: Path, limit: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"direct": "straight to the workers", "kvpool": "kvpool router"}
    labels["bare"] = "bare Python proxy (floor)"
    labels |= PEER_LABELS
    figure, (cdf, ramp) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, label in labels.items():
        style = {"linewidth": 2.5} if name == "kvpool" else {"linestyle": "--"}
        xs = pooled(results[name], "main").latency_ms
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label, **style)
        steps = sorted(fig[name]["ramp"], key=lambda r: r["offered"])
        ramp.plot([r["offered"] for r in steps], [r["p99_ms"] for r in steps], marker="o", **style)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency at 200 req/s, ms (log)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Latency CDF, non-streamed completions")
    cdf.legend()
    ramp.axhline(limit, color="grey", linewidth=1)
    ramp.set_xscale("log")
    ramp.set_yscale("log")
    ramp.set_xlabel("offered load, req/s (log)")
    ramp.set_ylabel("p99 latency, ms (log)")
    ramp.set_title(f"Ramp (grey: the {limit:g} ms limit)")
    for ax in (cdf, ramp):
        ax.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def index_figures(results: Path) -> dict[str, Any]:
    """The index's own figures the issue names beside these, from ``bench/index.py``'s
    latest run (its results file, dated): that benchmark builds 50M entries, too long to
    run here again."""
    path = results / "index.json"
    if not path.is_file():
        return {}
    index = json.loads(path.read_text())
    keys = ("index_bytes_per_entry", "index_max_stall_ms", "event_apply_blocks_per_s")
    return {
        **{k: index[k] for k in keys if k in index},
        "index_from": f"bench/index.py, {index.get('date', '?')}",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/tiny-model"))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=200.0, help="req/s for added latency")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=8.0)
    parser.add_argument("--short-phase-s", type=float, default=4.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--step-s", type=float, default=4.0, help="seconds per ramp step")
    parser.add_argument("--ramp-start", type=float, default=100.0)
    parser.add_argument("--ramp-max", type=float, default=20000.0)
    parser.add_argument("--p99-limit-ms", type=float, default=50.0)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--stream-rate", type=float, default=20.0, help=f"{LONG_STREAM_TOKENS}-token streams/s"
    )
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--indexed-blocks", type=int, default=1_000_000)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--long-prompts", type=int, default=15, help="prompts per size")
    parser.add_argument(
        "--profile-s",
        type=float,
        default=10.0,
        help="seconds of py-spy on the kvpool router at --rate (0: none)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (~2 min)")
    parser.add_argument(
        "--only-long", action="store_true", help="only the long-prompt part, printed, not saved"
    )
    parser.add_argument(
        "--only-cores",
        action="store_true",
        help="only the every-core part (1 and 2 processes), printed, not saved",
    )
    parser.add_argument(
        "--only-decision",
        action="store_true",
        help="only the decision-time part, printed, not saved",
    )
    args = parser.parse_args()
    if args.only_decision:
        print(json.dumps(part_two(args), indent=2))
        return 0
    if args.quick:
        args.rounds, args.phase_s, args.short_phase_s, args.warmup_s = 1, 3.0, 2.0, 1.0
        args.step_s, args.decisions, args.long_prompts = 2.0, 300, 5
        args.profile_s = min(args.profile_s, 3.0)

    started, load_start = time.monotonic(), os.getloadavg()[0]
    import tempfile

    import uvloop

    if not (args.model / "config.json").is_file():
        subprocess.run([*KVPOOL, "worker", "make-tiny-model", str(args.model)], env=ENV, check=True)
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        logs = Path(tmp)
        try:
            if args.only_long:
                long = uvloop.run(part_three(args, args.model.resolve(), logs))
                print("\n".join(render_long(long, args)))
                return 0
            if args.only_cores:
                cores_all = uvloop.run(part_four(args, args.model.resolve(), logs))
                print("\n".join(render_cores(cores_all)))
                return 0
            results, setup = uvloop.run(part_one(args, args.model.resolve(), logs))
            print("long prompts", file=sys.stderr, flush=True)
            setup["long"] = uvloop.run(part_three(args, args.model.resolve(), logs))
            setup["cores_all"] = uvloop.run(part_four(args, args.model.resolve(), logs))
        except Exception:
            for log in sorted(logs.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)
            raise
    print("decision time: populating the index", file=sys.stderr, flush=True)
    decision = decision_in_a_fresh_process(args)
    setup["loadavg"] = [load_start, os.getloadavg()[0]]
    fig = figures(results, args.max_tokens)
    text, goals = render(fig, decision, setup, args)
    elapsed = time.monotonic() - started
    from importlib.metadata import version

    machine = f"{platform.machine()}, {setup['cores']} cores, Python {platform.python_version()}"
    peer = ", ".join(f"{dist} {version(dist)}" for dist in PEERS.values())
    header = (
        f"# Router overhead ({dt.date.today()}, {machine}; {peer}; run time "
        f"{elapsed / 60:.1f} min{', --quick' if args.quick else ''})\n"
    )
    print(header)
    print(text)
    kv, sg = fig["kvpool"], fig["sglang"]
    out = {
        "added_p50_ms": kv["main_added_p50_ms"],
        "added_p99_ms": kv["main_added_p99_ms"],
        "decision_p99_ms": decision["decision_ms"]["p99"],
        "max_rps": kv["max_rps"],
        "sglang_max_rps": sg["max_rps"],
        "sglang_added_p50_ms": sg["main_added_p50_ms"],
        "sglang_added_p99_ms": sg["main_added_p99_ms"],
        "direct_max_rps": fig["direct"]["max_rps"],
        "max_rps_2proc": setup["cores_all"]["kvpool_2proc"]["max_rps"],
        "max_rps_1proc_all_cores": setup["cores_all"]["kvpool_1proc"]["max_rps"],
        "sglang_max_rps_all_cores": setup["cores_all"]["sglang"]["max_rps"],
        "router_cpu_ms_per_request": kv["main_cpu_ms_per_request"]["router"],
        "bare_proxy_cpu_ms_per_request": fig["bare"]["main_cpu_ms_per_request"]["router"],
        "bare_proxy_max_rps": fig["bare"]["max_rps"],
        "bare_proxy_added_p50_ms": fig["bare"]["main_added_p50_ms"],
        "sglang_cpu_ms_per_request": sg["main_cpu_ms_per_request"]["router"],
        "router_cpu_us_per_chunk": kv["cpu_us_per_chunk"],
        "chat_added_p50_ms": kv["chat_added_p50_ms"],
        "chat_cpu_ms_per_request": kv["chat_cpu_ms_per_request"]["router"],
        **{
            f"{name.replace('-', '_')}_{key}": value
            for name in PEERS
            for key, value in (
                ("router_cpu_ms_per_request", fig[name]["main_cpu_ms_per_request"]["router"]),
                ("router_cpu_us_per_chunk", fig[name]["cpu_us_per_chunk"]),
                ("added_p50_ms", fig[name]["main_added_p50_ms"]),
                ("chat_added_p50_ms", fig[name]["chat_added_p50_ms"]),
                ("max_rps", fig[name]["max_rps"]),
            )
        },
        "long_prompt_added_ttft_ms": setup["long"]["kvpool"]["added_ttft_ms"],
        "sglang_long_prompt_added_ttft_ms": setup["long"]["sglang"]["added_ttft_ms"],
        "huge_prompt": {k: setup["long"][k]["huge"] for k in ("kvpool", "sglang")},
        "goals": goals,
        "date": str(dt.date.today()),
        "machine": machine,
        "cores": setup["cores"],
        "peer": peer,
        "run_time_s": round(elapsed, 1),
        "setup": setup,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "targets": fig,
        "decision": decision,
        "profile": setup.get("profile"),
    }
    out |= index_figures(args.results_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "router_overhead.md").write_text(header + "\n" + text + "\n")
    (args.results_dir / "router_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(results, fig, args.results_dir / "router_overhead.png", args.p99_limit_ms)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--stub-workers":
        serve_stub_workers(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--bare-proxy":
        serve_bare_proxy(int(sys.argv[2]), sys.argv[3].split(","))
        sys.exit(0)
    sys.exit(main())
