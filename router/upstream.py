"""The data path's HTTP client to the workers: HTTP/1.1 over asyncio protocols.

A generate request is one POST to one worker, answered whole or streamed. aiohttp's client
did that at about a sixth of the router's CPU per request (py-spy, ``bench/router_overhead.py``
at 400 req/s): a timer context, tracing hooks, a cookie jar, URL objects, a payload registry
and two tasks' worth of futures for every request. This client does the one thing: it keeps
idle connections per worker address, writes the request head and body in one ``write``,
and parses the answer with httptools (the C parser uvicorn uses; the ``router`` extra
brings it), handing the body on as it arrives.

* **Connections.** Kept alive and reused most recent first; one the worker closed is never
  reused (its ``connection_lost`` has already run), and one idle past ``keepalive_s`` is
  closed when next looked at. A response is released to the pool only when it was read to
  its end and the worker did not ask to close; a response abandoned midway closes its
  connection, which is how a worker learns that the client left (it aborts the request and
  frees its blocks).
* **Back-pressure.** A streamed body is buffered up to ``HIGH_WATER`` bytes; past that the
  socket stops being read until the reader catches up.
* **Errors** are all :class:`OSError`, so one ``except OSError`` covers a worker that fails:
  :class:`ConnectTimedOut` (no connection within ``connect_timeout_s``: perhaps only busy),
  :class:`ConnectFailed` (refused or unreachable: nothing listens there), and
  :class:`UpstreamClosed` (the connection ended or sent something that is not HTTP before
  the answer was whole). Time limits on the answer are the caller's (``asyncio.timeout``).

The health checks, scrapes, pass-through endpoints and hand-off clean-ups stay on aiohttp:
they are not on the request path, and they want its conveniences more than its speed.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectFailed",
    "ConnectTimedOut",
    "Upstream",
    "UpstreamClosed",
    "UpstreamResponse",
]

#: bytes of a streamed body buffered before the socket stops being read
HIGH_WATER = 256 * 1024


class UpstreamClosed(ConnectionError):
    """The worker's connection ended, or spoke something other than HTTP, before its answer
    was whole."""


class ConnectFailed(ConnectionError):
    """No connection: refused, unreachable, or a TLS handshake that failed."""

    def __init__(self, message: str, os_error: OSError) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectTimedOut(ConnectionError):
    """No connection within the connect timeout."""


class _Address:
    """Where a worker URL points: the connection's key and the request target's prefix."""

    __slots__ = ("host", "host_header", "port", "prefix", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode("idna")


class _Connection(asyncio.Protocol):
    """One kept-alive connection; carries one response at a time."""

    def __init__(self, owner: Upstream, key: tuple[str, int, bool]) -> None:
        self.owner = owner
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.response: UpstreamResponse | None = None
        self.parser = httptools.HttpResponseParser(self)
        self._header_name = b""

    # -- the socket's side ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: a worker that talks out of turn
            self._abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamClosed("the worker switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"the worker's answer is not HTTP ({exc})"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.owner._forget(self)
        resp = self.response
        if resp is not None and not resp.complete:
            if resp.headers_done and resp.until_eof and exc is None:
                resp._finish()  # a body delimited by the connection's end, now whole
            else:
                why = f" ({type(exc).__name__})" if exc is not None else ""
                self._fail(UpstreamClosed(f"the worker closed the connection{why}"))

    def pause_writing(self) -> None:  # the head and body are written once, whole
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response._raw_headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            resp._raw_headers.clear()
            return
        resp._headers_complete(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None and resp.headers_done:
            resp._finish()

    # -- ours -----------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        resp = self.response
        if resp is not None:
            resp._error(exc)
        self._abort()

    def _abort(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """A worker's answer: its status and headers once :meth:`Upstream.post` returns, then its
    body, whole (:meth:`read`) or as it arrives (:meth:`iter_any`). Give it back with
    :meth:`release` (the connection is reused if the body was read to its end) or
    :meth:`close` (the connection is closed: the worker aborts what it was doing)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.keep_alive = False
        self.until_eof = False  # no length, not chunked: the body ends with the connection
        self.complete = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # -- fed by the connection ------------------------------------------------------------

    def _headers_complete(self, status: int, keep_alive: bool) -> None:
        self.status = status
        headers = self.headers
        for name, value in self._raw_headers:
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        self._raw_headers = []
        self.keep_alive = keep_alive
        self.until_eof = "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", ""
        )
        self.headers_done = True
        self._wake()

    def _feed(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused:
            transport = self._conn.transport
            if transport is not None and not transport.is_closing():
                transport.pause_reading()
                self._paused = True
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _error(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def _headers(self) -> None:
        while not self.headers_done:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    # -- the reader's side ----------------------------------------------------------------

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, in the pieces they arrive in."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= HIGH_WATER // 4:
                    self._paused = False
                    transport = self._conn.transport
                    if transport is not None and not transport.is_closing():
                        transport.resume_reading()
                yield chunk
            elif self.complete:
                return
            elif self._exc is not None:
                raise self._exc
            else:
                await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.iter_any()])

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read
        to its end and the worker keeps it open, and is closed otherwise."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        if self.complete and not self._chunks and self.keep_alive and not conn.lost:
            conn.owner._keep(conn)
        else:
            conn._abort()

    def close(self) -> None:
        """Close the connection now, whatever was read."""
        if self._released:
            return
        self._released = True
        self._conn.response = None
        self._conn._abort()


