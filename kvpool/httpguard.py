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

* ``header_timeout_s``: a request's line and headers must all arrive within it (of the
  server's responsive time: a stall of its own loop is not the client's), counted from
  the connection's start, or from the first byte of the next request on a kept-alive
  connection (an idle kept-alive connection stays governed by uvicorn's
  ``timeout_keep_alive``). Late: 408 and close (a connection that never sent a byte is
  closed without an answer, as there was no request to answer);
* ``max_header_bytes``: more bytes than that before the blank line that ends the headers:
  431 and close. Bytes are counted as they arrive, before the parser sees them, so the
  parser never holds more than the limit and the quadratic cost stays bounded (32 KiB costs
  about 15 ms);
* ``max_connections_per_client``: how many connections one client address may hold *idle or
  unfinished*: kept alive between requests, or with a request still arriving (its line,
  headers or body) for half the header timeout (:data:`GRACE_SHARE`). A
  connection whose request is in service counts for nothing: behind an ingress, a
  Gateway, a load balancer or a mesh sidecar every client is one address, and 4,000
  streams in flight through it are 4,000 connections doing what they should. What an
  abuser holds is what counts: connections that send nothing or dribble. Over the limit,
  the client's longest-idle connection is closed to make room (an HTTP client opens
  another when it needs one); with none idle, the connection whose request is late is
  answered 429 and closed. The grace keeps a burst of new connections, whose first bytes
  the server has not read yet, from counting; it also lets a prompt client that shares an
  address with an attacker (a NAT) be served. Addresses are taken as they are, IPv6 ones
  too: grouping IPv6 by /64 (what one host on the internet is usually given) would make
  every pod of a node one client in clusters that give each node a /64 for its pods.
  Connections from ``trusted_proxies`` (a proxy fans many clients into one address) are
  never counted; :func:`client_address` finds the client behind them for limits that act
  on requests.

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
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.stall import LoopClock

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "BODY_AFTER_RESPONSE_TIMEOUT",
    "GRACE_SHARE",
    "HEADER_TIMEOUT",
    "HEADER_TOO_LARGE",
    "IDLE_CLOSED",
    "TOO_MANY_CONNECTIONS",
    "BodyError",
    "BodyTimeout",
    "BodyTooLarge",
    "HttpLimits",
    "client_address",
    "client_key",
    "connections_bound",
    "guarded_config",
    "guarded_protocol",
    "parse_networks",
    "raise_open_files_limit",
    "read_body",
    "server_config",
]

logger = logging.getLogger(__name__)

_END = b"\r\n\r\n"  # the blank line that ends a request's headers (llhttp wants CRLF)
#: How long a refused connection is kept half-open (our side shut, theirs read and dropped)
#: so that the client reads the answer instead of a reset from unread bytes.
_LINGER_S = 1.0
#: How long a request may take to arrive (line, headers, body) before its connection counts
#: against its client's ``max_connections_per_client``, as a share of the header timeout,
#: in the server's responsive time (:class:`kvpool.stall.LoopClock`: a burst of thousands of
#: connections that keeps the event loop busy does not make their first bytes late). Half:
#: a busy client (a load generator on a loaded machine, a proxy at a burst) may send its
#: request line seconds after it connected, and is no attacker for it.
GRACE_SHARE = 0.5

# Reasons counted in a guarded protocol class's ``refusals``.
HEADER_TIMEOUT = "header_timeout"
HEADER_TOO_LARGE = "header_too_large"
TOO_MANY_CONNECTIONS = "too_many_connections"
#: an idle kept-alive connection closed to make room for another of its client's
IDLE_CLOSED = "idle_closed"
BODY_AFTER_RESPONSE_TIMEOUT = "body_after_response_timeout"


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (what Go's runtime
    does at start), and return it. Every connection is a file: a soft limit of 1,024, the
    default of many hosts, would cap a proxy at a few hundred streams."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, e)
    return soft


