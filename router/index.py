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
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

from kvpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["BlockIndex", "Hold"]

logger = logging.getLogger(__name__)

# Rough CPython sizes for the debug figure: a 64-bit block key (3 digits) and a float.
_INT_BYTES = sys.getsizeof(1 << 63)
_FLOAT_BYTES = sys.getsizeof(0.0)
# ... and a held key's (count, deadline, episode)
_HELD_BYTES = sys.getsizeof((1, 0.0, 1)) + _FLOAT_BYTES

# Shards of the block table: a prime, so that keys of any pattern spread evenly. At 50
# million keys a shard holds ~12k, whose rebuild takes ~1.5 ms (a store may meet two or
# three). More shards would shorten that but slow every lookup: a chain's keys, stored
# together, sit together in one dict's entries, and the more shards, the more of them are
# cache misses.
_SHARDS = 4093
# A log is compacted once it is longer than twice its worker's blocks plus this ...
_COMPACT_SLACK = 4096
# ... by this many log entries of work per key any store appends: churn leaves at most one
# dead entry per append, and a compaction costs about 1.5 entries of work per log entry.
_COMPACT_WORK = 4


def _on_gpu(medium: str | None) -> bool:
    """Only blocks in GPU memory save prefill; an offloaded (CPU, disk) copy is not a hit."""
    return medium is None or medium.upper() == "GPU"


#: speculative keys a tracked worker remembers after they expire unconfirmed (see _Worker)
_LATE_KEYS = 2048


class _Worker:
    __slots__ = (
        "bit",
        "capacity",
        "confirmed",
        "count",
        "guesses",
        "held",
        "id",
        "late",
        "log",
        "queued",
        "spec",
        "speculated",
        "stored",
        "tracked",
        "ttl",
    )

    def __init__(
        self, worker_id: str, bit: int, tracked: bool, ttl: float, capacity: int | None
    ) -> None:
        self.id = worker_id
        self.bit = bit
        self.tracked = tracked
        self.ttl = ttl
        self.capacity = capacity  # None: speculative entries bounded by their TTL alone
        self.count = 0  # confirmed blocks held (the log also has dead and repeated keys)
        # blocks speculated here since it was added, how many of them its events then
        # stored (confirmed: with equal hashing, nearly all; with another hash seed, none),
        # and the blocks its events stored in all. ``late``: the last speculative keys that
        # expired unconfirmed, so that a store after a long queue still confirms its guess,
        # and a guess made again (a prefix the worker holds from before the index knew it:
        # a hit stores nothing) is not counted again
        self.speculated = 0
        self.confirmed = 0
        self.stored = 0
        self.late: dict[int, None] = {}
        self.log = array("Q")
        self.queued = False  # waiting for, or under, compaction
        # speculative keys: credited until an expiry, and held by requests (see the module)
        self.spec: OrderedDict[int, float] = OrderedDict()
        self.held: OrderedDict[int, tuple[int, float, int]] = OrderedDict()
        self.guesses = 0  # keys in spec or held (the bits they set), each counted once


class Hold:
    """One request's claim on the speculative entries of its chain on one worker, from
    :meth:`BlockIndex.hold` to :meth:`BlockIndex.release` (its first token, its end, or its
    failure). ``keys``: those it holds (the chain's keys that were not confirmed), in chain
    order; ``seq``: when it was taken, so that a release touches only the holds of the
    episode it joined (a key confirmed, evicted and held again since is someone else's).
    ``chain``: the caller's own tag (the feed's id of it on the peer link)."""

    __slots__ = ("chain", "done", "keys", "seq", "worker")

    def __init__(self, worker: str, keys: list[int], seq: int) -> None:
        self.worker = worker
        self.keys = keys
        self.seq = seq
        self.done = False
        self.chain: int | None = None

    def __repr__(self) -> str:
        state = "released" if self.done else "held"
        return f"Hold({self.worker!r}, {len(self.keys)} keys, {state})"


class _Retired:
    """What clearing or removing a worker left for :meth:`BlockIndex.sweep`: bits to take
    off the keys of its parts (its log, its speculative keys), and the bit positions that
    are free once that is done."""

    __slots__ = ("clear", "parts", "positions")

    def __init__(
        self, clear: int, positions: list[int], parts: list[tuple[Iterator[int], int]]
    ) -> None:
        self.clear = clear
        self.positions = positions
        self.parts = deque([it, left] for it, left in parts)


class _Compaction:
    """One worker's log being rewritten without dead or repeated keys.

    Phase 1 walks the old log (``src``) and copies each key the worker holds to the new log
    (``worker.log``) once, setting ``mark`` on it in the table; a store meanwhile appends
    only keys without the mark, and marks them too. Phase 2 walks the new log up to
    ``end`` and takes the mark off again. ``mark`` is a bit no worker owns, so no answer
    sees it."""

    __slots__ = ("both", "end", "mark", "pos", "src", "worker")

    def __init__(self, worker: _Worker, mark: int) -> None:
        self.worker = worker
        self.mark = mark
        self.both = worker.bit | mark  # one shared object for keys the worker holds alone
        self.src: array[int] | None = worker.log
        self.pos = 0
        self.end = 0
        worker.log = array("Q")


