"""What goes back to the client: a worker's answer relayed, and the errors a worker's
failure turns into.

:class:`Relay` passes a worker's SSE stream on event by event, taking the router's TTFT and
inter-token latencies from it; :class:`RelayResponse` sends it from the request's own task,
cancelled when the client hangs up (:func:`until_client_leaves`). A failure before the
first output is a :class:`Failed` (the router tries another worker); after it, the stream
ends with an error event (:func:`sse_error`) and ``[DONE]``. The relay knows the worker's
load entry, the metrics and its timeouts; what the router must do when it ends (admission,
usage, stored responses) is its ``on_close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from kvpool import tracing
from kvpool.openai_api import OpenAIError

from ..admin.metrics import RouterMetrics
from ..state.load import Ticket
from ..state.worker import WorkerState
from .http1 import UpstreamResponse
from .sse import SSEWatch

__all__ = [
    "Failed",
    "Relay",
    "RelayResponse",
    "error_message",
    "sse_error",
    "until_client_leaves",
]

log = logging.getLogger(__name__)


class Failed(Exception):
    """A worker failed this attempt before any byte reached the client. The message is
    for the client: it names no worker address (the log has the details)."""

    def __init__(self, reason: str, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


@dataclass
class Relay:
    """The worker's SSE stream passed on event by event, with the router's TTFT and
    inter-token latencies taken from it. :meth:`first_output` reads it up to its first
    output (a failure before that is the caller's to retry); after that, a failure or
    a silence past the idle timeout ends it with an error event. :meth:`close` releases
    the worker and the router's slot exactly once, however the stream ends."""

    state: WorkerState
    ticket: Ticket
    request_id: str
    resp: UpstreamResponse
    arrival: float
    events: SSEWatch
    metrics: RouterMetrics
    idle_timeout_s: float
    #: the router's own bookkeeping once the stream has ended (its admission, its usage)
    on_close: Callable[[Relay], None]
    outcome: str = "cancelled"
    closed: bool = False
    span: Any = None  # the attempt's trace span, ended with the stream
    head: bytes = b""
    last_token: float | None = None
    _chunks: Any = None

    async def first_output(self, deadline: float) -> None:
        """Read up to the first event with output (kept in :attr:`head` for the client);
        :class:`Failed` if the stream fails, ends or errors before it, or it does not come
        before ``deadline``."""
        state, events = self.state, self.events
        self._chunks = self.resp.iter_any()
        head: list[bytes] = []
        try:
            while not events.started:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    chunk = await anext(self._chunks)
                out, _ = events.feed(chunk)
                head.append(out)
                if events.error or events.done:
                    break
        except StopAsyncIteration:
            pass
        except TimeoutError:
            state.breaker.on_failure(time.monotonic())
            raise Failed("ttft_timeout", "no first token before the time limit", 504) from None
        except OSError as exc:  # charged once another worker answers
            raise Failed(
                "no_token", f"stream lost before its first token ({type(exc).__name__})"
            ) from None
        self.head = b"".join(head)
        if not events.started:
            if events.client_error:  # the worker refused the request: its answer, as sent
                return
            what = "an error" if events.error else "no output"
            raise Failed("no_token", f"the stream ended with {what} before its first token")
        now = time.monotonic()
        self.metrics.ttft.observe(now - self.arrival)
        state.first_token(self.ticket, now)
        self.last_token = now

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outcome == "success":
            # read to its last event: the connection is kept once the body's end comes
            self.resp.release()
        else:  # closed mid-answer: the worker sees it and aborts the request
            self.resp.close()
        self.state.end(self.ticket)
        tracing.end_span(self.span, None if self.outcome == "success" else self.outcome)
        self.metrics.requests.labels(self.outcome).inc()
        if self.outcome == "success":
            self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.on_close(self)

    async def stream(self) -> AsyncIterator[bytes]:
        state, events, metrics = self.state, self.events, self.metrics
        idle = self.idle_timeout_s
        watch = IdleWatch(idle)
        chunks = self._chunks
        try:
            if self.head:
                yield self.head
            while not events.done:
                watch.reads += 1  # (fields, not a timer per read: see IdleWatch)
                watch.reading = True
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if not watch.expired():
                        raise
                    raise TimeoutError from None
                watch.reading = False
                out, outputs = events.feed(chunk)
                if outputs:
                    now = time.monotonic()
                    if self.last_token is not None:
                        gap = now - self.last_token
                        metrics.itl.observe(gap)
                        state.observe_itl(gap / outputs)
                    self.last_token = now
                if out:
                    yield out
            if not events.done:  # the worker closed the stream without its end
                self.outcome = "stream_error"
                state.breaker.on_failure(time.monotonic())
                yield sse_error("the worker ended the stream early", "worker_failed")
            elif events.client_error:
                self.outcome = "client_error"
            else:
                self.outcome = "stream_error" if events.error else "success"
                state.breaker.on_success()
        except TimeoutError:
            self.outcome = "timeout"
            yield sse_error(f"the worker sent nothing for {idle:g} s (the idle timeout)", "timeout")
        except OSError as exc:
            self.outcome = "stream_error"
            state.breaker.on_failure(time.monotonic())
            log.warning(
                "request %s: worker %s failed mid-stream: %s", self.request_id, state.id, exc
            )
            yield sse_error(f"the worker failed mid-stream: {type(exc).__name__}", "worker_failed")
        finally:
            watch.stop()
            await self.close()


class IdleWatch:
    """The idle timeout of a stream's reads, with one timer for the whole stream: a read
    only counts itself and says it is reading (``reads``, ``reading``); the timer, twice
    per idle period, sees whether the read under way is the one it saw last time and,
    ``idle`` seconds into one read, cancels the task (:meth:`expired` then says so). So a
    read that never ends is cut between 1 and 1.5 periods after it began. A timer per read
    (``asyncio.timeout``) scheduled and cancelled a handle each chunk: about half the
    router's own work per streamed chunk. Time spent handing a chunk to a slow client is
    not a read: it never times out."""

    __slots__ = (
        "_expired", "_handle", "_loop", "_read_since", "_seen", "_task", "idle", "reading",
        "reads",
    )  # fmt: skip

    def __init__(self, idle: float) -> None:
        self.idle = idle
        self.reading = False
        self.reads = 0
        self._seen = -1
        self._expired = False
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._read_since: float | None = None
        self._handle: asyncio.TimerHandle | None = self._loop.call_later(idle / 2, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        if not self.reading:
            self._read_since = None
        elif self.reads != self._seen or self._read_since is None:  # a read begun since
            self._seen, self._read_since = self.reads, now
        elif now - self._read_since >= self.idle and self._task is not None:
            # the same read at checks a whole period apart: it began at least that long ago
            # (and at most half a period before the first check that saw it)
            self._expired = True
            self._handle = None
            self._task.cancel()
            return
        self._handle = self._loop.call_later(self.idle / 2, self._tick)

    def expired(self) -> bool:
        """Whether the timer cancelled the task (it then takes the cancellation back)."""
        if self._expired and self._task is not None:
            self._task.uncancel()
            return True
        return False

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class RelayResponse(StreamingResponse):
    """Starlette's streaming response watches for the client leaving with an anyio task
    group, two tasks a request; this one relays in the request's own task, with one
    watcher that cancels it when the client hangs up."""

    def __init__(self, relay: Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.stream(), headers=headers, media_type="text/event-stream")
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with until_client_leaves(receive):
                await self.stream_response(send)
        finally:
            await self.relay.close()


@asynccontextmanager
async def until_client_leaves(receive: Any) -> AsyncIterator[None]:
    """Cancel the body of the ``async with`` when the client disconnects (its request body
    has been read: nothing else comes), and carry on after it; a cancellation from
    elsewhere passes through. Cheaper than a task for the work and one for the watch."""
    this = asyncio.current_task()
    assert this is not None
    left = False

    async def watch() -> None:
        nonlocal left
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # cannot tell whether the client is there: carry on
            return
        left = True
        this.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left:
            raise
        this.uncancel()
    finally:
        watcher.cancel()


def sse_error(message: str, code: str) -> bytes:
    err = OpenAIError(502, message, type="server_error", code=code)
    return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"


def error_message(text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError, RecursionError):
        return str(json.loads(text)["error"]["message"])[:300]
    return text[:300]