def connections_bound(per_request: int = 2, reserve: int = 1024) -> int:
    """How many requests this process can hold with its open files: ``per_request`` each
    (a proxy holds its client's connection and its upstream's), less a ``reserve`` for
    listening sockets, health checks, event streams and files."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 2**20
    return max(64, (soft - reserve) // per_request)


def parse_networks(specs: Iterable[str], what: str = "trusted_proxies") -> tuple[Network, ...]:
    """Addresses and CIDR ranges (``10.0.0.0/8``, ``fd00::/8``, ``127.0.0.1``) as networks; a
    bad one is a :class:`ValueError` naming it."""
    networks = []
    for spec in specs:
        try:
            networks.append(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError:
            raise ValueError(
                f"{what}: {spec!r} is not an IP address or a CIDR range (like 10.0.0.0/8)"
            ) from None
    return tuple(networks)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _trusted(text: str, networks: tuple[Network, ...]) -> bool:
    address = _ip(text)
    return address is not None and any(address in n for n in networks)


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; the router's settings carry the same names."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 2**10
    max_connections_per_client: int = 256
    #: addresses and CIDR ranges of proxies in front (their connections are never counted)
    trusted_proxies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_networks(self.trusted_proxies)
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
    address = _ip(host)
    return host if address is None else str(address)


def _node(text: str) -> str:
    """A hop's address as a forwarding header writes it, its quotes, an IPv6 address's
    brackets and a port taken off (``"[2001:db8::1]:4711"``, ``192.0.2.7:5100``, which
    some load balancers put in X-Forwarded-For too); anything else as given (an obfuscated
    or ``unknown`` node is no address, so it is nobody's trusted proxy)."""
    node = text.strip().strip('"')
    if node.startswith("["):  # [v6] or [v6]:port
        return node[1 : node.find("]")] if "]" in node else node[1:]
    if node.count(":") == 1:  # v4:port
        return node.split(":", 1)[0]
    return node


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` nodes of an RFC 7239 ``Forwarded`` header, first hop first."""
    hops = []
    for element in value.split(","):
        for pair in element.split(";"):
            name, _, node = pair.strip().partition("=")
            if name.strip().lower() == "for":
                hops.append(_node(node))
    return hops


def client_address(
    peer: str,
    headers: Mapping[str, str],
    trusted: tuple[Network, ...],
    header: str = "x-forwarded-for",
) -> str:
    """The client a request comes from. Its connection's address (``peer``), unless that is
    a trusted proxy: then ``header`` (``x-forwarded-for`` or ``forwarded``) is read from
    its last hop back, past every trusted proxy, to the first address that is not one,
    which is the client (nginx's ``real_ip_recursive``). Hops further back were written by
    whoever sent them and are never believed. Every hop trusted: the first one. An entry
    that is not an address where one is needed: the last trusted hop, as nothing behind it
    can be told apart."""
    client = client_key(peer)
    if not trusted or not _trusted(peer, trusted):
        return client
    values = [v for k, v in headers.items() if k.lower() == header]
    if not values:
        return client
    joined = ",".join(values)
    hops = (
        _forwarded_for(joined)
        if header == "forwarded"
        else [_node(h) for h in joined.split(",") if h.strip()]
    )
    for hop in reversed(hops):
        if _ip(hop) is None:
            return client
        client = client_key(hop)
        if not _trusted(hop, trusted):
            return client
    return client


def _response(status: str, message: str, extra: str = "") -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Clients:
    """Connections counted per client key (idle, or with a late request), and each client's
    idle ones, longest idle first. Entries at zero are removed, so the tables hold only
    clients with a connection counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        self.idle: dict[str, dict[Any, None]] = {}

    def oldest_idle(self, key: str) -> Any | None:
        idle = self.idle.get(key)
        return next(iter(idle), None) if idle else None

    def set_idle(self, key: str, connection: Any, idle: bool) -> None:
        if idle:
            self.idle.setdefault(key, {})[connection] = None
            return
        connections = self.idle.get(key)
        if connections is not None:
            connections.pop(connection, None)
            if not connections:
                del self.idle[key]

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
    trusted = parse_networks(limits.trusted_proxies)
    refusals: Counter[str] = Counter()
    linger_s = min(_LINGER_S, limits.header_timeout_s)
    grace_s = limits.header_timeout_s * GRACE_SHARE
    clock = LoopClock()  # the grace is the loop's responsive time: a stall is not lateness
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
        f"this client has {limits.max_connections_per_client} connections open that are "
        "idle or still sending their request, its limit",
        extra="retry-after: 1\r\n",
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _phase = _HEAD
        _key: str | None = None  # the client it counts against; None: never counted
        _lease: _Lease | None = None  # its place in the count, while idle or late
        _grace: asyncio.TimerHandle | None = None
        _began = 0.0  # when the current request began, on the clock
        _quiet = True  # nothing received yet on this connection
        _header_bytes = 0
        _tail = b""  # the last bytes of the headers so far, to find an end split in two
        _feeding: bytes | None = None  # the chunk the parser is reading now
        _answered_early = False  # the response completed before its request's body
        _timer: asyncio.TimerHandle | None = None

        # -- connection ------------------------------------------------------------------

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            clock.start()
            if self.client and not _trusted(self.client[0], trusted):
                self._key = client_key(self.client[0])
            # uvicorn arms no timer on a new connection: the header time limit bounds it.
            self._begin_head(0, b"")

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            self._release()
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
            # The websocket protocol owns the connection now, and this one hears no more of
            # it: a websocket in use is in service, and counts for nothing.
            self._stop_timer()
            self._release()
            self._phase = _DONE
            super().handle_websocket_upgrade()

        # -- parser callbacks --------------------------------------------------------------

        def on_message_begin(self) -> None:
            if self._phase == _IDLE and self._feeding is not None:
                # A request pipelined in the chunk that ended the last one: where it starts
                # in the chunk is unknown, so all of the chunk counts as its header bytes.
                self._begin_head(len(self._feeding), self._feeding[-3:])
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._phase = _BODY
            self._stop_timer()  # the header time limit; the grace runs on for the body
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._phase = _IDLE
            self._stop_timer()
            self._release()  # all in: it is in service now
            super().on_message_complete()
            if self._answered_early:
                self._answered_early = False
                if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                    # The body's bytes disarmed uvicorn's keep-alive timer, armed when the
                    # response ended, and nothing else would arm it again.
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self.timeout_keep_alive_handler
                    )
                    self._hold(idle=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._phase == _IDLE and not self.pipeline and not self.transport.is_closing():
                self._hold(idle=True)  # kept alive, waiting for the client's next request
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
            self._release()  # no longer idle
            self._phase = _HEAD
            self._header_bytes = counted
            self._tail = tail
            self._began = clock.now()
            self._start_timer(self._headers_late)
            if self._key is not None:
                self._grace = self.loop.call_later(grace_s, self._request_late)

        # -- the count of what a client holds ---------------------------------------------

        def _request_late(self) -> None:
            """The request has taken the grace to arrive: from now on it counts."""
            self._grace = None
            if self._phase not in (_HEAD, _BODY) or self.transport.is_closing():
                return
            left = grace_s - (clock.now() - self._began)
            if left > 0:  # the loop stalled meanwhile: the client is not late yet
                self._grace = self.loop.call_later(left, self._request_late)
                return
            self._hold(idle=False)

        def _hold(self, *, idle: bool) -> None:
            """Take a place in the client's count, making room by closing its longest-idle
            connection; with no room, an idle connection closes, a late request is refused."""
            key = self._key
            if key is None or self._lease is not None:
                return
            lease = clients.acquire(key)
            if lease is None:
                victim = clients.oldest_idle(key)
                if victim is not None and victim is not self:
                    victim._evict()
                    lease = clients.acquire(key)
            if lease is None:
                if idle or self._quiet or self._answered_early:
                    # Nothing to answer: no request (closed as the header timeout closes a
                    # silent connection), or its answer already sent.
                    refusals[IDLE_CLOSED if idle else TOO_MANY_CONNECTIONS] += 1
                    self._phase = _DONE
                    self.transport.close()
                else:
                    logger.debug("refused a connection from %s: too many held", key)
                    self._refuse(too_many, TOO_MANY_CONNECTIONS)
                return
            self._lease = lease
            if idle:
                clients.set_idle(key, self, True)

        def _evict(self) -> None:
            """Closed to make room for another connection of its client (it is idle)."""
            refusals[IDLE_CLOSED] += 1
            self._release()
            self._phase = _DONE
            self._stop_timer()
            self.transport.close()

        def _release(self) -> None:
            if self._grace is not None:
                self._grace.cancel()
                self._grace = None
            if self._lease is not None:
                clients.set_idle(self._lease.key, self, False)
                self._lease.release()
                self._lease = None

        def _headers_late(self) -> None:
            self._timer = None
            if self._phase != _HEAD or self.transport.is_closing():
                return
            left = limits.header_timeout_s - (clock.now() - self._began)
            if left > 0:  # the loop stalled meanwhile: the client is not late yet
                self._timer = self.loop.call_later(left, self._headers_late)
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
