"""The router's HTTP client to the workers (``router/proxy/upstream.py``), against raw servers on
127.0.0.1 that write exactly the bytes each test needs: connections kept and reused, never
reused once the worker closed them or the answer was left unread, a streamed body handed on
as it arrives and the socket paused while nobody reads it, and each way a worker can fail
told apart (refused, not accepting, cut short, not HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvpool.router.proxy.http1 import (
    HIGH_WATER,
    ConnectFailed,
    ConnectTimedOut,
    UpstreamClosed,
    _Address,
)
from kvpool.router.proxy.upstream import Upstream

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A TCP server on 127.0.0.1 that runs ``handler`` per connection and counts them."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer.set()
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def raw_server(handler: Callable[[RawServer], Handler]) -> AsyncIterator[RawServer]:
    srv = RawServer(None)  # type: ignore[arg-type]
    srv.handler = handler(srv)
    srv.server = await asyncio.start_server(srv._serve, "127.0.0.1", 0)
    try:
        yield srv
    finally:
        srv.server.close()


def answer(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + b"".join(extra)
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def keep_answering(srv: RawServer) -> Handler:
    """Answers every request on the connection with its own body, then waits for the next."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                body = await srv.read_request(reader)
            except asyncio.IncompleteReadError:  # the client closed the connection
                srv.closed_by_peer.set()
                return
            writer.write(answer(body))
            await writer.drain()

    return handler


async def test_a_connection_is_kept_and_reused_for_the_next_request() -> None:
    client = Upstream(connect_timeout_s=2.0, headers={"Authorization": "Bearer k"})
    async with raw_server(keep_answering) as srv:
        for i in range(3):
            resp = await client.post(srv.url, "/v1/completions", b'{"n": %d}' % i, {"x-a": "1"})
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == b'{"n": %d}' % i
            resp.release()
        assert srv.connections == 1
        first = srv.requests[0].lower()
        assert first.startswith(b"post /v1/completions http/1.1\r\n")
        assert b"authorization: bearer k\r\n" in first and b"x-a: 1\r\n" in first
    await client.close()


async def test_an_answer_left_unread_closes_its_connection_and_the_next_request_opens_one() -> None:
    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(keep_answering) as srv:
        resp = await client.post(srv.url, "/v1/completions", b"x" * 100, {})
        resp.close()  # a client that left: the worker must see the connection end
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
        resp = await client.post(srv.url, "/v1/completions", b"y", {})
        assert await resp.read() == b"y"
        resp.release()
        assert srv.connections == 2
    await client.close()