class BlockIndex:
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

    def speculate(self, worker_id: str, hashes: Sequence[int]) -> list[int]:
        """Count the chain as held by the worker for a while, with no request owning the
        guess: ``speculative_ttl`` unless the worker's events confirm it first (tracked),
        ``approx_ttl`` (untracked). What a replica of the release before holds came sends
        (:mod:`.peers`); the router's own requests :meth:`hold` their chains instead.

        Returns the keys this call added (not those already confirmed or already
        speculative, which are only refreshed): what :meth:`withdraw` takes back."""
        w = self._get(worker_id)
        now = self._clock()
        self._expire(now)
        expiry = now + w.ttl
        bit, spec, held, shards = w.bit, w.spec, w.held, self._shards
        n = _SHARDS
        added: list[int] = []
        # Back to front, so the chain's head is the most recently used: like vLLM freeing a
        # request's blocks tail first, eviction then shortens the prefix instead of killing it.
        for h in reversed(hashes):
            table = shards[h % n]
            m = table.get(h)
            if m is None:
                table[h] = bit
            elif not m & bit:
                table[h] = m | bit
            elif h in spec:  # a guess already: refreshed
                spec.move_to_end(h)
                spec[h] = expiry
                continue
            elif held and h in held:  # held: credited as well, for after its holds
                spec[h] = expiry
                continue
            else:
                continue  # confirmed
            added.append(h)
            spec[h] = expiry
        w.guesses += len(added)
        late = w.late
        w.speculated += len(added) - (sum(1 for h in added if h in late) if late else 0)
        if w.capacity is not None and w.guesses > w.capacity:
            self._evict(w)
        if expiry < self._next_expiry:
            self._next_expiry = expiry
        added.reverse()  # in chain order
        return added

    def hold(self, worker_id: str, hashes: Sequence[int]) -> Hold:
        """The router sends this chain to the worker for a request: count it as held there
        until the request is done with it (:meth:`release`: its first token, its end, its
        failure) or the worker's events confirm it, however long it queues there first.

        Every key of the chain not confirmed is held, whether this call made it a guess or
        another request (or an unowned guess) did: a key stays a guess while any request
        holds it. O(len(hashes)), whatever the number of requests in flight."""
        w = self._get(worker_id)
        now = self._clock()
        self._expire(now)
        self._holds += 1
        seq = self._holds
        deadline = now + self.hold_max
        bit, spec, held, shards = w.bit, w.spec, w.held, self._shards
        n = _SHARDS
        keys: list[int] = []
        fresh = 0
        late = w.late
        for h in reversed(hashes):  # back to front: the chain's head the last to evict
            table = shards[h % n]
            m = table.get(h)
            if m is None or not m & bit:
                table[h] = bit if m is None else m | bit
                held[h] = (1, deadline, seq)
                fresh += 1
                if not (late and h in late):
                    w.speculated += 1
            else:
                c = held.get(h)
                if c is not None:  # held by others too
                    held[h] = (c[0] + 1, deadline, c[2])
                    held.move_to_end(h)
                elif h in spec:  # an unowned guess, or a credit after its holds: held
                    held[h] = (1, deadline, seq)
                else:
                    continue  # confirmed: the worker's own word, nothing to hold
            keys.append(h)
        w.guesses += fresh
        if w.capacity is not None and w.guesses > w.capacity:
            self._evict(w)
        if deadline < self._next_expiry:
            self._next_expiry = deadline
        keys.reverse()  # in chain order
        return Hold(worker_id, keys, seq)

    def release(self, hold: Hold, *, failed: bool = False) -> None:
        """The request of ``hold`` is done waiting for the worker; once only (later calls,
        and a hold on a worker since removed, change nothing).

        Done (``failed`` false: its first token, or its end): the worker has computed the
        blocks and its ``BlockStored`` is on its way. Each key keeps ``speculative_ttl`` of
        credit (``approx_ttl`` for an untracked worker) beyond its holds, so that the event
        finds the guess to confirm and no request meanwhile finds the prefix missing.

        Failed (a 429, a refused connection, no first token in time: the worker computed
        nothing for it): each key that no other request holds, and that no earlier
        request's credit keeps, goes at once; the others stay, theirs."""
        if hold.done:
            return
        hold.done = True
        w = self._workers.get(hold.worker)
        if w is None or not hold.keys:
            return
        now = self._clock()
        self._expire(now)  # a key whose holds ran out meanwhile is no longer this hold's
        spec, held, seq = w.spec, w.held, hold.seq
        expiry = now + w.ttl
        for h in hold.keys:
            c = held.get(h)
            if c is None or c[2] > seq:  # confirmed, evicted or expired since (and held anew)
                continue
            left = c[0] - 1
            if left:
                held[h] = (left, c[1], c[2])
            else:
                del held[h]
            if not failed:
                spec[h] = expiry
                spec.move_to_end(h)
            elif not left and h not in spec:
                self._unset_bit(h, w.bit)
                w.guesses -= 1
                if h not in w.late:
                    w.speculated -= 1  # never sent after all
        if not failed and expiry < self._next_expiry:
            self._next_expiry = expiry

    def withdraw(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Take back unowned guesses of the worker (keys :meth:`speculate` returned, for a
        request that failed before the worker computed anything). Otherwise an untracked
        worker would keep cache credit it never earned for ``approx_ttl``. Confirmed
        entries are the worker's own word and stay, and so do keys a request holds.

        Not an undo: entries the speculation evicted for capacity stay evicted. A request's
        own chain is taken back by ``release(hold, failed=True)``, which knows which keys
        are its alone."""
        w = self._get(worker_id)
        spec, held = w.spec, w.held
        if not spec:
            return
        bit = w.bit
        for h in hashes:
            if h in spec:
                del spec[h]
                if held and h in held:
                    continue
                self._unset_bit(h, bit)
                w.guesses -= 1
                if h not in w.late:
                    w.speculated -= 1  # never sent after all

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
