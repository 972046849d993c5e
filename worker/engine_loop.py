"""The engine in its own thread, and the asyncio side's door to it.

The server never calls the engine directly: a forward pass holds the engine for tens of
milliseconds, and an event loop that waited on it would stall every connection. Instead
each call (submit, abort, unpin, import) goes into a command queue; the engine thread runs
the queued commands between steps, steps while there is work, and hands results back to
the event loop in one batch per step (one wake-up of the loop per step, not per token).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from .engine import EngineCore, EngineStats, PreparedRequest, RequestOutput

log = logging.getLogger(__name__)

T = TypeVar("T")

_STOP = object()


@dataclass
class TimedOutput:
    output: RequestOutput
    time: float  # time.monotonic() when the engine produced it
    tag: int = 0  # the submitter's label (which choice of a request it belongs to)


class _LoopStream:
    """A request's output sink: the engine thread posts each output for the event loop."""

    def __init__(self, owner: EngineLoop, queue: asyncio.Queue[TimedOutput], tag: int) -> None:
        self.owner, self.queue, self.tag = owner, queue, tag

    def put(self, output: RequestOutput) -> None:  # called in the engine thread
        # Stamped when handed over (after the step), the moment a client could see it.
        self.owner._post(self.queue.put_nowait, TimedOutput(output, 0.0, self.tag))


class EngineLoop:
    """Owns the engine's thread. Start and stop it from the event loop that uses it."""

    def __init__(
        self, engine: EngineCore, *, name: str = "engine", pin_check_interval_s: float = 1.0
    ) -> None:
        self.engine = engine
        self.name = name
        self.pin_check_interval_s = pin_check_interval_s
        self.stats: EngineStats = engine.stats  # a snapshot, renewed after every step
        self.prompt_token_rate = 0.0  # prompt tokens admitted per second, smoothed
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outbox: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._outbox_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.on_pins_expired: Callable[[list[str]], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever still runs and end the thread."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._drain_outbox()

    # -- calls from the event loop -------------------------------------------------------
    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(*args)`` in the engine thread between steps; await the result."""
        assert self._loop is not None, "the engine loop is not started"
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, args, future))
        return future

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Like :meth:`call`, for calls nobody waits on (an abort, an unpin)."""
        self._commands.put((fn, args, None))

    def submit(
        self, prepared: PreparedRequest, queue: asyncio.Queue[TimedOutput], tag: int = 0
    ) -> None:
        """Queue a request; its outputs arrive on ``queue``, tagged with ``tag``. Whoever
        stops reading before the last output must :meth:`abort` it (to free its blocks)."""
        self._commands.put((self._submit, (prepared, _LoopStream(self, queue, tag)), None))

    def _submit(self, prepared: PreparedRequest, stream: _LoopStream) -> None:
        try:
            self.engine.submit(prepared, stream)
        except Exception as exc:  # the request ends at once, in error, rather than hang
            log.error("request %s refused by the engine: %s", prepared.request_id, exc)
            stream.put(
                RequestOutput(
                    prepared.request_id,
                    [],
                    "",
                    True,
                    "error",
                    num_prompt_tokens=len(prepared.prompt_token_ids),
                )
            )

    def abort(self, request_id: str) -> None:
        self.call_soon(self.engine.abort, request_id)

    # -- the engine thread ---------------------------------------------------------------
    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._outbox_lock:
            self._outbox.append((fn, args))

    def _take(self) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
        """What the engine thread posted so far, outputs stamped with the time now."""
        now = time.monotonic()
        with self._outbox_lock:
            items, self._outbox = self._outbox, []
        for _, args in items:
            if args and isinstance(args[0], TimedOutput) and not args[0].time:
                args[0].time = now
        return items

    def _flush(self) -> None:
        """Hand this step's outputs to the event loop. Exactly these: outputs of a later
        step must not ride along before their step is over."""
        items = self._take()
        if items and self._loop is not None and not self._loop.is_closed():
            with suppress(RuntimeError):  # the loop closed in between
                self._loop.call_soon_threadsafe(_deliver, items)

    def _drain_outbox(self) -> None:
        """Deliver what is left (after the thread has ended)."""
        _deliver(self._take())

    def _run_command(self, command: Any) -> None:
        fn, args, future = command
        try:
            result = fn(*args)
        except Exception as exc:
            if future is None:
                log.exception("engine command %s failed", getattr(fn, "__name__", fn))
            else:
                self._post(_settle, future, None, exc)
            return
        if future is not None:
            self._post(_settle, future, result, None)

    def _run(self) -> None:
        engine = self.engine
        next_pin_check = time.monotonic() + self.pin_check_interval_s
        last_prompt_tokens, last_time = self.stats.prompt_tokens, time.monotonic()
        stopping = False
        while not stopping:
            commands: list[Any] = []
            if not engine.has_unfinished() or not engine.last_step_scheduled:
                # Idle, or stuck until something changes (a command, a pin's expiry).
                wait = max(0.0, next_pin_check - time.monotonic())
                with suppress(queue.Empty):
                    commands.append(self._commands.get(timeout=wait))
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    stopping = True
                    continue
                self._run_command(command)
            if stopping:
                engine.end_all("abort")
            elif engine.has_unfinished():
                try:
                    engine.step()
                except Exception:  # a bug outside the forward pass: fail loudly, keep serving
                    log.exception("the engine step failed outside the model; ending all requests")
                    engine.end_all("error")
            now = time.monotonic()
            if now >= next_pin_check:
                next_pin_check = now + self.pin_check_interval_s
                expired = engine.expire_pins(now)
                if expired:
                    log.warning(
                        "freed the pinned blocks of %d prefill(s) nobody pulled: %s",
                        len(expired),
                        ", ".join(expired[:5]),
                    )
                    if self.on_pins_expired is not None:
                        self._post(self.on_pins_expired, expired)
            self.stats = stats = engine.stats
            if now - last_time >= 0.5:
                rate = (stats.prompt_tokens - last_prompt_tokens) / (now - last_time)
                self.prompt_token_rate = 0.5 * self.prompt_token_rate + 0.5 * rate
                last_prompt_tokens, last_time = stats.prompt_tokens, now
            self._flush()


def _deliver(items: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    for fn, args in items:
        fn(*args)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
