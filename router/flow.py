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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal

from kvpool.openai_api import OpenAIError

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "Band",
    "Entry",
    "FairQueue",
    "QueueRefused",
    "QueueStats",
    "ShedReason",
    "parse_band",
]

log = logging.getLogger(__name__)

#: bytes charged per entry on top of what it declares: the Entry, its slots in the
#: queue's dicts and heaps (measured with tracemalloc: about 450 bytes; rounded up)
ENTRY_OVERHEAD_BYTES = 512

#: a dict that held more entries than this is copied once it is down to a quarter
_SHRINK_FROM = 256

#: why an entry left the queue without being served, or was never let in
ShedReason = Literal["queue_full", "queue_bytes", "deadline", "displaced"]


class Band(IntEnum):
    """Priority bands; a smaller value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @property
    def label(self) -> str:
        """The name used in headers, the tenants file and metric labels."""
        return self.name.lower()

    @classmethod
    def of(cls, band: Band | str) -> Band:
        """A band, or its label (``high``, ``normal``, ``low``) as one."""
        return band if isinstance(band, Band) else cls[band.upper()]


def parse_band(value: str, source: str = "priority") -> Band:
    """``high``, ``normal`` or ``low`` (any case) as a :class:`Band`; anything else is a
    400 naming ``source`` (the header or field the value came from)."""
    try:
        return Band[value.strip().upper()]
    except KeyError:
        raise OpenAIError(
            400,
            f"{source} must be one of 'high', 'normal', 'low'",
            code="invalid_priority",
            param=source,
        ) from None


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request. Returned by :meth:`FairQueue.push`; the caller keeps it to
    cancel with :meth:`FairQueue.remove`, and gets it back from :meth:`FairQueue.pop_next`
    or the ``on_shed`` callback."""

    band: Band
    tenant: str
    #: tokens the request is expected to take (prompt + max_tokens): its VTC charge and
    #: its weight in wait predictions
    cost: int
    #: bytes it holds while waiting, as declared (the queue adds its own overhead)
    size: int
    weight: float
    enqueued_at: float
    #: absolute time (the queue's clock) by which it must be dispatched, if any
    deadline: float | None
    payload: Any
    seq: int
    #: queued | dispatched | cancelled | shed
    state: str = "queued"
    #: seconds it waited, set when it leaves the queue
    waited_s: float | None = None
    #: set when shed: one of :data:`ShedReason`
    shed_reason: str | None = None
    #: the caller's: the future its request awaits, say (the queue never touches it)
    future: Any = None


class QueueRefused(OpenAIError):
    """A push the queue could not take; an :class:`OpenAIError` the server can raise as
    it is (status, OpenAI body and ``Retry-After``).

    ``reason`` is ``queue_full`` or ``queue_bytes`` (429: too much is waiting already),
    ``displaced`` (429: it waited, and gave its place to a more deserving request; see
    :func:`shed_error`) or ``deadline`` (503: the pool cannot start it in time).
    ``retry_after_s`` is the predicted wait or time for the queue to drain, None without
    a measured drain rate (``Retry-After`` is then 1)."""

    def __init__(self, reason: ShedReason, message: str, retry_after_s: float | None) -> None:
        self.reason, self.retry_after_s = reason, retry_after_s
        status = 503 if reason == "deadline" else 429
        super().__init__(
            status,
            message,
            type="service_unavailable" if status == 503 else "rate_limit_error",
            code=reason,
            headers={"Retry-After": retry_after_header(retry_after_s)},
        )


def retry_after_header(seconds: float | None) -> str:
    """Whole seconds, rounded up, at least 1 (RFC 9110 allows only whole seconds)."""
    if seconds is None or not math.isfinite(seconds):
        return "1"
    return str(max(1, math.ceil(seconds - 1e-9)))


def shed_error(entry: Entry, retry_after_s: float | None = None) -> OpenAIError:
    """The error to answer for an entry the queue shed while it waited (deadline passed,
    or displaced by a more deserving one)."""
    if entry.shed_reason == "displaced":
        msg = "the router's queue is full and this request gave its place to another"
        return QueueRefused("displaced", msg, retry_after_s)
    msg = "the pool could not start this request before its deadline"
    return QueueRefused("deadline", msg, retry_after_s)


