"""One HTTP/1.1 connection to a worker (an ``asyncio.Protocol`` parsed by httptools) and
the answer read from it (:class:`UpstreamResponse`): its headers, its body as it comes,
back-pressure on the socket, and the connection kept for reuse or closed."""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import weakref
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

import httptools

__all__ = [
    "ConnectFailed",
    "ConnectTimedOut",
    "UpstreamClosed",
    "UpstreamResponse",
]

log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".upstream")


class _Owner(Protocol):
    """What a connection tells the client that made it (:class:`.upstream.Upstream`)."""

    _open: set[Any]

    def _keep(self, conn: Any) -> None: ...

    def _forget(self, conn: Any) -> None: ...


#: bytes of a streamed body buffered before the socket stops being read
HIGH_WATER = 256 * 1024
#: seconds a released stream's connection waits for the rest of its body (the terminator)
DRAIN_S = 1.0
#: a kept connection that ends this soon after a request, before any byte of an answer,
#: was being closed by the worker as it was reused: the request is sent again, once
STALE_S = 0.25


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
    """Where a worker URL points: the connection's key, the request target's prefix, the
    Host header, and the credentials the URL carries (sent as Basic auth, as aiohttp did)."""

    __slots__ = ("auth", "host", "host_header", "key", "port", "prefix", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.host, self.port, self.tls)
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        name = f"[{self.host}]" if ":" in self.host else self.host
        host = name if parts.port is None else f"{name}:{parts.port}"
        self.host_header = host.encode("idna")
        self.auth: bytes | None = None
        if parts.username is not None:
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.auth = b"Basic " + base64.b64encode(secret.encode())


def _line(name: str, value: str) -> bytes:
    """``name: value`` as sent, or ValueError for what HTTP cannot carry."""
    if any(c in name for c in "\r\n:\0 ") or any(c in value for c in "\r\n\0"):
        raise ValueError(f"header {name!r} has a line break or a character it cannot have")
    return name.lower().encode("latin-1") + b": " + value.encode("latin-1") + b"\r\n"


class _Connection(asyncio.Protocol):
    """One kept-alive connection; carries one response at a time. It holds that response
    weakly: a response dropped unreleased closes the connection."""

    def __init__(self, owner: _Owner, key: tuple[str, int, bool]) -> None:
        self.owner = owner
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_since = 0.0
        self.received = False  # a byte of the current answer came
        self._response: weakref.ref[UpstreamResponse] | None = None
        #: a released stream whose body's end is still to come (held until it does)
        self.draining: UpstreamResponse | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self.parser = httptools.HttpResponseParser(self)

    @property
    def response(self) -> UpstreamResponse | None:
        if self.draining is not None:
            return self.draining
        return self._response() if self._response is not None else None

    def start(self, resp: UpstreamResponse) -> None:
        self._response = weakref.ref(resp)
        self.received = False

    # -- the socket's side ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.owner._open.add(self)

    def data_received(self, data: bytes) -> None:
        resp = self.response
        # nothing asked, or more after a whole answer: a worker that talks out of turn
        if resp is None or resp.complete:
            self._abort()
            return
        self.received = True
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
        self._stop_draining()
        resp = self.response
        if resp is not None and not resp.complete:
            if resp.headers_done and resp.until_eof and exc is None:
                resp._finish()  # a body delimited by the connection's end, now whole
            else:
                why = f" ({type(exc).__name__})" if exc is not None else ""
                self._fail(UpstreamClosed(f"the worker closed the connection{why}"))

    # -- httptools' callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self.response
        if resp is not None and resp.complete:  # a second answer to one request: stop here
            raise UpstreamClosed("the worker answered twice")

    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        assert resp is not None
        resp._raw_headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            resp._raw_headers.clear()
        else:
            resp._headers_complete(status, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.draining is not None:  # more than the end of a stream released at its end
            self._abort()
            return
        resp = self.response
        assert resp is not None
        resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is None or not resp.headers_done:
            return
        resp._finish()
        if self.draining is not None:
            self._stop_draining()
            self.owner._keep(self)

    # -- ours -----------------------------------------------------------------------------

    def drain(self, resp: UpstreamResponse) -> None:
        """Keep the connection once the rest of ``resp`` (only its end) has come."""
        self.draining = resp
        self._response = None
        self._drain_timer = asyncio.get_running_loop().call_later(DRAIN_S, self._abort)

    def _stop_draining(self) -> None:
        self.draining = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _fail(self, exc: BaseException) -> None:
        resp = self.response
        if resp is not None:
            resp._error(exc)
        self._abort()

    def _abort(self) -> None:
        self.lost = True
        self._stop_draining()
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
        conn.start(self)

    def __del__(self) -> None:
        if not self._released:  # dropped unreleased: nobody reads it, so the worker stops
            self._conn._abort()

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
        to its end (or all of it but its end, which is waited for) and the worker keeps it
        open; it is closed otherwise."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        reusable = self.keep_alive and not conn.lost and not self._chunks
        if reusable and self.complete:
            conn._response = None
            conn.owner._keep(conn)
        elif reusable and self.headers_done and not self.until_eof and self._exc is None:
            conn.drain(self)  # a stream read to its last event: its terminator is coming
        else:
            conn._abort()

    def close(self) -> None:
        """Close the connection now, whatever was read."""
        if self._released:
            return
        self._released = True
        self._conn._abort()
