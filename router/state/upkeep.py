"""The prefix index's deferred work (:class:`.index.BlockIndex`): retired bits swept off
the table, key logs compacted, speculative entries expired and evicted, each a bounded
slice at a time."""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice

from .blocks import _LATE_KEYS, _SHARDS, _Compaction, _Retired, _Worker

__all__ = ["Upkeep"]


class Upkeep:
    """:class:`.index.BlockIndex`'s private methods for deferred work."""

    def _retire(self, w: _Worker) -> None:
        """Take the worker's bit out of every answer and hand its keys to :meth:`sweep`:
        O(1), whatever the worker held. The worker is left without a bit."""
        clear, positions = w.bit, [w.bit.bit_length() - 1]
        parts: list[tuple[Iterator[int], int]] = []
        job = self._compaction
        if job is not None and job.worker is w:  # dropped; its marks are swept with the bit
            clear |= job.mark
            positions.append(job.mark.bit_length() - 1)
            if job.src is not None and job.pos < len(job.src):
                rest = memoryview(job.src)[job.pos :]
                parts.append((iter(rest), len(rest)))
            self._end_compaction(job)
        if w.log:
            parts.append((iter(memoryview(w.log)), len(w.log)))
        for guesses in (w.spec, w.held):  # frozen from now on: the worker gets new ones
            if guesses:
                parts.append((iter(guesses), len(guesses)))
        self._entries -= w.count
        w.count = 0
        w.log = array("Q")
        w.spec = OrderedDict()
        w.held = OrderedDict()
        w.guesses = 0
        del self._by_bit[w.bit]
        del self._canon[w.bit]
        self._all_bits &= ~w.bit
        w.bit = 0
        if parts:
            self._retired.append(_Retired(clear, positions, parts))
            self._pending += sum(left for _, left in parts)
        else:
            for position in positions:
                heapq.heappush(self._free_positions, position)

    def _sweep_some(self, job: _Retired, budget: int) -> int:
        """Up to ``budget`` keys of a retired job; returns how many it visited."""
        clear, keep, shards, canon, n = job.clear, ~job.clear, self._shards, self._canon, _SHARDS
        done = 0
        while job.parts and done < budget:
            part = job.parts[0]
            keys, left = part
            take = min(left, budget - done)
            for h in islice(keys, take):
                table = shards[h % n]
                m = table.get(h)
                if m is not None and m & clear:
                    rest = m & keep
                    if rest:
                        table[h] = canon.get(rest, rest)
                    else:
                        del table[h]
            done += take
            if take == left:
                job.parts.popleft()
            else:
                part[1] = left - take
        self._pending -= done
        return done

    def _store_compacting(self, w: _Worker, job: _Compaction, hashes: Iterable[int]) -> int:
        """:meth:`store` for the worker whose log is being compacted: a key that has the
        mark is in the new log already (if only as a dead entry) and is not appended again;
        in phase 1 a key appended gets the mark, so that the walk of the old log does not
        copy it a second time."""
        bit, mark, spec, shards, append = w.bit, job.mark, w.spec, self._shards, w.log.append
        held = w.held
        new = job.both if job.src is not None else bit  # what an appended key gets
        canon, n = self._canon, _SHARDS
        added = 0
        h = None
        try:
            for h in hashes:
                table = shards[h % n]
                m = table.get(h, 0)
                if m & bit:
                    if not ((spec and h in spec) or (held and h in held)):
                        continue
                    if not m & mark:  # a guess until now: its key may not be in the log
                        append(h)
                        table[h] = canon.get(m | (new ^ bit), m | (new ^ bit))
                    spec.pop(h, None)
                    held.pop(h, None)
                    w.guesses -= 1
                    w.confirmed += 1
                elif m & mark:
                    table[h] = canon.get(m | bit, m | bit)
                else:
                    append(h)
                    table[h] = canon.get(m | new, m | new)
                added += 1
        except OverflowError:
            raise ValueError(f"block key {h!r} is not an unsigned 64-bit integer") from None
        finally:
            w.count += added
            self._entries += added
        return added

    def _compact(self, budget: int) -> None:
        """Up to ``budget`` log entries of compaction work, starting queued jobs as needed."""
        while budget > 0:
            job = self._compaction
            if job is None:
                job = self._start_compaction()
                if job is None:
                    return
            budget -= self._compact_some(job, budget)

    def _start_compaction(self) -> _Compaction | None:
        while self._compact_queue:
            w = self._compact_queue.popleft()
            if self._workers.get(w.id) is not w or len(w.log) <= 2 * w.count + self._compact_slack:
                w.queued = False  # removed, or cleared (a fresh log), since it was queued
                continue
            job = _Compaction(w, 1 << self._take_position())
            self._canon[job.mark] = job.mark
            self._canon[job.both] = job.both
            self._compaction = job
            return job
        return None

    def _compact_some(self, job: _Compaction, budget: int) -> int:
        """Up to ``budget`` entries of one compaction; returns how many it did (at least 1)."""
        w, shards, canon, n = job.worker, self._shards, self._canon, _SHARDS
        bit, mark, both, log = w.bit, job.mark, job.both, w.log
        src = job.src
        if src is not None:  # phase 1: copy each key the worker holds, once
            end = min(len(src), job.pos + budget)
            append = log.append
            for h in src[job.pos : end]:
                table = shards[h % n]
                m = table.get(h)
                if m is not None and m & bit and not m & mark:
                    table[h] = both if m is bit else canon.get(m | mark, m | mark)
                    append(h)
            done, job.pos = end - job.pos, end
            if end == len(src):
                job.src, job.pos, job.end = None, 0, len(log)
        else:  # phase 2: take the mark off again
            end = min(job.end, job.pos + budget)
            for h in log[job.pos : end]:
                table = shards[h % n]
                m = table.get(h)
                if m is not None and m & mark:
                    rest = m ^ mark
                    if rest:
                        table[h] = canon.get(rest, rest)
                    else:
                        del table[h]
            done, job.pos = end - job.pos, end
            if end == job.end:
                self._end_compaction(job)
                heapq.heappush(self._free_positions, mark.bit_length() - 1)
        return max(done, 1)

    def _end_compaction(self, job: _Compaction) -> None:
        """Forget the job; its mark's position is for the caller to free, once no key has
        the mark."""
        del self._canon[job.mark]
        del self._canon[job.both]
        job.worker.queued = False
        self._compaction = None

    def _evict(self, w: _Worker) -> None:
        """An untracked worker over its capacity: drop its least recently routed guesses,
        unheld first (a held key is a block a request in flight is using: the worker's own
        cache keeps it too), until it fits."""
        spec, held, bit, capacity = w.spec, w.held, w.bit, w.capacity
        assert capacity is not None
        while w.guesses > capacity and spec:
            h = spec.popitem(last=False)[0]
            if not (held and h in held):
                self._unset_bit(h, bit)
                w.guesses -= 1
        while w.guesses > capacity and held:
            self._unset_bit(held.popitem(last=False)[0], bit)
            w.guesses -= 1

    def _expire(self, now: float) -> None:
        """Pop speculative entries whose time is up (expiry <= now), oldest first: credits
        that ran out, and holds past their deadline (``hold_max`` after the key was last
        held: its requests are lost). Each worker's entries are in expiry order, so this
        stops at the first live one of each."""
        if now < self._next_expiry:
            return
        next_expiry = math.inf
        for w in self._workers.values():
            spec, held = w.spec, w.held
            while spec:
                h = next(iter(spec))
                expiry = spec[h]
                if expiry > now:
                    next_expiry = min(next_expiry, expiry)
                    break
                del spec[h]
                if not (held and h in held):
                    self._drop_guess(w, h)
            while held:
                h = next(iter(held))
                expiry = held[h][1]
                if expiry > now:
                    next_expiry = min(next_expiry, expiry)
                    break
                del held[h]
                if h not in spec:
                    self._drop_guess(w, h)
        self._next_expiry = next_expiry

    def _drop_guess(self, w: _Worker, h: int) -> None:
        """A guess ran out unconfirmed: off the table, remembered a while (tracked)."""
        self._unset_bit(h, w.bit)
        w.guesses -= 1
        if w.tracked:
            late = w.late
            late[h] = None
            if len(late) > _LATE_KEYS:
                del late[next(iter(late))]
