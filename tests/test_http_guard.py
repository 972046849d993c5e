"""Slow, greedy and malformed clients against a real uvicorn server with kvpool's HTTP guard.

Probed on loopback, connections dribbling a header byte by byte held the router for ever, a
few endless headers starved its event loop (httptools grows a header quadratically), and one
address could take every connection. Here each attack runs against a small Starlette app
served by ``uvicorn.Server`` (as the router serves) with small limits, and the test is that
the attacker is cut off and other clients are served.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from kvpool.httpguard import (
    HEADER_TIMEOUT,
    HEADER_TOO_LARGE,
    TOO_MANY_CONNECTIONS,
    BodyError,
    HttpLimits,
    client_key,
    guarded_config,
    read_body,
)

BODY_LIMIT = 100_000
BODY_TIMEOUT_S = 0.4
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def _app(release: threading.Event) -> Starlette:
    async def hello(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def echo(request: Request) -> Response:
        try:
            body = await read_body(request, limit_bytes=BODY_LIMIT, timeout_s=BODY_TIMEOUT_S)
        except BodyError as e:
            error = {"message": str(e), "type": "invalid_request_error", "code": e.code}
            return JSONResponse({"error": {**error, "param": None}}, status_code=e.status)
        return JSONResponse({"bytes": len(body), "head": body[:16].decode()})

    async def slow(request: Request) -> Response:
        await asyncio.to_thread(release.wait, 10)
        return PlainTextResponse("slow")

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.close()

    return Starlette(
        routes=[
            Route("/", hello),
            Route("/echo", echo, methods=["POST"]),
            Route("/slow", slow),
            WebSocketRoute("/ws", ws),
        ]
    )


@dataclass
class Served:
    port: int
    protocol: Any  # the guarded protocol class: its live ``clients`` and ``refusals``
    release: threading.Event  # lets /slow answer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open_from(self, host: str) -> int:
        return self.protocol.clients.open.get(host, 0)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    running: list[tuple[uvicorn.Server, threading.Thread, threading.Event]] = []

    def start(limits: HttpLimits, **config: Any) -> Served:
        release = threading.Event()
        cfg = uvicorn.Config(
            _app(release),
            host="127.0.0.1",
            port=0,
            lifespan="off",
            log_level="warning",
            access_log=False,
            **config,
        )
        protocol = guarded_config(cfg, limits)
        server = uvicorn.Server(cfg)
        thread = threading.Thread(target=server.run, name="test-guarded", daemon=True)
        thread.start()
        running.append((server, thread, release))
        _wait_for(lambda: server.started or not thread.is_alive(), "the server to start")
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        return Served(port, protocol, release)

    yield start
    for server, thread, release in running:
        release.set()
        server.should_exit = True
        thread.join(10)


async def _answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """All the server sends until it closes, then a marker if it reset the connection (our
    next byte met the closed socket) or held it open past ``timeout``."""
    received = b""
    try:
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                received += chunk
    except TimeoutError:
        return received + b"<still open>"
    except ConnectionError:
        return received + b"<reset>"
    return received


async def _open(port: int, source: str = "127.0.0.1") -> tuple[Any, Any]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


def _dribble(writer: asyncio.StreamWriter, data: bytes) -> None:
    try:
        writer.write(data)
    except (ConnectionError, RuntimeError):
        pass  # cut already, as it should be


def test_slow_header_connections_are_cut_and_other_clients_are_served_meanwhile(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits(header_timeout_s=0.3, max_connections_per_client=1000))

    async def attack() -> tuple[list[bytes], bytes, bytes]:
        conns = [await _open(server.port) for _ in range(200)]
        quiet = await _open(server.port)  # connects, never sends a byte
        stalled = await _open(server.port)  # sends part of its headers, then nothing
        stalled[1].write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        for _, writer in conns:
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        async with httpx.AsyncClient(timeout=5) as client:
            # A byte on every connection every 50 ms, while a well-behaved client is served:
            # past the header time limit, every attacker is cut, however steady its bytes.
            for i in range(12):
                for _, writer in conns:
                    _dribble(writer, b"x")
                ok = await client.get(server.url + "/")
                assert ok.status_code == 200, (i, ok.text)
                await asyncio.sleep(0.05)
        answers = [await _answer(reader) for reader, _ in conns]
        for _, writer in conns:
            writer.close()
        silent, late = await _answer(quiet[0]), await _answer(stalled[0])
        quiet[1].close()
        stalled[1].close()
        return answers, silent, late

    answers, silent, late = asyncio.run(attack())
    # Every attacker was cut: answered 408, or reset when its next byte met the closed
    # socket (a reset loses what the client had not read yet).
    assert all(a.startswith(b"HTTP/1.1 408") or a.endswith(b"<reset>") for a in answers), [
        a for a in answers if not a.endswith(b"<reset>")
    ][:3]
    assert late.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in late, late
    assert silent == b""  # no request was made, so none is answered: just closed
    assert server.protocol.refusals[HEADER_TIMEOUT] == 202
    _wait_for(lambda: server.open_from("127.0.0.1") == 0, "every place to be given back")


def test_an_endless_header_gets_431_and_the_server_keeps_serving(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits(max_header_bytes=8192))

    async def attack() -> list[bytes]:
        streams = [await _open(server.port) for _ in range(3)]
        for _, writer in streams:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: ")
        async with httpx.AsyncClient(timeout=5) as client:
            for _ in range(64):  # 16 KiB of one header each, 256 bytes at a time
                for _, writer in streams:
                    _dribble(writer, b"a" * 256)
                assert (await client.get(server.url + "/")).status_code == 200
        return [await _answer(reader) for reader, _ in streams]

    answers = asyncio.run(attack())
    assert all(a.startswith(b"HTTP/1.1 431") for a in answers), answers
    assert b"over 8192 bytes" in answers[0]
    assert server.protocol.refusals[HEADER_TOO_LARGE] == 3
    # A body far over the header limit, in one piece with its small headers, is no header.
    big = httpx.post(server.url + "/echo", content=b"b" * 50_000, timeout=5)
    assert big.status_code == 200 and big.json()["bytes"] == 50_000
    # Headers just under the limit pass.
    ok = httpx.get(server.url + "/", headers={"x-fill": "f" * 7000}, timeout=5)
    assert ok.status_code == 200


def test_a_header_pipelined_behind_a_long_request_is_bounded_too(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits(max_header_bytes=4096))

    async def attack() -> bytes:
        reader, writer = await _open(server.port)
        # The first request holds its response; the second's header never ends, and most
        # of it comes in the same piece as the first request.
        writer.write(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\nX-Long: "
            + b"a" * 3800
        )
        await writer.drain()
        for _ in range(2):
            _dribble(writer, b"a" * 256)
            await asyncio.sleep(0.05)
        answer = await _answer(reader, timeout=3)
        writer.close()
        return answer

    answer = asyncio.run(attack())
    # Cut while /slow still holds its answer: no 431 can be written into that response.
    assert answer in (b"", b"<reset>"), answer[:100]
    assert not server.release.is_set()
    assert server.protocol.refusals[HEADER_TOO_LARGE] == 1
    server.release.set()
    assert httpx.get(server.url + "/", timeout=5).status_code == 200


def test_one_client_cannot_take_every_connection(serve: Callable[..., Served]) -> None:
    # Connections count once their request is late (half the header timeout): three take
    # the places, a fourth is refused (429 when it began a request, closed without a word
    # when it sent nothing, as the header timeout closes one).
    server = serve(HttpLimits(max_connections_per_client=3, header_timeout_s=5))
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    assert server.open_from("127.0.0.1") == 0  # not yet: they may still send
    extra = socket.create_connection(("127.0.0.1", server.port))
    extra.sendall(b"GET / HTTP/1.1\r\n")  # and the rest never comes
    # Four late connections, three places: one is cut (which depends on when each one's
    # grace ends, which a stall of the loop may reorder).
    _wait_for(lambda: server.protocol.refusals[TOO_MANY_CONNECTIONS] == 1, "one cut", 60)
    assert server.open_from("127.0.0.1") == 3
    extra.settimeout(30)
    answer = extra.recv(4096)
    extra.close()
    # cut, it is told why (it began a request); kept, its header time runs out
    assert answer.startswith((b"HTTP/1.1 429", b"HTTP/1.1 408")), answer
    # Another address (all of 127/8 is loopback) is served while the first holds its three.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=5) as client:
        assert client.get(server.url + "/").status_code == 200
    # Places come back however a connection ends: a reset here, a close there.
    held[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    for s in held:
        s.close()
    _wait_for(lambda: server.open_from("127.0.0.1") == 0, "the places to be given back")
    with httpx.Client(timeout=5) as client:  # keep-alive: three requests, one place
        assert all(client.get(server.url + "/").status_code == 200 for _ in range(3))


def test_websocket_upgrades_give_their_place_back(serve: Callable[..., Served]) -> None:
    server = serve(HttpLimits(max_connections_per_client=2))
    upgrade = (
        "GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )

    async def upgrades() -> list[bytes]:
        answers = []
        for path in ["/ws", "/nowhere"] * 3:  # accepted then closed; refused (403)
            reader, writer = await _open(server.port)
            writer.write(upgrade.format(path=path).encode())
            answers.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5))
            writer.close()  # without a close frame: the websocket ends as the socket does
        return answers

    answers = asyncio.run(upgrades())
    assert [a[:12] for a in answers] == [b"HTTP/1.1 101", b"HTTP/1.1 403"] * 3, answers
    _wait_for(lambda: server.open_from("127.0.0.1") == 0, "the places to be given back")
    assert httpx.get(server.url + "/", timeout=5).status_code == 200


def test_a_slow_body_gets_408_and_its_connection_is_not_held(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits(header_timeout_s=0.5))

    async def slow_body() -> tuple[bytes, bytes]:
        reader, writer = await _open(server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: 1000\r\n\r\n{")
        answer = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
        # Answered, it goes on dribbling its body: it is cut within the grace.
        async with asyncio.timeout(5):
            while not reader.at_eof() and not writer.is_closing():
                _dribble(writer, b"x")
                await asyncio.sleep(0.05)
        end = await _answer(reader, timeout=1)
        writer.close()
        return answer, end

    answer, end = asyncio.run(slow_body())
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request_timeout" in answer
    assert b"did not arrive within 0.4 s" in answer
    assert end in (b"", b"<reset>")


def test_a_body_over_the_limit_gets_413_before_it_is_sent_and_the_connection_goes_on(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits(max_header_bytes=4096), timeout_keep_alive=1)

    head = f"POST /echo HTTP/1.1\r\nHost: x\r\ncontent-length: {10 * BODY_LIMIT}\r\n\r\n"

    async def too_large(then: bytes) -> tuple[bytes, bytes]:
        reader, writer = await _open(server.port)
        writer.write(head.encode())
        refused = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
        # The body comes anyway, far more than a header may hold: it is read and dropped.
        for _ in range(10):
            writer.write(b"b" * BODY_LIMIT)
            await writer.drain()
        writer.write(then)
        after = await _answer(reader, timeout=5)
        writer.close()
        return refused, after

    # The next request on the connection is served; idle then, uvicorn's keep-alive timeout
    # ends the connection quietly.
    refused, after = asyncio.run(too_large(REQUEST))
    assert refused.startswith(b"HTTP/1.1 413"), refused
    assert b"request_too_large" in refused and b"the limit is 100000" in refused
    assert after.startswith(b"HTTP/1.1 200") and after.endswith(b"\r\n\r\nok"), after
    # With no next request, the keep-alive timeout still ends it, and with no 408.
    assert asyncio.run(too_large(b""))[1] == b""


def test_the_body_helper_reads_bodies_whole_and_refuses_chunked_ones_over_the_limit(
    serve: Callable[..., Served],
) -> None:
    server = serve(HttpLimits())
    payload = b'{"prompt": "hello"}' * 1000
    ok = httpx.post(server.url + "/echo", content=payload, timeout=5)
    assert ok.status_code == 200
    assert ok.json() == {"bytes": len(payload), "head": payload[:16].decode()}

    def chunks(n: int) -> Iterator[bytes]:  # no content-length: sent chunked
        for _ in range(n):
            yield b"c" * 10_000

    assert httpx.post(server.url + "/echo", content=chunks(5), timeout=5).status_code == 200
    big = httpx.post(server.url + "/echo", content=chunks(50), timeout=5)
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"


def test_a_client_is_one_address_however_it_is_spelled() -> None:
    assert client_key("10.1.2.3") == "10.1.2.3"
    assert client_key("::ffff:10.1.2.3") == "10.1.2.3"  # IPv4 on a dual-stack socket
    assert client_key("2001:DB8:0:0::1") == client_key("2001:db8::1")
    # Pods of one node may share a /64: each address is its own client.
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:2::2")
    assert client_key("some-unix-peer") == "some-unix-peer"


def test_limits_are_checked_and_installed_before_the_server_loads() -> None:
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections_per_client"):
        HttpLimits(max_connections_per_client=0)
    config = uvicorn.Config(_app(threading.Event()), lifespan="off")
    protocol = guarded_config(config, HttpLimits())
    assert config.http is protocol
    config.load()
    assert config.http_protocol_class is protocol
    with pytest.raises(RuntimeError, match="before the uvicorn config loads"):
        guarded_config(config, HttpLimits())
