"""The retry-and-claim loop, written once: a request leg's tries on one worker after another.

Whole requests, prefill legs and decode legs are tried the same way. Each try waits out a
backoff (after the first), picks a worker the leg has not tried (or takes the decision
the planner already made), counts the decision, claims the worker's cache for the
prompt (speculatively, so the next request sees it), and gives the try to its caller.
The claim lasts while the try waits for the worker: until its first token or its end
(:meth:`Tries.reached`), when the worker's events take over. A try that fails takes back
what it alone claimed; when a later one succeeds, the workers that
failed in a way the request itself may have caused (a 5xx, no token) are charged to their
breakers then, not before: a request that fails everywhere is more likely bad than every
worker broken.

What differs between the legs stays with their callers: the load claimed (a prefill's
uncached tokens, a decode leg's tail), the timeouts, the answer, and which failures end
the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..admin.metrics import RouterMetrics
from ..routing.inputs import Decision
from ..settings import RouterSettings
from ..state.index import Hold
from ..state.pool import WorkerPool
from ..state.worker import WorkerState
from .relay import Failed

log = logging.getLogger(__name__)


class Attempt:
    """One try of a request on one worker, until its answer starts reaching the client.
    The pool aborts it when the worker is marked down (its health check failed): the
    request's task is cancelled, and the attempt fails over to another worker."""

    __slots__ = ("aborted", "committed", "task")

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.aborted: str | None = None
        self.committed = False

    def abort(self, reason: str) -> None:
        if self.committed or self.aborted is not None or self.task is None:
            return
        if asyncio.current_task() is self.task:
            return  # the attempt itself found the worker down: it is failing already
        self.aborted = reason
        self.task.cancel()

    def failure(self) -> Failed | None:
        """After a cancellation: the failure it stands for if the pool aborted this attempt
        and nobody else cancelled the task, else None (the cancellation goes on)."""
        if self.aborted is None or self.task is None or self.task.uncancel() > 0:
            return None
        return Failed("down", "the worker stopped answering")


@dataclass(slots=True)
class Try:
    """One worker's turn: the decision that chose it, and the cache claimed there."""

    number: int  # 0: the first
    decision: Decision
    state: WorkerState
    rank: int | None  # the data-parallel rank holding the match, when the worker has ranks
    #: its chain counted as held there from now: released at its first token or end,
    #: taken back on failure (None: the worker left the index meanwhile)
    speculated: Hold | None


class Tries:
    """A leg's tries, in turn: ``while (t := await tries.next()) is not None``, then
    :meth:`failed` or :meth:`succeeded` for each. ``decide(tried)`` picks the next worker;
    ``first``, the planner's decision for the first try (None: decide it too).
    ``stop_at``: no try starts after this monotonic time (None: the tries' count alone
    bounds them)."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: WorkerPool,
        metrics: RouterMetrics,
        request_id: str,
        keys: list[int],
        decide: Callable[[set[str]], Decision],
        *,
        first: Decision | None = None,
        ranks: dict[str, int] | None = None,
        stop_at: float | None = None,
        what: str = "",
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.request_id = request_id
        self.keys = keys
        self.decide = decide
        self.first = first
        self.ranks = ranks
        self.stop_at = stop_at
        self.what = what  # for the log: "prefill " for a prefill leg
        self.tried: set[str] = set()
        self.failures: list[str] = []
        self.last: Failed | None = None
        self._suspects: list[WorkerState] = []  # failed in a way the request may have caused
        self._number = 0

    async def next(self) -> Try | None:
        """The next worker's try, or None when the tries are spent (their count, the time,
        or no worker left)."""
        s = self.settings
        number = self._number
        if number >= s.max_attempts:
            return None
        self._number += 1
        if number:
            await asyncio.sleep(min(s.retry_backoff_s * 2 ** (number - 1), 1.0))
            if self.stop_at is not None and time.monotonic() >= self.stop_at:
                return None  # the request's time is spent: no other worker gets it
        if number == 0 and self.first is not None:
            decision = self.first
        else:
            t0 = time.perf_counter()
            decision = self.decide(self.tried)
            self.metrics.decision_latency.observe(time.perf_counter() - t0)
            if decision.worker is not None and log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: %s%s", self.request_id, self.what, decision.explain())
        if decision.worker is None:
            return None
        if self.last is not None:  # sent again: the last worker failed before any byte
            self.metrics.retries.labels(self.last.reason).inc()
        state = self.pool.workers[decision.worker]
        state.decisions[decision.reason] += 1
        rank = self.ranks.get(state.id) if self.ranks is not None else None
        speculated = self.pool.feed.speculate(state.id, self.keys, rank)
        state.breaker.on_attempt(time.monotonic())
        self.tried.add(state.id)
        return Try(number, decision, state, rank, speculated)

    def failed(self, t: Try, exc: Failed, *, suspect: bool) -> None:
        """The try failed before any byte reached the client: its claim on the worker's
        cache is taken back. ``suspect``: perhaps the request's fault (see the module)."""
        self.pool.feed.withdraw(t.speculated)
        self.last = exc
        self.failures.append(str(exc))
        if suspect:
            self._suspects.append(t.state)

    def reached(self, t: Try, *, computed: bool = True) -> None:
        """The try is done waiting for the worker (its first token, its end, or the client
        left): its claim on the worker's cache is the worker's events' to confirm now.
        ``computed`` false: the worker answered, but refused the request (a 4xx), so it
        computed nothing, and what the try alone claimed is taken back. Once: later calls,
        and :meth:`failed` after it, change nothing."""
        if computed:
            self.pool.feed.release(t.speculated)
        else:
            self.pool.feed.withdraw(t.speculated)

    def succeeded(self) -> None:
        """A worker answered: what failed before it was those workers' fault."""
        now = time.monotonic()
        for suspect in self._suspects:
            suspect.breaker.on_failure(now)
