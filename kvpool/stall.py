"""Timeouts that a stall of the router's own event loop cannot trip.

A timer measures wall time; a router whose loop was blocked for 3 s (a long replay, a
burst of thousands of requests, a garbage collection) finds every health check and every
connect in flight "timed out" when it resumes, although the workers' answers sat in the
socket buffers all along. Judged on wall time, the router then took every worker out of
rotation at once (503 for everyone) and failed thousands of streams with "connection timed
out" to workers that had accepted them.

:class:`LoopClock` counts the time the loop was not running: a tick every ``tick_s``, and
what a tick was late by beyond one tick is time lost. :meth:`LoopClock.within` bounds an
awaitable by the time the loop was responsive, so a timeout means the other side really
took that long while the router was there to see the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["LoopClock"]

T = TypeVar("T")


class LoopClock:
    """Monotonic time less the event loop's stalls (see the module's docstring)."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        #: seconds the loop was stalled (late ticks), since the clock started
        self.lost = 0.0
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        return time.monotonic() - self.lost

    def start(self) -> None:
        """Start ticking on the running loop (at the first :meth:`within` otherwise)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._tick())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _tick(self) -> None:
        tick = self.tick_s
        while True:
            due = time.monotonic() + tick
            await asyncio.sleep(tick)
            late = time.monotonic() - due
            if late > tick:  # jitter under a tick is the loop's normal work
                self.lost += late

    async def within(self, awaitable: Awaitable[T], timeout: float) -> T:
        """``awaitable``'s result, or :class:`TimeoutError` once it has taken ``timeout``
        seconds of the loop's responsive time (it is cancelled then, as with
        ``asyncio.timeout``)."""
        self.start()
        task = asyncio.ensure_future(awaitable)
        start = self.now()
        try:
            while True:
                remaining = timeout - (self.now() - start)
                if remaining <= 0:
                    raise TimeoutError(f"no answer within {timeout:g} s")
                done, _ = await asyncio.wait((task,), timeout=remaining)
                if done:
                    return task.result()
        finally:
            if not task.done():
                # Cancelled, not awaited: awaiting here would swallow a cancellation of the
                # caller; the task unwinds (closing its connection) on its own.
                task.cancel()
