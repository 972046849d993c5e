"""Flow control: where requests wait in the router while the pool is saturated (pure).

When every eligible worker is predicted to be too slow (the server decides that, from the
policy's predictions), sending more work only lengthens worker queues, where the router
can no longer reorder it. Requests wait here instead, and leave in the order that serves
the tenants' classes and shares:

* **Priority bands**, served in strict priority: nothing of ``normal`` leaves while a
  ``high`` entry waits, nothing of ``low`` while a ``normal`` one waits.
* **Token fairness within a band**: the virtual token counter (VTC) of Sheng et al.,
  "Fairness in Serving Large Language Models" (OSDI '24), as AIBrix uses it. Each tenant
  has a counter of the tokens it was served, divided by its weight; the next entry comes
  from the backlogged tenant with the smallest counter. A tenant that becomes backlogged
  has its counter lifted to the smallest counter of those already waiting (or to the
  band's virtual time when none wait), so time spent idle is not banked as credit. A
  flood of small requests and a trickle of large ones thus get equal *tokens*, not equal
  request counts. Within one tenant, first in first out.
* **Bounds**: at most ``max_requests`` entries and ``max_bytes`` bytes, where an entry's
  bytes are what it declares (its body, its token ids) plus :data:`ENTRY_OVERHEAD_BYTES`
  for the queue's own bookkeeping, so the bound is a bound on memory. A full queue makes
  room for a more deserving entry by *displacing* the newest entry of the tenant that
  holds the most (longest-queue drop): first from lower bands, then, in the new entry's
  own band, from a tenant whose backlog ends later in virtual time than the newcomer's
  would. A flooding tenant therefore cannot lock others out of the queue; its own new
  entries are the ones refused.
* **Deadlines**: an entry may carry an absolute deadline (for its first token). If the
  predicted wait already overshoots it, :meth:`FairQueue.push` refuses it at once; if it
  passes while the entry waits, the entry is removed. Both are reported with reason
  ``deadline``.

The predicted wait is ``tokens queued ahead / drain rate``. *Ahead* is every token queued
in higher bands, the tenant's own queued tokens, and from each other tenant of the band
the tokens VTC would serve before the newcomer: up to the point where that tenant's
counter reaches the newcomer's start in virtual time. Arrivals after the newcomer (a
later ``high`` request, say) are not foreseen, and the time until a worker frees a slot
is not counted, so the figure is a lower bound in a steady state. The drain rate is an
EWMA of the tokens popped per second, measured only over windows in which the queue was
backlogged throughout (an idle queue says nothing about the pool's speed). Until a first
window closes there is no prediction and nothing is shed by prediction.

No I/O, no asyncio: the caller owns the clock and the event loop. Entries carry an opaque
``payload`` (an ``asyncio.Future`` the request awaits, typically); the queue hands
entries it removes by itself (deadline, displacement) to the ``on_shed`` callback, and
the caller's dispatcher calls :meth:`FairQueue.pop_next` whenever capacity frees and
:meth:`FairQueue.expire` at :meth:`FairQueue.next_deadline`.

Per-tenant state is kept only while a tenant has entries queued, plus a remembered
counter while it is ahead of the band's virtual time, so tenants that left cost nothing.
Tenants should nonetheless be a bounded set (the configured tenants, not client-chosen
strings): displacement and wait prediction scan the tenants of one band.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from .entries import (
    ENTRY_OVERHEAD_BYTES,
    Band,
    Entry,
    QueueRefused,
    QueueStats,
    ShedReason,
    _Band,
    _Tenant,
)
from .queue_upkeep import QueueUpkeep, _secs

__all__ = ["FairQueue"]

log = logging.getLogger(__name__)


class FairQueue(QueueUpkeep):
    """Bounded waiting room with strict priority between bands and VTC within a band.

    ``on_shed(entry, reason)`` is called, synchronously, for every entry the queue removes
    by itself (``deadline`` from :meth:`expire`, ``displaced`` from :meth:`push`); it
    should fail the entry's future and return, without calling back into the queue.
    """

    def __init__(
        self,
        *,
        max_requests: int,
        max_bytes: int,
        on_shed: Callable[[Entry, str], None],
        clock: Callable[[], float] = time.monotonic,
        drain_window_s: float = 1.0,
        drain_alpha: float = 0.3,
    ) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, not {max_requests}")
        if max_bytes < ENTRY_OVERHEAD_BYTES:
            raise ValueError(f"max_bytes must be at least {ENTRY_OVERHEAD_BYTES}, not {max_bytes}")
        if not drain_window_s > 0 or not 0 < drain_alpha <= 1:
            raise ValueError("drain_window_s must be > 0 and drain_alpha in (0, 1]")
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self._on_shed = on_shed
        self._clock = clock
        self._bands = {b: _Band() for b in Band}
        self._entries: dict[int, Entry] = {}
        self._peak = 0
        self._bytes = 0
        self._seq = itertools.count()
        self._tiebreak = itertools.count()
        # deadlines: (deadline, seq) of entries that have one; removed ones go stale
        self._deadlines: list[tuple[float, int]] = []
        self._live_deadlines = 0
        # drain rate
        self._window_s, self._alpha = drain_window_s, drain_alpha
        self._win_start: float | None = None
        self._win_tokens = 0
        self._rate: float | None = None
        # counters
        self._popped = dict.fromkeys(Band, 0)
        self._wait_sum = dict.fromkeys(Band, 0.0)
        self._shed: dict[str, int] = {}
        self._cancelled = 0
        self._dispatched: dict[str, int] = {}

    # -- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes accounted now, :data:`ENTRY_OVERHEAD_BYTES` per entry included."""
        return self._bytes

    @property
    def drain_rate(self) -> float | None:
        """Tokens popped per second while backlogged (EWMA); None before a measurement."""
        return self._rate

    def depth(self, band: Band | str) -> int:
        return self._bands[Band.of(band)].count

    def depth_by_band(self) -> dict[str, int]:
        """Entries waiting now, by band label (a gauge's source)."""
        return {band.label: b.count for band, b in self._bands.items()}

    def queued_tokens(self, band: Band | str) -> int:
        return self._bands[Band.of(band)].tokens

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting entry: when :meth:`expire` has work to do."""
        self._clean_deadlines()
        return self._deadlines[0][0] if self._deadlines else None

    def stats(self) -> QueueStats:
        return QueueStats(
            depth={b: s.count for b, s in self._bands.items()},
            bytes=self._bytes,
            popped=dict(self._popped),
            wait_seconds_sum=dict(self._wait_sum),
            shed=dict(self._shed),
            cancelled=self._cancelled,
            dispatched_tokens=dict(self._dispatched),
            drain_rate=self._rate,
        )

    def predicted_wait(self, band: Band | str, tenant: str) -> float | None:
        """Seconds a new entry of ``tenant`` in ``band`` would wait (see the module's
        docstring for what it counts); None while the drain rate is unmeasured."""
        if self._rate is None:
            return None
        ahead = self._tokens_ahead(Band.of(band), tenant)
        if ahead <= 0:
            return 0.0
        return ahead / self._rate if self._rate > 0 else math.inf

    # -- writing --------------------------------------------------------------------------

    def push(
        self,
        band: Band | str,
        tenant: str,
        *,
        cost: int,
        size: int,
        payload: Any = None,
        deadline: float | None = None,
        weight: float = 1.0,
    ) -> Entry:
        """Queue a request, or raise :class:`QueueRefused` (deadline already unreachable,
        or no room even after displacing less deserving entries)."""
        if cost < 0 or size < 0:
            raise ValueError("cost and size must not be negative")
        if not weight > 0:
            raise ValueError(f"weight must be positive, not {weight}")
        band = Band.of(band)
        now = self._clock()
        self.expire()
        if deadline is not None:
            wait = self.predicted_wait(band, tenant)
            if deadline <= now or (wait is not None and now + wait > deadline):
                self._count_shed("deadline")
                raise QueueRefused(
                    "deadline",
                    "the pool is saturated and this request would not start before its "
                    f"deadline (predicted wait {_secs(wait)}, deadline in "
                    f"{_secs(max(0.0, deadline - now))})",
                    wait,
                )
        need = size + ENTRY_OVERHEAD_BYTES
        if need > self.max_bytes:
            self._count_shed("queue_bytes")
            raise QueueRefused(
                "queue_bytes",
                f"this request needs {need} bytes in the router's queue, more than its "
                f"whole bound of {self.max_bytes}",
                None,
            )
        if not self._make_room(band, tenant, weight, cost, need):
            full = len(self._entries) >= self.max_requests
            reason: ShedReason = "queue_full" if full else "queue_bytes"
            self._count_shed(reason)
            what = (
                f"{len(self._entries)} requests, its limit"
                if full
                else f"{self._bytes} of its {self.max_bytes} bytes"
            )
            raise QueueRefused(
                reason,
                f"the pool is saturated and the router's queue holds {what}",
                self._drain_time(),
            )
        entry = Entry(
            band=band,
            tenant=tenant,
            cost=cost,
            size=size,
            weight=weight,
            enqueued_at=now,
            deadline=deadline,
            payload=payload,
            seq=next(self._seq),
        )
        if not self._entries and self._win_start is None:
            self._win_start = now  # a backlogged period starts: measure the drain rate
        b = self._bands[band]
        t = b.tenants.get(tenant)
        if t is None:
            t = _Tenant(tenant, self._start(b, tenant), weight)
            b.idle.pop(tenant, None)
            b.tenants[tenant] = t
            b.tenants_peak = max(b.tenants_peak, len(b.tenants))
            self._push_heap(b, t)
        t.weight = weight
        t.entries[entry.seq] = entry
        t.peak = max(t.peak, len(t.entries))
        t.queued_tokens += cost
        b.count += 1
        b.tokens += cost
        self._entries[entry.seq] = entry
        self._peak = max(self._peak, len(self._entries))
        self._bytes += need
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, entry.seq))
            self._live_deadlines += 1
        return entry

    def peek(self) -> Entry | None:
        """The entry :meth:`pop_next` would return, left in place (expired ones are shed
        first): a dispatcher that must first check the pool can take this one."""
        self.expire()
        for b in self._bands.values():
            if self._min_counter(b) is not None:
                t = b.heap[0][3]
                return next(iter(t.entries.values()))
        return None

    def pop_next(self) -> Entry | None:
        """The next entry to dispatch (expired ones are shed first), or None if empty."""
        now = self._clock()
        self.expire()
        for band, b in self._bands.items():
            while b.heap:
                counter, _, version, t = heapq.heappop(b.heap)
                if version != t.version or b.tenants.get(t.name) is not t:
                    continue  # stale: the tenant left or was re-queued
                _, entry = t.entries.popitem(last=False)
                b.vtime = max(b.vtime, counter)
                t.counter += entry.cost / t.weight
                self._unlink(b, t, entry)
                if t.entries:
                    self._push_heap(b, t)
                entry.state = "dispatched"
                entry.waited_s = now - entry.enqueued_at
                self._popped[band] += 1
                self._wait_sum[band] += entry.waited_s
                self._dispatched[entry.tenant] = self._dispatched.get(entry.tenant, 0) + entry.cost
                self.on_dispatched(entry.cost, now)
                self._end_window_if_idle()
                return entry
        return None

    def remove(self, entry: Entry) -> bool:
        """Take back a waiting entry (its client left, or the caller timed it out):
        O(1) amortised. False if it had already left the queue."""
        if self._entries.get(entry.seq) is not entry:
            return False
        self._drop(entry, "cancelled", None)
        self._cancelled += 1
        return True

    def expire(self) -> int:
        """Shed every entry whose deadline has passed (``on_shed(entry, "deadline")``);
        the number shed."""
        now = self._clock()
        shed = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq = heapq.heappop(self._deadlines)
            entry = self._entries.get(seq)
            if entry is None:
                continue  # stale: it left the queue earlier
            self._drop(entry, "shed", "deadline")
            self._count_shed("deadline")
            shed += 1
            self._on_shed(entry, "deadline")
        return shed

    def settle(self, entry: Entry, actual_tokens: int) -> None:
        """Charge a dispatched entry's tenant for what it really used instead of its
        estimate (a request that stopped early gets the difference back in its counter).
        A no-op when the tenant's counter is no longer kept (it fell behind the band)."""
        if entry.state != "dispatched":
            return
        self.adjust(entry.band, entry.tenant, actual_tokens - entry.cost, entry.weight)

    def adjust(self, band: Band | str, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """Correct what a tenant was counted for a request served (queued or not) by
        ``tokens``: its real usage less the estimate it was charged."""
        delta = tokens / weight
        b = self._bands[Band.of(band)]
        t = b.tenants.get(tenant)
        if t is not None:
            t.counter = max(b.vtime, t.counter + delta) if delta < 0 else t.counter + delta
            t.version += 1
            self._push_heap(b, t)
        elif tenant in b.idle:
            b.idle[tenant] += delta
            if b.idle[tenant] <= b.vtime:
                del b.idle[tenant]

    def charge(self, band: Band | str, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """Count tokens a tenant was served without waiting here (the pool was not
        saturated), as VTC counts all service. Served like a pop: with nobody waiting in
        the band, virtual time moves to the tenant's start, so what counts when the queue
        forms is the last request of each, not the whole history of the quiet period."""
        b = self._bands[Band.of(band)]
        t = b.tenants.get(tenant)
        if t is not None:
            t.counter += tokens / weight
            t.version += 1
            self._push_heap(b, t)
            return
        start = self._start(b, tenant)
        if self._min_counter(b) is None:
            b.vtime = max(b.vtime, start)
        counter = start + tokens / weight
        if counter > b.vtime:
            b.idle[tenant] = counter
            if len(b.idle) >= b.idle_sweep_at:
                b.idle = {k: c for k, c in b.idle.items() if c > b.vtime}
                b.idle_sweep_at = max(64, 2 * len(b.idle))

    def on_dispatched(self, tokens: int, now: float | None = None) -> None:
        """Feed the drain-rate measurement. :meth:`pop_next` already does it for what it
        pops; call it only for work that reached the workers some other way while the
        queue was backlogged."""
        if self._win_start is None:
            return
        now = self._clock() if now is None else now
        self._win_tokens += tokens
        elapsed = now - self._win_start
        if elapsed >= self._window_s:
            sample = self._win_tokens / elapsed
            self._rate = (
                sample
                if self._rate is None
                else self._alpha * sample + (1 - self._alpha) * self._rate
            )
            self._win_start, self._win_tokens = now, 0
