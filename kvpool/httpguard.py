"""What one HTTP client may hold of a server: its connections, and its headers' time and size.

uvicorn bounds none of these, and each was an attack on the router (issue 20):

* connections dribbling a header a byte at a time hold sockets and parser state for ever;
* httptools' binding grows a header by ``bytes +=`` on every fragment the parser hands it,
  so a header streamed in small pieces costs quadratic time (512 KiB sent a byte at a time
  is 7.7 s of one core, with the event loop blocked), and three such connections starved
  the router's health checks until it marked a healthy worker down;
* one address opening thousands of connections leaves none for anybody else.

:func:`guarded_protocol` makes a subclass of uvicorn's httptools protocol that enforces, per
connection, the limits in :class:`HttpLimits`:

* ``header_timeout_s``: a request's line and headers must all arrive within it, counted from
  the connection's start, or from the first byte of the next request on a kept-alive
  connection (an idle kept-alive connection stays governed by uvicorn's
  ``timeout_keep_alive``). Late: 408 and close (a connection that never sent a byte is
  closed without an answer, as there was no request to answer);
* ``max_header_bytes``: more bytes than that before the blank line that ends the headers:
  431 and close. Bytes are counted as they arrive, before the parser sees them, so the
  parser never holds more than the limit and the quadratic cost stays bounded (32 KiB costs
  about 15 ms);
* ``max_connections_per_client``: a connection over it from one client address is answered
  429 at once and closed; other clients are unaffected, and a connection's place is given
  back whenever it ends, however it ends (a websocket upgrade hands its place to the
  websocket connection). Addresses are taken as they are, IPv6 ones too: grouping IPv6 by
  /64 (what one host on the internet is usually given) would make every pod of a node one
  client in clusters that give each node a /64 for its pods. Clients behind one address
  (an ingress, a NAT) share its limit.

Request boundaries come from the parser's own callbacks (message begin, headers complete,
message complete), not from the response: a request pipelined behind a long-running one is
bounded too, and the rest of a body that arrives after the application answered early (a
413 refused on its Content-Length) is body, not header. Such a leftover body may take
``header_timeout_s`` more to arrive; then the connection is closed.

The body's own limits belong to the application, which decides when to read it:
:func:`read_body` reads a Starlette request's body within a time and a size limit.

httptools, not h11: ``uvicorn[standard]`` (the router and worker extras) always brings it,
it is what uvicorn picks when installed, and it is the parser whose cost is quadratic. With
uvicorn's h11 protocol instead, a missing httptools would silently drop the limits, so
:func:`guarded_protocol` refuses to start without it.

uvicorn is imported inside functions only: the core is imported by the operator, whose
image has no uvicorn.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "BODY_AFTER_RESPONSE_TIMEOUT",
    "HEADER_TIMEOUT",
    "HEADER_TOO_LARGE",
    "TOO_MANY_CONNECTIONS",
    "BodyError",
    "BodyTimeout",
    "BodyTooLarge",
    "HttpLimits",
    "client_key",
    "guarded_config",
    "guarded_protocol",
    "read_body",
    "server_config",
]

logger = logging.getLogger(__name__)

_END = b"\r\n\r\n"  # the blank line that ends a request's headers (llhttp wants CRLF)
#: How long a refused connection is kept half-open (our side shut, theirs read and dropped)
#: so that the client reads the answer instead of a reset from unread bytes.
_LINGER_S = 1.0

# Reasons counted in a guarded protocol class's ``refusals``.
HEADER_TIMEOUT = "header_timeout"
HEADER_TOO_LARGE = "header_too_large"
TOO_MANY_CONNECTIONS = "too_many_connections"
BODY_AFTER_RESPONSE_TIMEOUT = "body_after_response_timeout"


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; the router's settings carry the same three names."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 2**10
    max_connections_per_client: int = 256

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_header_bytes < 64:
            raise ValueError(f"max_header_bytes must be >= 64, got {self.max_header_bytes}")
        if self.max_connections_per_client < 1:
            raise ValueError(
                f"max_connections_per_client must be >= 1, got {self.max_connections_per_client}"
            )


def client_key(host: str) -> str:
    """The client a connection is counted against: its address in one canonical spelling
    (an IPv4 address mapped into IPv6 is the IPv4 address), anything else as given."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _response(status: str, message: str, extra: str = "") -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Clients:
    """Open connections per client key. Entries at zero are removed, so the table holds
    only clients with a connection open."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}

    def acquire(self, key: str) -> _Lease | None:
        held = self.open.get(key, 0)
        if held >= self.limit:
            return None
        self.open[key] = held + 1
        return _Lease(self, key)


class _Lease:
    """One connection's place in its client's count; giving it back twice is harmless."""

    __slots__ = ("_clients", "key")

    def __init__(self, clients: _Clients, key: str) -> None:
        self._clients: _Clients | None = clients
        self.key = key

    def release(self) -> None:
        clients, self._clients = self._clients, None
        if clients is None:
            return
        left = clients.open.get(self.key, 1) - 1
        if left > 0:
            clients.open[self.key] = left
        else:
            clients.open.pop(self.key, None)


# Where a connection is in its current request, as the parser sees it.
_HEAD = 0  # a request has begun (or the connection is new) and its headers are not all in
_BODY = 1  # headers complete, the message (its body) is not
_IDLE = 2  # the last message is complete, no byte of the next one yet
_DONE = 3  # refused: an answer is written and the connection is closing


def guarded_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class enforcing ``limits``; pass it as ``uvicorn.Config``'s
    ``http`` (or use :func:`guarded_config`).

    Each call makes a class with its own table of connections per client, ``clients.open``
    (client key -> connections open), and its own ``refusals`` counter by reason, which a
    server may export as a metric."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as e:  # pragma: no cover - uvicorn[standard] brings httptools
        raise RuntimeError(
            f"the HTTP limits need uvicorn's httptools protocol: install uvicorn[standard] ({e})"
        ) from e

    clients = _Clients(limits.max_connections_per_client)
    refusals: Counter[str] = Counter()
    linger_s = min(_LINGER_S, limits.header_timeout_s)
    late = _response(
        "408 Request Timeout",
        f"the request headers did not arrive within {limits.header_timeout_s:g} s",
    )
    too_large = _response(
        "431 Request Header Fields Too Large",
        f"the request line and headers are over {limits.max_header_bytes} bytes",
    )
    too_many = _response(
        "429 Too Many Requests",
        f"this client has {limits.max_connections_per_client} connections open, its limit",
        extra="retry-after: 1\r\n",
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _phase = _HEAD
        _lease: _Lease | None = None
        _quiet = True  # nothing received yet on this connection
        _header_bytes = 0
        _tail = b""  # the last bytes of the headers so far, to find an end split in two
        _feeding: bytes | None = None  # the chunk the parser is reading now
        _answered_early = False  # the response completed before its request's body
        _timer: asyncio.TimerHandle | None = None

        # -- connection ------------------------------------------------------------------

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if self.client:
                self._lease = clients.acquire(client_key(self.client[0]))
                if self._lease is None:
                    logger.debug("refused a connection from %s: too many open", self.client[0])
                    self._refuse(too_many, TOO_MANY_CONNECTIONS)
                    return
            # uvicorn arms no timer on a new connection: the header time limit bounds it.
            self._begin_head(0, b"")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._phase == _DONE:
                return  # an answer is written; what follows is dropped
            self._quiet = False
            if self._phase == _IDLE:
                self._begin_head(0, b"")
            if self._phase == _HEAD:
                budget = limits.max_header_bytes - self._header_bytes
                # Over budget is allowed only when the headers end within it (the rest of
                # the chunk is then body): one search, on a chunk that crosses the limit.
                if len(data) > budget and _END not in self._tail + data[: max(budget, 0)]:
                    self._refuse(too_large, HEADER_TOO_LARGE)
                    return
                self._header_bytes += len(data)
                self._tail = (self._tail + data[-3:])[-3:]
            self._feeding = data
            try:
                super().data_received(data)
            finally:
                self._feeding = None

        def handle_websocket_upgrade(self) -> None:
            self._stop_timer()
            self._phase = _DONE
            super().handle_websocket_upgrade()
            successor = self.transport.get_protocol()
            lease = self._lease
            if lease is None or successor is self:
                return
            # The websocket protocol owns the connection now, and this one hears no more of
            # it (not even its end): the websocket's end gives the place back.
            self._lease = None
            lost = successor.connection_lost

            def connection_lost(exc: Exception | None) -> None:
                try:
                    lost(exc)
                finally:
                    lease.release()

            successor.connection_lost = connection_lost  # type: ignore[method-assign]

        # -- parser callbacks --------------------------------------------------------------

        def on_message_begin(self) -> None:
            if self._phase == _IDLE and self._feeding is not None:
                # A request pipelined in the chunk that ended the last one: where it starts
                # in the chunk is unknown, so all of the chunk counts as its header bytes.
                self._begin_head(len(self._feeding), self._feeding[-3:])
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._phase = _BODY
            self._stop_timer()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = _IDLE
            self._stop_timer()
            super().on_message_complete()
            if self._answered_early:
                self._answered_early = False
                if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                    # The body's bytes disarmed uvicorn's keep-alive timer, armed when the
                    # response ended, and nothing else would arm it again.
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler
                    )

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if (
                self._phase == _BODY
                and self.cycle is not None
                and self.cycle.response_complete
                and not self.transport.is_closing()
            ):
                # Answered before its body was all in (refused on its length, or too slow):
                # the rest is read and dropped, but not for ever.
                self._answered_early = True
                self._start_timer(self._body_after_response_late)

        # -- limits ------------------------------------------------------------------------

        def _begin_head(self, counted: int, tail: bytes) -> None:
            self._phase = _HEAD
            self._header_bytes = counted
            self._tail = tail
            self._start_timer(self._headers_late)

        def _headers_late(self) -> None:
            self._timer = None
            if self._phase != _HEAD or self.transport.is_closing():
                return
            if self._quiet:  # no request was made: nothing to answer
                refusals[HEADER_TIMEOUT] += 1
                self._phase = _DONE
                self.transport.close()
                return
            self._refuse(late, HEADER_TIMEOUT)

        def _body_after_response_late(self) -> None:
            self._timer = None
            if self._phase == _BODY and not self.transport.is_closing():
                refusals[BODY_AFTER_RESPONSE_TIMEOUT] += 1
                self._phase = _DONE
                self.transport.close()

        def _refuse(self, answer: bytes, reason: str) -> None:
            """Answer ``answer`` and close: our side at once, theirs after a short linger
            in which what they send is dropped unparsed, so that the answer is read rather
            than lost to a reset."""
            refusals[reason] += 1
            self._phase = _DONE
            self._stop_timer()
            self._unset_keepalive_if_required()
            transport = self.transport
            if transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # A response is on its way (the refused request was pipelined behind it):
                # writing ours would corrupt it, so the connection just ends.
                transport.close()
                return
            transport.write(answer)
            if not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
            self._timer = self.loop.call_later(linger_s, transport.close)

        def _start_timer(self, callback: Any) -> None:
            self._stop_timer()
            self._timer = self.loop.call_later(limits.header_timeout_s, callback)

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    GuardedHttpToolsProtocol.limits = limits  # type: ignore[attr-defined]
    GuardedHttpToolsProtocol.clients = clients  # type: ignore[attr-defined]
    GuardedHttpToolsProtocol.refusals = refusals  # type: ignore[attr-defined]
    return GuardedHttpToolsProtocol


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    limits: HttpLimits,
    drain_timeout_s: float,
    log_level: str,
    **options: Any,
) -> uvicorn.Config:
    """The uvicorn configuration every kvpool server (router, worker) runs under: HTTP
    ``limits`` per client, a graceful shutdown within the drain timeout (in whole seconds,
    as uvicorn takes it), lifespan events on, no access log. ``options``: any other of
    ``uvicorn.Config``'s."""
    import math

    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(drain_timeout_s),
        access_log=False,
        lifespan="on",
        http=guarded_protocol(limits),
        **options,
    )


