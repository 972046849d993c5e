"""Which worker holds which KV blocks: the router's prefix index.

A request's prompt hashes to a chain of block keys (:mod:`kvpool.hashing`); since block
``i``'s key depends on every block before it, a worker that holds key ``i`` holds that whole
prefix, and the router wants, per worker, the length of the longest leading run it holds.

Layout, chosen for memory (millions of entries) and for a single fast walk per request:

* every worker owns one bit; ``_masks`` maps a block key to the OR of its holders' bits, so
  :meth:`BlockIndex.match` is one dict lookup and a few integer operations per block and can
  stop at the first block no still-matching worker holds;
* every worker keeps the set of its keys, so clearing or removing it costs its own size, not
  the index's, and the same key object is shared with ``_masks``;
* speculative entries (what the router *expects* a worker to hold because it just routed a
  request there) live apart, per worker in an ``OrderedDict`` key -> expiry. A worker's TTL
  is fixed, so insertion order (with refreshes moved to the end) is also expiry order and
  LRU order: expiry and capacity eviction both pop from the front, amortised, with no
  background thread. ``_spec_masks`` mirrors them as key -> bits for the walk.

Confirmed and speculative entries of one worker never overlap: a store confirms (drops the
guess), a speculate skips keys already confirmed. Pure data structure: no I/O, no locks
(the router calls it from its event loop), time from an injectable clock.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvpool.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

__all__ = ["BlockIndex"]

logger = logging.getLogger(__name__)

# Rough CPython sizes for the debug figure: a 64-bit block key (3 digits) and a float.
_INT_BYTES = sys.getsizeof(1 << 63)
_FLOAT_BYTES = sys.getsizeof(0.0)


def _on_gpu(medium: str | None) -> bool:
    """Only blocks in GPU memory save prefill; an offloaded (CPU, disk) copy is not a hit."""
    return medium is None or medium.upper() == "GPU"


class _Worker:
    __slots__ = ("bit", "blocks", "capacity", "id", "spec", "tracked", "ttl")

    def __init__(
        self, worker_id: str, bit: int, tracked: bool, ttl: float, capacity: int | None
    ) -> None:
        self.id = worker_id
        self.bit = bit
        self.tracked = tracked
        self.ttl = ttl
        self.capacity = capacity  # None: speculative entries bounded by their TTL alone
        self.blocks: set[int] = set()
        self.spec: OrderedDict[int, float] = OrderedDict()


class BlockIndex:
    """Block key -> workers holding it, confirmed by KV events or speculated at routing time.

    A *tracked* worker publishes KV events; its speculative entries only bridge the moment
    between routing and the worker's own ``BlockStored`` (``speculative_ttl``). An
    *untracked* worker publishes nothing, so speculation is all there is: entries live
    ``approx_ttl`` (refreshed when routed again) and at most ``approx_capacity_blocks`` of
    them, least recently routed evicted first, as the worker's own cache would.

    Methods taking a ``worker_id`` raise :class:`KeyError` for an unregistered worker: events
    for a worker the router does not know are a caller bug, not something to index.
    """

    def __init__(
        self,
        *,
        speculative_ttl: float = 2.0,
        approx_ttl: float = 120.0,
        approx_capacity_blocks: int = 50_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speculative_ttl <= 0 or approx_ttl <= 0 or approx_capacity_blocks <= 0:
            raise ValueError("TTLs and approx_capacity_blocks must be positive")
        self.speculative_ttl = speculative_ttl
        self.approx_ttl = approx_ttl
        self.approx_capacity_blocks = approx_capacity_blocks
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._by_bit: dict[int, str] = {}
        self._free_positions: list[int] = []  # heap: reuse low bits so masks stay small ints
        self._next_position = 0
        self._all_bits = 0
        self._masks: dict[int, int] = {}
        self._spec_masks: dict[int, int] = {}
        self._entries = 0
        self._next_expiry = math.inf  # no speculative entry expires before this

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
        if self._free_positions:
            position = heapq.heappop(self._free_positions)
        else:
            position = self._next_position
            self._next_position += 1
        bit = 1 << position
        if tracked:
            ttl, capacity = self.speculative_ttl, None
        else:
            ttl = self.approx_ttl
            capacity = approx_capacity_blocks or self.approx_capacity_blocks
        self._workers[worker_id] = _Worker(worker_id, bit, tracked, ttl, capacity)
        self._by_bit[bit] = worker_id
        self._all_bits |= bit
        logger.info("indexing worker %s (bit %d, tracked=%s)", worker_id, position, tracked)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and everything it held; its bit may go to the next worker."""
        w = self._get(worker_id)
        self._drop_all(w)
        del self._workers[worker_id]
        del self._by_bit[w.bit]
        self._all_bits &= ~w.bit
        heapq.heappush(self._free_positions, w.bit.bit_length() - 1)
        logger.info("stopped indexing worker %s", worker_id)

    def clear_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker, speculative too, keeping it registered: its cache was
        emptied (AllBlocksCleared) or events were lost and what we knew may be wrong."""
        w = self._get(worker_id)
        self._drop_all(w)
        logger.debug("cleared worker %s", worker_id)

    def workers(self) -> list[str]:
        return list(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    # ---- confirmed entries (KV events) ----

    def store(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker now holds these blocks; a speculative entry for one is confirmed."""
        w = self._get(worker_id)
        bit, blocks, spec, masks = w.bit, w.blocks, w.spec, self._masks
        added = 0
        for h in hashes:
            if h in blocks:
                continue
            blocks.add(h)
            masks[h] = masks.get(h, 0) | bit
            added += 1
            if spec and h in spec:
                del spec[h]
                self._unset_spec_bit(h, bit)
        self._entries += added

    def remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker evicted these blocks; a block it does not hold is ignored."""
        w = self._get(worker_id)
        bit, blocks, spec, masks = w.bit, w.blocks, w.spec, self._masks
        for h in hashes:
            if h in blocks:
                blocks.remove(h)
                self._entries -= 1
                rest = masks[h] & ~bit
                if rest:
                    masks[h] = rest
                else:
                    del masks[h]
            elif h in spec:
                del spec[h]
                self._unset_spec_bit(h, bit)

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
        """The router just sent this chain to the worker: count it as held until the worker's
        events confirm it (tracked) or for ``approx_ttl`` (untracked).

        Returns the keys this call added (not those already confirmed or already
        speculative, which are only refreshed): what :meth:`withdraw` takes back if the
        request never reaches the worker's cache."""
        w = self._get(worker_id)
        now = self._clock()
        self._expire(now)
        expiry = now + w.ttl
        bit, blocks, spec, spec_masks = w.bit, w.blocks, w.spec, self._spec_masks
        added: list[int] = []
        # Back to front, so the chain's head is the most recently used: like vLLM freeing a
        # request's blocks tail first, eviction then shortens the prefix instead of killing it.
        for h in reversed(hashes):
            if h in blocks:
                continue
            if h in spec:
                spec.move_to_end(h)
            else:
                spec_masks[h] = spec_masks.get(h, 0) | bit
                added.append(h)
            spec[h] = expiry
        if w.capacity is not None:
            while len(spec) > w.capacity:
                self._unset_spec_bit(spec.popitem(last=False)[0], bit)
        if expiry < self._next_expiry:
            self._next_expiry = expiry
        added.reverse()  # in chain order
        return added

    def withdraw(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Take back speculative entries of the worker (those :meth:`speculate` returned for
        a request that failed before the worker computed anything: a 429, a refused
        connection). Otherwise an untracked worker would keep cache credit it never earned
        for ``approx_ttl``. Confirmed entries are the worker's own word and stay.

        Not an undo: entries the speculation evicted for capacity stay evicted, and a key
        that another request to the same worker refreshed meanwhile goes too (its credit is
        lost early, an underestimate the worker's events or the next routing repair)."""
        w = self._get(worker_id)
        spec = w.spec
        if not spec:
            return
        bit = w.bit
        for h in hashes:
            if h in spec:
                del spec[h]
                self._unset_spec_bit(h, bit)

    # ---- queries ----

    def match(self, hashes: Iterable[int]) -> dict[str, int]:
        """Per worker holding at least the first block: how many leading blocks it holds."""
        self._expire(self._clock())
        alive = self._all_bits  # workers that held every block so far
        result: dict[str, int] = {}
        if not alive:
            return result
        masks_get = self._masks.get
        spec_get = self._spec_masks.get if self._spec_masks else None
        depth = 0
        for h in hashes:
            held = masks_get(h, 0)
            if spec_get is not None:
                held |= spec_get(h, 0)
            held &= alive
            if held != alive:
                if depth:
                    self._record(alive ^ held, depth, result)
                alive = held
                if not alive:
                    return result
            depth += 1
        if depth:
            self._record(alive, depth, result)
        return result

    def num_blocks(self, worker_id: str) -> int:
        """Confirmed blocks the worker holds."""
        return len(self._get(worker_id).blocks)

    def num_speculative(self, worker_id: str) -> int:
        """Unexpired speculative blocks of the worker (never counting a confirmed one)."""
        w = self._get(worker_id)
        self._expire(self._clock())
        return len(w.spec)

    def num_entries(self) -> int:
        """Confirmed (block, worker) entries in all."""
        return self._entries

    def __len__(self) -> int:
        return self._entries

    def summary(self) -> dict[str, Any]:
        """A JSON-ready picture for a debug endpoint; ``approx_bytes`` is an estimate."""
        self._expire(self._clock())
        size = sys.getsizeof(self._masks) + sys.getsizeof(self._spec_masks)
        size += len(self._masks) * 2 * _INT_BYTES + len(self._spec_masks) * _INT_BYTES
        workers: dict[str, dict[str, Any]] = {}
        for wid, w in self._workers.items():
            size += sys.getsizeof(w.blocks) + sys.getsizeof(w.spec) + len(w.spec) * _FLOAT_BYTES
            workers[wid] = {
                "tracked": w.tracked,
                "blocks": len(w.blocks),
                "speculative": len(w.spec),
            }
        return {
            "workers": workers,
            "entries": self._entries,
            "speculative_entries": sum(len(w.spec) for w in self._workers.values()),
            "distinct_blocks": len(self._masks),
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

    def _unset_spec_bit(self, h: int, bit: int) -> None:
        rest = self._spec_masks[h] & ~bit
        if rest:
            self._spec_masks[h] = rest
        else:
            del self._spec_masks[h]

    def _drop_all(self, w: _Worker) -> None:
        masks, bit = self._masks, w.bit
        for h in w.blocks:
            rest = masks[h] & ~bit
            if rest:
                masks[h] = rest
            else:
                del masks[h]
        self._entries -= len(w.blocks)
        w.blocks = set()
        for h in w.spec:
            self._unset_spec_bit(h, bit)
        w.spec = OrderedDict()

    def _expire(self, now: float) -> None:
        """Pop speculative entries whose time is up (expiry <= now), oldest first; each
        worker's entries are in expiry order, so this stops at the first live one."""
        if now < self._next_expiry:
            return
        next_expiry = math.inf
        for w in self._workers.values():
            spec = w.spec
            while spec:
                h = next(iter(spec))
                expiry = spec[h]
                if expiry > now:
                    next_expiry = min(next_expiry, expiry)
                    break
                del spec[h]
                self._unset_spec_bit(h, w.bit)
        self._next_expiry = next_expiry
