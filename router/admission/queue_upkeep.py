"""The fair queue's internals (:class:`.flow.FairQueue`): room made by displacing, entries
unlinked, each band's heap of tenants and the deadlines kept tidy."""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict

from .entries import _SHRINK_FROM, ENTRY_OVERHEAD_BYTES, Band, Entry, _Band, _Tenant

__all__ = ["QueueUpkeep"]

log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".flow")


class QueueUpkeep:
    """:class:`.flow.FairQueue`'s private methods."""

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