def guarded_config(config: uvicorn.Config, limits: HttpLimits) -> type[asyncio.Protocol]:
    """Install a protocol enforcing ``limits`` on ``config`` (before the server loads it)
    and return the protocol class (its ``refusals`` and ``clients`` are the live counts)."""
    if config.loaded:
        raise RuntimeError("the HTTP limits must be installed before the uvicorn config loads")
    protocol = guarded_protocol(limits)
    config.http = protocol
    return protocol


# -- the body ------------------------------------------------------------------------------


class BodyError(Exception):
    """A request body refused; ``status`` and ``code`` are what to answer."""

    status = 400
    code = "invalid_request_body"


class BodyTimeout(BodyError):
    status = 408
    code = "request_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"the request body did not arrive within {timeout_s:g} s")
        self.timeout_s = timeout_s


class BodyTooLarge(BodyError):
    status = 413
    code = "request_too_large"

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request body has at least {size} bytes; the limit is {limit}")
        self.size, self.limit = size, limit


class _BodySource(Protocol):
    """What :func:`read_body` needs of a request (a Starlette ``Request`` has it)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


async def read_body(request: _BodySource, *, limit_bytes: int, timeout_s: float) -> bytes:
    """The request's body, read within ``timeout_s`` in all and at most ``limit_bytes`` long.

    A Content-Length over the limit is refused before a byte is read; a body without one
    (chunked) is refused as soon as it grows past the limit. Raises :class:`BodyTooLarge`
    (413) or :class:`BodyTimeout` (408); a client that leaves raises what the request's
    stream raises (Starlette's ``ClientDisconnect``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit():
        if int(declared) > limit_bytes:
            raise BodyTooLarge(int(declared), limit_bytes)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit_bytes:
                    raise BodyTooLarge(len(body), limit_bytes)
    except TimeoutError:
        raise BodyTimeout(timeout_s) from None
    return bytes(body)