class Upstream:
    """Keep-alive HTTP/1.1 connections to the workers, for the generate requests."""

    def __init__(
        self,
        connect_timeout_s: float,
        keepalive_s: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        #: sent with every request (the workers' API key)
        self.headers = dict(headers or {})
        self.keepalive_s = keepalive_s
        self._pools: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._addresses: dict[str, _Address] = {}
        self._ssl: ssl.SSLContext | None = None
        self.closed = False

    def _address(self, url: str) -> _Address:
        address = self._addresses.get(url)
        if address is None:
            if len(self._addresses) > 4096:  # workers come and go: keep the table small
                self._addresses.clear()
            address = self._addresses[url] = _Address(url)
        return address

    async def post(
        self, url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        """POST ``body`` to ``url`` + ``path``; the answer once its status and headers are
        in. ``headers`` come after the client's own (:attr:`headers`); a value of more than
        one line is not sent (no HTTP server's parser gives one)."""
        if self.closed:
            raise UpstreamClosed("the router is shutting down")
        address = self._address(url)
        lines = [
            b"POST ",
            (address.prefix + path).encode("latin-1"),
            b" HTTP/1.1\r\nhost: ",
            address.host_header,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for name, value in (*self.headers.items(), *headers.items()):
            if "\n" in value or "\r" in value:  # never from an HTTP parser: not sent
                continue
            lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
        lines.append(b"\r\n")
        conn = await self._connection(address)
        resp = conn.response = UpstreamResponse(conn)
        assert conn.transport is not None
        # the head and the body as they are (a long prompt's body is not copied into one
        # buffer with the head), in one system call
        conn.transport.writelines((b"".join(lines), body))
        try:
            await resp._headers()
        except BaseException:
            resp.close()
            raise
        return resp

    async def _connection(self, address: _Address) -> _Connection:
        key = (address.host, address.port, address.tls)
        idle = self._pools.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.lost:
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn._abort()
                continue
            return conn
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if address.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": address.host}
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), address.host, address.port, **tls
                )
        except TimeoutError:
            raise ConnectTimedOut(
                f"no connection to {address.host}:{address.port} "
                f"within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise ConnectFailed(
                f"cannot connect to {address.host}:{address.port}: {exc}", exc
            ) from None
        self._open.add(conn)
        return conn

    def _keep(self, conn: _Connection) -> None:
        if self.closed:
            conn._abort()
            return
        conn.idle_since = time.monotonic()
        self._pools.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    def idle_connections(self) -> int:
        """Connections kept for reuse now (those the workers have not closed)."""
        return sum(1 for conns in self._pools.values() for c in conns if not c.lost)

    async def close(self) -> None:
        """Close every connection, idle or carrying an answer."""
        self.closed = True
        for conn in list(self._open):
            conn._abort()
        self._pools.clear()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