@dataclass
class QueueStats:
    """Counters for metrics (monotonic unless said otherwise)."""

    #: entries waiting per band now (a gauge)
    depth: dict[Band, int]
    #: bytes accounted now, overhead included (a gauge)
    bytes: int
    #: entries popped per band, and the sum of their waits
    popped: dict[Band, int]
    wait_seconds_sum: dict[Band, float]
    #: pushes refused and entries removed, by reason
    shed: dict[str, int]
    #: entries the caller removed (client left)
    cancelled: int
    #: tokens (entry cost) popped per tenant
    dispatched_tokens: dict[str, int]
    #: the measured drain rate in tokens per second, None before a measurement
    drain_rate: float | None


@dataclass(slots=True, eq=False)
class _Tenant:
    """A tenant with entries queued in one band."""

    name: str
    counter: float
    weight: float
    entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    queued_tokens: int = 0
    #: the most entries it held since ``entries`` was last copied (see ``_unlink``)
    peak: int = 0
    #: bumped whenever the tenant's heap item goes stale
    version: int = 0

    def finish(self) -> float:
        """Where its backlog ends in virtual time."""
        return self.counter + self.queued_tokens / self.weight


@dataclass(slots=True, eq=False)
class _Band:
    tenants: dict[str, _Tenant] = field(default_factory=dict)
    tenants_peak: int = 0
    #: (counter, tiebreak, version, tenant) of backlogged tenants; stale items skipped
    heap: list[tuple[float, int, int, _Tenant]] = field(default_factory=list)
    #: counters of tenants with nothing queued that are ahead of ``vtime``
    idle: dict[str, float] = field(default_factory=dict)
    idle_sweep_at: int = 64
    #: the counter of the last tenant served: where a newly backlogged tenant starts
    vtime: float = 0.0
    count: int = 0
    tokens: int = 0


