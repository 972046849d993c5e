"""Limits on what one HTTP client may hold of a server: connections, header time and size.

uvicorn bounds neither how long a request's headers may take to arrive nor how large they
may grow, nor how many connections one address may open. Each is an attack on a router
that serves many clients: connections dribbling a header byte at a time hold sockets and
parser state for ever, a header that grows without end is parsed again on every byte, and
one address opening thousands of connections starves the rest. :func:`guarded_protocol`
makes a uvicorn HTTP protocol (httptools, uvicorn's own when installed) that enforces, per
connection:

* ``header_timeout_s``: a request's line and headers must all arrive within it, from the
  connection's start or the first byte of a request on a kept-alive connection: 408 and
  close otherwise;
* ``max_header_bytes``: more header bytes than that before the blank line ends them: 431
  and close, counted before the parser sees the bytes;
* ``max_connections_per_client``: connections over it from one address are answered 429
  and closed at once; other addresses are unaffected.

The body's own time limit is the application's (it reads the body); see the router's.
uvicorn is imported only here, by components that serve HTTP: the operator image has none.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["HttpLimits", "guarded_protocol"]

_END = b"\r\n\r\n"


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 2**10
    max_connections_per_client: int = 256


def _response(status: str, message: str) -> bytes:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(limits: HttpLimits) -> type:
    """A uvicorn HTTP protocol class enforcing ``limits``; pass it as ``uvicorn.Config``'s
    ``http``. Each call makes a class with its own table of connections per address."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    per_client: dict[str, int] = {}
    timeout = _response("408 Request Timeout", "the request headers took too long to arrive")
    too_large = _response(
        "431 Request Header Fields Too Large",
        f"the request headers are over {limits.max_header_bytes} bytes",
    )
    too_many = _response(
        "429 Too Many Requests",
        f"this address has {limits.max_connections_per_client} connections open, its limit",
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _peer: str | None = None
        _refused = False
        _in_headers = False  # a request has begun and its headers have not all come
        _header_bytes = 0
        _tail = b""
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else None
            if peer is not None:
                if per_client.get(peer, 0) >= limits.max_connections_per_client:
                    self._refused = True
                    transport.write(too_many)
                    transport.close()
                    return
                per_client[peer] = per_client.get(peer, 0) + 1
                self._peer = peer
            self._begin_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            if self._peer is not None:
                left = per_client.get(self._peer, 1) - 1
                if left > 0:
                    per_client[self._peer] = left
                else:
                    per_client.pop(self._peer, None)
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if not self._in_headers and self.cycle is not None and self.cycle.response_complete:
                self._begin_headers()  # the next request on a kept-alive connection
            if self._in_headers:
                window = self._tail + data
                end = window.find(_END)
                used = (
                    self._header_bytes + len(data)
                    if end < 0
                    else self._header_bytes + end + len(_END) - len(self._tail)
                )
                if used > limits.max_header_bytes:
                    self._reject(too_large)
                    return
                if end < 0:
                    self._header_bytes = used
                    self._tail = window[-(len(_END) - 1) :]
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._stop_timer()
            super().on_headers_complete()

        def _begin_headers(self) -> None:
            self._in_headers = True
            self._header_bytes = 0
            self._tail = b""
            self._stop_timer()
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(limits.header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._timer = None
            if self._in_headers and not self.transport.is_closing():
                self._reject(timeout)

        def _reject(self, response: bytes) -> None:
            self._refused = True
            self._stop_timer()
            if not self.transport.is_closing():
                self.transport.write(response)
                self.transport.close()

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    return GuardedHttpToolsProtocol