async def test_a_connection_the_worker_closed_is_not_reused() -> None:
    def once(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            writer.write(answer(body))  # kept alive by its headers, then closed anyway
            await writer.drain()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(once) as srv:
        resp = await client.post(srv.url, "/a", b"1", {})
        assert await resp.read() == b"1"
        resp.release()
        for _ in range(100):  # the worker's FIN reaches the connection
            if client.idle_connections() == 0:
                break
            await asyncio.sleep(0.01)
        resp = await client.post(srv.url, "/a", b"2", {})
        assert await resp.read() == b"2"
        resp.release()
        assert srv.connections == 2
    await client.close()


async def test_connection_close_from_the_worker_is_honoured() -> None:
    def closing(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            writer.write(answer(body, b"connection: close\r\n"))
            await writer.drain()
            await reader.read()  # open until the client closes it
            srv.closed_by_peer.set()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(closing) as srv:
        resp = await client.post(srv.url, "/a", b"1", {})
        assert await resp.read() == b"1"
        resp.release()
        assert client.idle_connections() == 0
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)  # closed, not leaked
    await client.close()


async def test_a_chunked_stream_is_handed_on_as_it_arrives() -> None:
    gate = asyncio.Event()

    def streaming(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"5\r\nfirst\r\n")
            await writer.drain()
            await gate.wait()
            writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
            await writer.drain()
            await reader.read()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(streaming) as srv:
        resp = await client.post(srv.url, "/v1/completions", b"{}", {})
        chunks = resp.iter_any()
        assert await asyncio.wait_for(anext(chunks), 5) == b"first"  # before the rest is sent
        gate.set()
        assert b"".join([c async for c in chunks]) == b"second"
        assert resp.complete
        resp.release()
        assert client.idle_connections() == 1
    await client.close()


async def test_a_stream_nobody_reads_stops_being_read_from_the_socket() -> None:
    total = 256 * HIGH_WATER  # 64 MiB: far more than the client buffers, or the sockets hold
    sent = 0

    def flooding(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal sent
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
            piece = b"x" * 65536
            while sent < total:
                writer.write(piece)
                await writer.drain()
                sent += len(piece)

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(flooding) as srv:
        resp = await client.post(srv.url, "/a", b"{}", {})
        await asyncio.sleep(0.5)
        assert sent < total  # the worker is held back
        # and the router holds at most its high-water mark and one read more
        assert resp._paused and resp._buffered <= HIGH_WATER + 512 * 1024
        got = 0
        async for chunk in resp.iter_any():  # a reader that keeps up gets it all
            got += len(chunk)
        assert got == total
        resp.release()
    await client.close()


async def test_an_answer_cut_short_is_an_error_not_a_short_body() -> None:
    def cutting(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
            await writer.drain()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(cutting) as srv:
        resp = await client.post(srv.url, "/a", b"{}", {})
        with pytest.raises(UpstreamClosed):
            await resp.read()
        resp.release()
        assert client.idle_connections() == 0
    await client.close()


async def test_a_worker_that_closes_before_answering_or_speaks_no_http_fails_the_request() -> None:
    def garbage(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            if body == b"garbage":
                writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
                await writer.drain()
                await reader.read()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(garbage) as srv:
        with pytest.raises(UpstreamClosed, match="closed the connection"):
            await client.post(srv.url, "/a", b"silence", {})
        with pytest.raises(UpstreamClosed, match="not HTTP"):
            await client.post(srv.url, "/a", b"garbage", {})
    await client.close()


async def test_a_refused_connection_and_one_never_accepted_are_told_apart() -> None:
    client = Upstream(connect_timeout_s=0.3)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectFailed) as refused:
        await client.post(f"http://127.0.0.1:{port}", "/a", b"{}", {})
    assert isinstance(refused.value.os_error, ConnectionRefusedError)

    # A listener that never accepts, its backlog full: connecting waits (a busy worker).
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        fillers = []
        try:
            for _ in range(8):
                f = socket.socket()
                f.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    f.connect(listener.getsockname())
                fillers.append(f)
            with pytest.raises(ConnectTimedOut):
                await client.post(url, "/a", b"{}", {})
        finally:
            for f in fillers:
                f.close()
    await client.close()


async def test_an_answer_released_unread_closes_its_connection() -> None:
    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(keep_answering) as srv:
        resp = await client.post(srv.url, "/v1/completions", b"x" * 100, {})
        resp.release()  # its body never read: the connection cannot carry another answer
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
        assert client.idle_connections() == 0
    await client.close()


async def test_an_answer_dropped_unreleased_closes_its_connection() -> None:
    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(keep_answering) as srv:
        resp = await client.post(srv.url, "/v1/completions", b"x" * 100, {})
        del resp
        gc.collect()
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)
    await client.close()


async def test_a_request_cancelled_before_the_answer_closes_its_connection() -> None:
    def silent(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            if await reader.read() == b"":  # nothing more comes: the router closed it
                srv.closed_by_peer.set()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(silent) as srv:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):  # the router's own deadline
                await client.post(srv.url, "/a", b"{}", {})
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)  # the worker can abort
    await client.close()


async def test_a_kept_connection_the_worker_closes_as_it_is_reused_is_retried_on_a_new_one() -> (
    None
):
    def closing_on_reuse(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            writer.write(answer(body))
            await writer.drain()
            await srv.read_request(reader)  # its keep-alive ran out just as this came

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(closing_on_reuse) as srv:
        for body in (b"1", b"2"):
            resp = await client.post(srv.url, "/a", body, {})
            assert await resp.read() == body
            resp.release()
        assert srv.connections == 2
        assert len(srv.requests) == 3  # the second request twice: on the old, then a new one
    await client.close()


async def test_a_kept_connection_that_fails_after_a_while_is_not_sent_again() -> None:
    def dying(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            writer.write(answer(body))
            await writer.drain()
            await srv.read_request(reader)
            await asyncio.sleep(0.5)  # works on it, then dies without a word

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(dying) as srv:
        resp = await client.post(srv.url, "/a", b"1", {})
        assert await resp.read() == b"1"
        resp.release()
        with pytest.raises(UpstreamClosed):  # the router's retry loop decides, not this
            await client.post(srv.url, "/a", b"2", {})
        assert len(srv.requests) == 2 and srv.connections == 1
    await client.close()


async def test_a_connection_idle_past_the_keep_alive_is_not_reused() -> None:
    client = Upstream(connect_timeout_s=2.0, keepalive_s=0.05)
    async with raw_server(keep_answering) as srv:
        for body in (b"1", b"2"):
            resp = await client.post(srv.url, "/a", body, {})
            assert await resp.read() == body
            resp.release()
            await asyncio.sleep(0.1)
        assert srv.connections == 2
        await asyncio.wait_for(srv.closed_by_peer.wait(), 5)  # the stale one was closed
    await client.close()


async def test_a_stream_released_at_its_last_event_keeps_its_connection_for_the_next() -> None:
    def sse(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await srv.read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                writer.write(b"e\r\ndata: [DONE]\n\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # the terminator comes in a write of its own
                writer.write(b"0\r\n\r\n")
                await writer.drain()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(sse) as srv:
        for _ in range(2):
            resp = await client.post(srv.url, "/v1/completions", b"{}", {})
            assert await anext(resp.iter_any()) == b"data: [DONE]\n\n"
            assert not resp.complete
            resp.release()  # the relay stops at [DONE]
            for _ in range(100):
                if client.idle_connections():
                    break
                await asyncio.sleep(0.01)
        assert srv.connections == 1
    await client.close()


async def test_bytes_after_a_whole_answer_close_the_connection() -> None:
    def chatty(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            body = await srv.read_request(reader)
            writer.write(answer(body) + answer(b"unasked"))
            await writer.drain()
            await reader.read()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(chatty) as srv:
        resp = await client.post(srv.url, "/a", b"1", {})
        assert await resp.read() == b"1"  # the answer asked for, and nothing of the other
        resp.release()
        resp = await client.post(srv.url, "/a", b"2", {})
        assert await resp.read() == b"2"
        resp.release()
        assert srv.connections == 2
    await client.close()


async def test_interim_answers_and_a_body_ended_by_the_connection_are_read() -> None:
    def old_style(srv: RawServer) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await srv.read_request(reader)
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nx-kind: eof\r\n\r\nuntil ")
            await writer.drain()
            writer.write(b"the end")
            await writer.drain()

        return handler

    client = Upstream(connect_timeout_s=2.0)
    async with raw_server(old_style) as srv:
        resp = await client.post(srv.url, "/a", b"{}", {})
        assert resp.status == 200 and resp.headers["x-kind"] == "eof"
        assert await resp.read() == b"until the end"
        resp.release()
        assert client.idle_connections() == 0
    await client.close()


async def test_the_request_line_and_headers_are_what_the_worker_url_says() -> None:
    v6 = _Address("http://[::1]:8000/base/")
    assert v6.host_header == b"[::1]:8000" and v6.key == ("::1", 8000, False)
    assert v6.prefix == b"/base"
    tls = _Address("https://user:p%40ss@worker.example")
    assert tls.host_header == b"worker.example" and tls.key == ("worker.example", 443, True)
    assert tls.auth == b"Basic dXNlcjpwQHNz"  # user:p@ss, as aiohttp sent it
    with pytest.raises(ValueError, match="line break"):
        Upstream(connect_timeout_s=1.0, headers={"Authorization": "Bearer key\n"})

    client = Upstream(connect_timeout_s=2.0, headers={"Authorization": "Bearer pool"})
    async with raw_server(keep_answering) as srv:
        headers = {"authorization": "Bearer mine", "x-bad": "a\r\nx-injected: 1"}
        resp = await client.post(srv.url + "/prefix", "/v1/completions", b"{}", headers)
        assert await resp.read() == b"{}"
        resp.release()
        sent = srv.requests[0].lower()
        assert sent.startswith(b"post /prefix/v1/completions http/1.1\r\n")
        assert b"authorization: bearer mine\r\n" in sent  # the request's own replaces it
        assert b"bearer pool" not in sent
        assert b"x-injected" not in sent and b"x-bad" not in sent
    await client.close()