class FairQueue:
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

    # -- internals ------------------------------------------------------------------------

    def _tokens_ahead(self, band: Band, tenant: str) -> float:
        ahead = float(sum(self._bands[b].tokens for b in Band if b < band))
        b = self._bands[band]
        own = b.tenants.get(tenant)
        if own is not None:
            start = own.finish()
            ahead += own.queued_tokens
        else:
            start = self._start(b, tenant)
        for t in b.tenants.values():
            if t is not own:
                ahead += min(t.queued_tokens, max(0.0, start - t.counter) * t.weight)
        return ahead

    def _drain_time(self) -> float | None:
        if self._rate is None or self._rate <= 0:
            return None
        return sum(b.tokens for b in self._bands.values()) / self._rate

    def _make_room(self, band: Band, tenant: str, weight: float, cost: int, need: int) -> bool:
        """Displace less deserving entries until one of ``need`` bytes fits; False (and
        nothing displaced) if it cannot."""

        def fits(n: int, nbytes: int) -> bool:
            return n + 1 <= self.max_requests and nbytes + need <= self.max_bytes

        n, nbytes = len(self._entries), self._bytes
        if fits(n, nbytes):
            return True
        # plan first, displace after: a push that cannot fit must change nothing
        victims: list[Entry] = []
        for vb in sorted(Band, reverse=True):  # lowest band first
            if vb < band or fits(n, nbytes):
                break
            b = self._bands[vb]
            mine = math.inf  # the newcomer's start in virtual time, in its own band
            if vb == band:
                own = b.tenants.get(tenant)
                mine = own.finish() if own is not None else self._start(b, tenant)
            # from the tenant whose backlog ends latest, its newest entry first
            cursors = {
                name: [t.finish(), reversed(t.entries.values()), t] for name, t in b.tenants.items()
            }
            while not fits(n, nbytes) and cursors:
                name = max(cursors, key=lambda k: cursors[k][0])
                finish, newest, t = cursors[name]
                victim = next(newest, None)
                if victim is None:
                    del cursors[name]
                    continue
                victim_start = finish - victim.cost / t.weight
                if vb == band and (name == tenant or victim_start <= mine):
                    break  # everyone left would be served before the newcomer
                cursors[name][0] = victim_start
                victims.append(victim)
                n, nbytes = n - 1, nbytes - victim.size - ENTRY_OVERHEAD_BYTES
        if not fits(n, nbytes):
            return False
        for victim in victims:
            self._drop(victim, "shed", "displaced")
            self._count_shed("displaced")
            self._on_shed(victim, "displaced")
        return True

    def _start(self, b: _Band, tenant: str) -> float:
        """Where a tenant with nothing queued in ``b`` would start in virtual time."""
        base = self._min_counter(b)
        base = b.vtime if base is None else base
        return max(b.idle.get(tenant, base), base)

    def _drop(self, entry: Entry, state: str, reason: str | None) -> None:
        b = self._bands[entry.band]
        t = b.tenants[entry.tenant]
        del t.entries[entry.seq]
        self._unlink(b, t, entry)
        entry.state, entry.shed_reason = state, reason
        entry.waited_s = self._clock() - entry.enqueued_at
        if not t.entries:
            t.version += 1  # its heap item is stale now
        self._end_window_if_idle()

    def _unlink(self, b: _Band, t: _Tenant, entry: Entry) -> None:
        """Account for ``entry`` leaving (already out of ``t.entries``).

        A dict keeps its table when entries are deleted, so one that held many and now
        holds a quarter of that is copied (amortised O(1)): memory follows what waits
        now, not the longest queue ever seen."""
        del self._entries[entry.seq]
        if self._peak > _SHRINK_FROM and 4 * len(self._entries) < self._peak:
            self._entries = dict(self._entries)
            self._peak = len(self._entries)
        self._bytes -= entry.size + ENTRY_OVERHEAD_BYTES
        t.queued_tokens -= entry.cost
        b.count -= 1
        b.tokens -= entry.cost
        if entry.deadline is not None:
            self._live_deadlines -= 1
            self._compact_deadlines()
        if not t.entries:
            del b.tenants[t.name]
            t.entries = OrderedDict()  # stale heap items may keep ``t`` a while: not its table
            if b.tenants_peak > _SHRINK_FROM and 4 * len(b.tenants) < b.tenants_peak:
                b.tenants = dict(b.tenants)
                b.tenants_peak = len(b.tenants)
            if not b.tenants:
                b.heap = []  # every item is stale
            if t.counter > b.vtime:
                b.idle[t.name] = t.counter
                if len(b.idle) >= b.idle_sweep_at:
                    b.idle = {k: c for k, c in b.idle.items() if c > b.vtime}
                    b.idle_sweep_at = max(64, 2 * len(b.idle))
        elif t.peak > _SHRINK_FROM and 4 * len(t.entries) < t.peak:
            t.entries = OrderedDict(t.entries)
            t.peak = len(t.entries)
        if len(b.heap) > 2 * len(b.tenants) + 64:
            b.heap = [
                item
                for item in b.heap
                if item[2] == item[3].version and item[3] is b.tenants.get(item[3].name)
            ]
            heapq.heapify(b.heap)

    def _push_heap(self, b: _Band, t: _Tenant) -> None:
        heapq.heappush(b.heap, (t.counter, next(self._tiebreak), t.version, t))

    def _min_counter(self, b: _Band) -> float | None:
        """The smallest counter among the band's backlogged tenants."""
        while b.heap:
            _, _, version, t = b.heap[0]
            if version == t.version and b.tenants.get(t.name) is t:
                return t.counter
            heapq.heappop(b.heap)
        return None

    def _clean_deadlines(self) -> None:
        while self._deadlines and self._deadlines[0][1] not in self._entries:
            heapq.heappop(self._deadlines)

    def _compact_deadlines(self) -> None:
        """Rebuild the deadline heap once stale items (of entries gone) outnumber live
        ones: amortised O(1) per removal, and memory stays proportional to what waits."""
        if len(self._deadlines) - self._live_deadlines > self._live_deadlines + 64:
            self._deadlines = [d for d in self._deadlines if d[1] in self._entries]
            heapq.heapify(self._deadlines)

    def _end_window_if_idle(self) -> None:
        if not self._entries:
            self._win_start, self._win_tokens = None, 0

    def _count_shed(self, reason: str) -> None:
        self._shed[reason] = self._shed.get(reason, 0) + 1


def _secs(s: float | None) -> str:
    if s is None:
        return "unknown"
    if math.isinf(s):
        return "unbounded"
    return f"{s:.2f}s"
