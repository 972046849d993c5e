"""Which worker holds which KV blocks: the router's prefix index.

A request's prompt hashes to a chain of block keys (:mod:`kvpool.hashing`); since block
``i``'s key depends on every block before it, a worker that holds key ``i`` holds that whole
prefix, and the router wants, per worker, the length of the longest leading run it holds.

Layout, chosen for memory (tens of millions of entries), for a single fast walk per request
and so that no call on the event loop does work in proportion to the index's size:

* every worker owns one bit; the block table maps a block key to the OR of its holders'
  bits, so :meth:`BlockIndex.match` is one dict lookup and a few integer operations per
  block and can stop at the first block no still-matching worker holds. A key with a single
  holder stores that worker's own ``bit`` object, so it costs no integer of its own;
* the table is split by key over about four thousand dicts (shards): a CPython dict grows, and
  sheds the slots that deletions leave, by rebuilding itself at once, which for one dict of
  tens of millions of keys is a pause of seconds; a shard rebuilds in a millisecond or two;
* every worker keeps a log of its keys (``array('Q')``: 8 bytes a key, no object per key,
  nothing for the garbage collector to walk), appended on store and left as is on remove:
  whether the worker holds a key is its bit in the table, and the log only says which keys
  to visit when the worker's entries are dropped. A log with more dead entries than live
  ones is compacted a slice at a time, paid for by later stores (a spare bit marks the keys
  already copied, so the new log has each key once);
* clearing or removing a worker costs O(1): the worker gets a fresh bit and its old bit is
  *retired* with its log. Every answer leaves the old bit out at once (lookups keep only
  registered workers' bits), and :meth:`BlockIndex.sweep` takes it off the table's keys
  later, a bounded slice per call; the bit goes back to the free list only once swept, so a
  new worker never inherits stale entries;
* speculative entries (what the router *expects* a worker to hold because it routed a
  request there) set the worker's bit in the same table, so the walk reads one table. Which
  of a worker's bits are guesses, and for how long, is in two ordered dicts:

  - ``held``: key -> (requests holding it, deadline, episode). A request that routes its
    chain there (:meth:`BlockIndex.hold`) holds each key until it sees its first token,
    ends or fails (:meth:`BlockIndex.release`), however long it queues at the worker: the
    time from routing to the worker's ``BlockStored`` is that queue, unbounded under load.
    Several requests sharing a prefix each count; a failed one takes back only the keys
    nobody else holds. The deadline, ``hold_max`` after the key's last hold, is a safety
    net for a request whose end never comes (a lost peer message): not the lifetime;
  - ``spec``: key -> expiry, the credit a key keeps after its last holder saw its first
    token (``speculative_ttl``: the worker's event may lag the first token a little), or
    that an unowned guess gets (:meth:`BlockIndex.speculate`; an untracked worker's
    entries, ``approx_ttl``). A worker's TTL is fixed, so insertion order (with refreshes
    moved to the end) is also expiry order and LRU order.

  A key may be in both (a credit and live holders); it stays a guess while it is in
  either. Expiry, the holds' deadline and capacity eviction all pop from the fronts,
  amortised, with no background thread.

Confirmed and speculative entries of one worker never overlap (which is what lets them
share a bit): a store confirms (drops the guess and its holds), a speculate or hold skips
keys already confirmed. Pure data structure: no I/O, no locks (the router calls it from its
event loop), time from an injectable clock.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

from .blocks import (
    _COMPACT_SLACK,
    _COMPACT_WORK,
    _FLOAT_BYTES,
    _HELD_BYTES,
    _INT_BYTES,
    _SHARDS,
    Hold,
    _Compaction,
    _on_gpu,
    _Retired,
    _Worker,
)
from .guesses import Guesses
from .upkeep import Upkeep

__all__ = ["BlockIndex", "Hold"]

logger = logging.getLogger(__name__)


class BlockIndex(Guesses, Upkeep):
    """Block key -> workers holding it, confirmed by KV events or speculated at routing time.

    A *tracked* worker publishes KV events; its speculative entries only bridge the time
    between routing and the worker's own ``BlockStored``: while the requests that routed
    them wait for their first token (:meth:`hold`), then ``speculative_ttl`` more for the
    event to arrive. An *untracked* worker publishes nothing, so speculation is all there
    is: entries live while held, then ``approx_ttl`` (refreshed when routed again), and at
    most ``approx_capacity_blocks`` of them, least recently routed evicted first, as the
    worker's own cache would. ``hold_max``: a key that no request has held anew for that
    long is taken to be held by lost requests only, and dropped.

    Block keys are unsigned 64-bit integers, as KV events carry them. Methods taking a
    ``worker_id`` raise :class:`KeyError` for an unregistered worker: events for a worker
    the router does not know are a caller bug, not something to index.

    Clearing or removing a worker answers at once but leaves work for :meth:`sweep`, which
    the caller runs in slices, between other work, until it returns 0.
    """

    def __init__(
        self,
        *,
        speculative_ttl: float = 2.0,
        approx_ttl: float = 120.0,
        approx_capacity_blocks: int = 50_000,
        hold_max: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(speculative_ttl, approx_ttl, approx_capacity_blocks, hold_max) <= 0:
            raise ValueError("TTLs, hold_max and approx_capacity_blocks must be positive")
        self.speculative_ttl = speculative_ttl
        self.hold_max = hold_max
        self._holds = 0  # holds taken: each one's seq
        self.approx_ttl = approx_ttl
        self.approx_capacity_blocks = approx_capacity_blocks
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._by_bit: dict[int, str] = {}
        # Masks that stand for one holder (and the compaction's own), to one shared object:
        # a key left with a lone holder gets that object instead of an integer of its own.
        self._canon: dict[int, int] = {}
        self._free_positions: list[int] = []  # heap: reuse low bits so masks stay small ints
        self._next_position = 0
        self._all_bits = 0  # registered workers' bits; retired and marking bits are not
        self._shards: list[dict[int, int]] = [{} for _ in range(_SHARDS)]
        self._entries = 0
        self._next_expiry = math.inf  # no speculative entry expires before this
        self._retired: deque[_Retired] = deque()
        self._pending = 0  # keys the retired parts still have
        self._compaction: _Compaction | None = None
        self._compact_queue: deque[_Worker] = deque()
        # Per index, so that a test can make compaction frequent and slow to finish.
        self._compact_slack = _COMPACT_SLACK
        self._compact_work = _COMPACT_WORK

    # ---- workers ----

    def add_worker(
        self, worker_id: str, *, tracked: bool = True, approx_capacity_blocks: int | None = None
    ) -> None:
        """Register a worker; ``approx_capacity_blocks`` overrides the index default for an
        untracked one whose real cache size is known."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already registered")
        if approx_capacity_blocks is not None and approx_capacity_blocks <= 0:
            raise ValueError("approx_capacity_blocks must be positive")
        if tracked:
            ttl, capacity = self.speculative_ttl, None
        else:
            ttl = self.approx_ttl
            capacity = approx_capacity_blocks or self.approx_capacity_blocks
        w = _Worker(worker_id, 0, tracked, ttl, capacity)
        self._workers[worker_id] = w
        self._give_bit(w)
        position = w.bit.bit_length() - 1
        logger.info("indexing worker %s (bit %d, tracked=%s)", worker_id, position, tracked)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held. O(1): its bit goes to a later worker
        once :meth:`sweep` has taken it off every key."""
        w = self._get(worker_id)
        self._retire(w)
        del self._workers[worker_id]
        logger.info("stopped indexing worker %s", worker_id)

    def clear_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker, speculative too, keeping it registered: its cache was
        emptied (AllBlocksCleared) or events were lost and what we knew may be wrong.

        O(1): the worker goes on under a fresh bit, and the old one is left to
        :meth:`sweep`."""
        w = self._get(worker_id)
        self._retire(w)
        self._give_bit(w)
        logger.debug("cleared worker %s", worker_id)

    def workers(self) -> list[str]:
        return list(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    # ---- confirmed entries (KV events) ----

    def store(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker now holds these blocks; a speculative entry for one is confirmed."""
        w = self._get(worker_id)
        job = self._compaction
        if job is not None and job.worker is w:
            added = self._store_compacting(w, job, hashes)
        else:
            bit, spec, held, shards, append = w.bit, w.spec, w.held, self._shards, w.log.append
            n = _SHARDS
            added = confirmed = guessed = 0
            late = w.late
            h = None
            try:
                for h in hashes:
                    table = shards[h % n]
                    m = table.get(h)
                    if m is None:
                        append(h)  # first: a key that is no unsigned 64-bit int changes nothing
                        table[h] = bit
                        if late and h in late:
                            confirmed += 1
                            del late[h]
                    elif not m & bit:
                        append(h)
                        table[h] = m | bit
                        if late and h in late:
                            confirmed += 1
                            del late[h]
                    elif (spec and h in spec) or (held and h in held):
                        # a guess until now: the bit stays, confirmed; its holds end here
                        append(h)
                        spec.pop(h, None)
                        held.pop(h, None)
                        confirmed += 1
                        guessed += 1
                    else:
                        continue
                    added += 1
            except OverflowError:
                raise ValueError(f"block key {h!r} is not an unsigned 64-bit integer") from None
            finally:
                w.count += added
                w.confirmed += confirmed
                w.guesses -= guessed
                self._entries += added
        w.stored += added
        if added:
            if not w.queued and len(w.log) > 2 * w.count + self._compact_slack:
                w.queued = True
                self._compact_queue.append(w)
            if self._compaction is not None or self._compact_queue:
                self._compact(added * self._compact_work)

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker evicted these blocks; a block it does not hold is ignored."""
        w = self._get(worker_id)
        bit, spec, held, shards, canon = w.bit, w.spec, w.held, self._shards, self._canon
        n = _SHARDS
        removed = 0
        for h in hashes:
            table = shards[h % n]
            m = table.get(h)
            if m is not None and m & bit:
                if (spec and h in spec) or (held and h in held):
                    spec.pop(h, None)
                    held.pop(h, None)
                    w.guesses -= 1
                else:
                    removed += 1  # the key stays in the log: compaction drops it there
                rest = m ^ bit
                if rest:
                    table[h] = canon.get(rest, rest)
                else:
                    del table[h]
        w.count -= removed
        self._entries -= removed

    def apply(self, worker_id: str, batch: EventBatch) -> int:
        """Apply a batch's events in order; return how many acted on the index (events for
        other mediums and of unknown types are skipped: they say nothing about GPU blocks)."""
        self._get(worker_id)  # an unknown worker fails even on an empty batch
        applied = 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                if _on_gpu(event.medium):
                    self.store(worker_id, event.block_hashes)
                    applied += 1
            elif isinstance(event, BlockRemoved):
                if _on_gpu(event.medium):
                    self.remove(worker_id, event.block_hashes)
                    applied += 1
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(worker_id)
                applied += 1
        return applied

    # ---- speculative entries (routing decisions) ----

    # ---- deferred work ----

    def sweep(self, max_keys: int = 1_000) -> int:
        """Take retired bits (of cleared and removed workers) off at most ``max_keys`` keys;
        return how many keys are left to visit (0: nothing pending).

        Answers do not wait for this: they leave retired bits out already. What waits is
        memory (a retired worker's log, and its keys no one else holds) and the bit's reuse.
        ``max_keys`` bounds the call's time: a key costs 0.4-1 us, mostly cache misses, so
        the default is about a millisecond, well inside the request path's 5 ms budget on
        a slower or busier core. The caller runs it in slices, yielding to other work
        between them, until it returns 0."""
        budget = max_keys
        retired = self._retired
        while budget > 0 and retired:
            job = retired[0]
            budget -= self._sweep_some(job, budget)
            if not job.parts:
                retired.popleft()
                for position in job.positions:
                    heapq.heappush(self._free_positions, position)
        return self._pending

    def pending_sweep(self) -> int:
        """Keys :meth:`sweep` has still to visit (a retired log's dead and repeated entries
        count too)."""
        return self._pending

    # ---- queries ----

    def match(self, hashes: Iterable[int]) -> dict[str, int]:
        """Per worker holding at least the first block: how many leading blocks it holds."""
        self._expire(self._clock())
        alive = self._all_bits  # workers that held every block so far
        result: dict[str, int] = {}
        if not alive:
            return result
        shards, canon, n = self._shards, self._canon, _SHARDS
        depth = 0
        for h in hashes:
            try:  # a subscript is quicker than get(), and a miss ends the walk anyway
                m = shards[h % n][h]
            except KeyError:
                m = 0
            # Deep in a chain one worker is usually left, and a key it holds alone has its
            # very bit object as the mask: no arithmetic at all.
            if m is not alive:
                held = m & alive
                if held != alive:
                    if depth:
                        self._record(alive ^ held, depth, result)
                    if not held:
                        return result
                    alive = canon.get(held, held)
            depth += 1
        if depth:
            self._record(alive, depth, result)
        return result

    def num_blocks(self, worker_id: str) -> int:
        """Confirmed blocks the worker holds."""
        return self._get(worker_id).count

    def confirmations(self, worker_id: str) -> tuple[int, int, int]:
        """(speculated, confirmed, stored): blocks speculated on the worker since it was
        added (the router sent it their prompt; a guess made again after it ran out is not
        counted twice), those of them its events then stored, and the blocks its events
        stored in all. A worker that hashes as the router does confirms nearly all it
        computes; one that does not, none, while it stores blocks all the same."""
        w = self._get(worker_id)
        return w.speculated, w.confirmed, w.stored

    def num_speculative(self, worker_id: str) -> int:
        """Unexpired speculative blocks of the worker, held or not (never counting a
        confirmed one)."""
        w = self._get(worker_id)
        self._expire(self._clock())
        return w.guesses

    def num_held(self, worker_id: str) -> int:
        """Speculative blocks of the worker that requests still hold."""
        w = self._get(worker_id)
        self._expire(self._clock())
        return len(w.held)

    def num_entries(self) -> int:
        """Confirmed (block, worker) entries in all."""
        return self._entries

    def __len__(self) -> int:
        return self._entries

    def summary(self) -> dict[str, Any]:
        """A JSON-ready picture for a debug endpoint. ``distinct_blocks`` counts the table's
        keys: confirmed or speculative, and those whose holders were all cleared and that
        await a sweep (``pending_sweep`` says how many keys that is still to visit);
        ``held_entries``: the speculative ones requests in flight hold (a worker's
        ``held``, when it has any); ``approx_bytes`` is an estimate."""
        self._expire(self._clock())
        keys = sum(len(t) for t in self._shards)
        size = sum(sys.getsizeof(t) for t in self._shards)
        # Keys, and masks of keys with several holders (a lone holder's is its own bit).
        size += (keys + max(0, min(keys, self._entries - keys))) * _INT_BYTES
        size += self._pending * 8  # retired logs
        compaction = self._compaction
        if compaction is not None and compaction.src is not None:
            size += sys.getsizeof(compaction.src)
        workers: dict[str, dict[str, Any]] = {}
        for wid, w in self._workers.items():
            size += sys.getsizeof(w.log) + sys.getsizeof(w.spec) + len(w.spec) * _FLOAT_BYTES
            size += sys.getsizeof(w.held) + len(w.held) * _HELD_BYTES
            workers[wid] = {"tracked": w.tracked, "blocks": w.count, "speculative": w.guesses}
            if w.held:
                workers[wid]["held"] = len(w.held)
        return {
            "workers": workers,
            "entries": self._entries,
            "speculative_entries": sum(w.guesses for w in self._workers.values()),
            "held_entries": sum(len(w.held) for w in self._workers.values()),
            "distinct_blocks": keys,
            "pending_sweep": self._pending,
            "approx_bytes": size,
        }

    # ---- internals ----

    def _get(self, worker_id: str) -> _Worker:
        try:
            return self._workers[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def _record(self, bits: int, depth: int, result: dict[str, int]) -> None:
        by_bit = self._by_bit
        while bits:
            low = bits & -bits
            result[by_bit[low]] = depth
            bits ^= low

    def _take_position(self) -> int:
        if self._free_positions:
            return heapq.heappop(self._free_positions)
        self._next_position += 1
        return self._next_position - 1

    def _give_bit(self, w: _Worker) -> None:
        w.bit = 1 << self._take_position()
        self._by_bit[w.bit] = w.id
        self._canon[w.bit] = w.bit
        self._all_bits |= w.bit

    def _unset_bit(self, h: int, bit: int) -> None:
        """A speculative entry ends: take the worker's bit off the key."""
        table = self._shards[h % _SHARDS]
        rest = table[h] & ~bit
        if rest:
            table[h] = self._canon.get(rest, rest)
        else:
            del table[h]
