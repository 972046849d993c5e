"""The data path's HTTP client to the workers: HTTP/1.1 over asyncio protocols.

A generate request is one POST to one worker, answered whole or streamed. aiohttp's client
did that at about a sixth of the router's CPU per request (py-spy, ``bench/router_overhead.py``
at 400 req/s): a timer context, tracing hooks, a cookie jar, URL objects, a payload registry
and two tasks' worth of futures for every request. This client does the one thing: it keeps
idle connections per worker address, writes the request head and body in one system call
(the body not copied), and parses the answer with httptools (the C parser uvicorn uses;
the ``router`` extra brings it), handing the body on as it arrives.

* **Connections.** Kept alive and reused most recent first, for ``keepalive_s`` (4 s: less
  than the 5 s after which uvicorn, so vLLM and kvpool workers, close an idle one). One the
  worker closed is never reused; one it was closing as it was reused (its close and the
  request crossed) ends within ``STALE_S`` of the request, before any byte of an answer,
  and the request is sent once more on a new connection, which is what browsers do for the
  same race. A response goes back to
  the pool once read to its end (a stream released at its last event waits up to
  ``DRAIN_S`` for the chunked body's terminator), unless the worker asked to close; one
  abandoned midway, or dropped unreleased, closes its connection, which is how a worker
  learns that the client left (it aborts the request and frees its blocks).
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
import logging
import ssl
import time
from typing import Any

from kvpool.stall import LoopClock

from .http1 import (
    STALE_S,
    ConnectFailed,
    ConnectTimedOut,
    UpstreamClosed,
    UpstreamResponse,
    _Address,
    _Connection,
    _line,
)

__all__ = ["Upstream"]

log = logging.getLogger(__name__)


class Upstream:
    """Keep-alive HTTP/1.1 connections to the workers, for the generate requests.
    ``headers`` go with every request (the workers' API key); a request's own headers of
    the same name replace them."""

    def __init__(
        self,
        connect_timeout_s: float,
        keepalive_s: float = 4.0,
        headers: dict[str, str] | None = None,
        clock: LoopClock | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        #: connects are timed by the router's responsive time: a burst that keeps the loop
        #: busy for seconds must not fail connections the workers accepted meanwhile
        self.clock = clock or LoopClock()
        self.keepalive_s = keepalive_s
        # checked and encoded once: a key with a line break is refused at start-up
        self._defaults = {k.lower(): _line(k, v) for k, v in (headers or {}).items()}
        self._pools: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._addresses: dict[str, _Address] = {}
        self._ssl: ssl.SSLContext | None = None
        self._swept = time.monotonic()
        self.closed = False

    def _address(self, url: str) -> _Address:
        address = self._addresses.get(url)
        if address is None:
            if len(self._addresses) > 4096:  # workers come and go: keep the table small
                self._addresses.clear()
            address = self._addresses[url] = _Address(url)
        return address

    def _head(self, address: _Address, path: str, size: int, headers: dict[str, str]) -> bytes:
        lines = dict(self._defaults)
        if address.auth is not None and "authorization" not in lines:
            lines["authorization"] = b"authorization: " + address.auth + b"\r\n"
        for name, value in headers.items():
            try:
                lines[name.lower()] = _line(name, value)
            except (ValueError, UnicodeEncodeError) as exc:  # no HTTP parser gives one
                log.warning("header %r not sent to the worker: %s", name, exc)
        return b"".join(
            (
                b"POST ",
                address.prefix,
                path.encode("latin-1"),
                b" HTTP/1.1\r\nhost: ",
                address.host_header,
                b"\r\ncontent-length: ",
                str(size).encode(),
                b"\r\n",
                *lines.values(),
                b"\r\n",
            )
        )

    async def post(
        self, url: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamResponse:
        """POST ``body`` to ``url`` + ``path``; the answer once its status and headers are
        in."""
        address = self._address(url)
        head = self._head(address, path, len(body), headers)
        conn, reused = await self._connection(address, reuse=True)
        while True:
            resp = UpstreamResponse(conn)
            assert conn.transport is not None
            # the head and the body as they are (a long prompt's body is not copied into
            # one buffer with the head), in one system call
            conn.transport.writelines((head, body))
            written = time.monotonic()
            try:
                await resp._headers()
            except UpstreamClosed:
                resp.close()
                # Only the race with the worker's own close of an idle connection: it ends
                # at once, before any answer. A worker failing later may have done work;
                # whether to try again is the router's retry loop's to say.
                if not reused or conn.received or time.monotonic() - written > STALE_S:
                    raise
                # the worker was closing it as it was reused: once more, on a new one
                conn, reused = await self._connection(address, reuse=False)
                continue
            except BaseException:
                resp.close()
                raise
            return resp

    async def _connection(self, address: _Address, reuse: bool) -> tuple[_Connection, bool]:
        """A connection to ``address``, and whether it was kept from an earlier answer."""
        if self.closed:
            raise UpstreamClosed("the router is shutting down")
        idle = self._pools.get(address.key) if reuse else None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.lost:
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn._abort()
                continue
            return conn, True
        loop = asyncio.get_running_loop()
        tls: dict[str, Any] = {}
        if address.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": address.host}
        try:
            _, conn = await self.clock.within(
                loop.create_connection(
                    lambda: _Connection(self, address.key), address.host, address.port, **tls
                ),
                self.connect_timeout_s,
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
        if self.closed:  # closed while connecting
            conn._abort()
            raise UpstreamClosed("the router is shutting down")
        return conn, False

    def _keep(self, conn: _Connection) -> None:
        if self.closed:
            conn._abort()
            return
        now = conn.idle_since = time.monotonic()
        self._pools.setdefault(conn.key, []).append(conn)
        if now - self._swept > self.keepalive_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close what has been idle too long, everywhere (workers that left included)."""
        self._swept = now
        for key, conns in list(self._pools.items()):
            for conn in conns:
                if now - conn.idle_since > self.keepalive_s:
                    conn._abort()  # its connection_lost takes it off the list
            if not self._pools.get(key):
                self._pools.pop(key, None)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conns = self._pools.get(conn.key)
        if conns and conn in conns:
            conns.remove(conn)
            if not conns:
                del self._pools[conn.key]

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
