"""Which worker each conversation was last sent to: a bounded LRU with a TTL (pure).

A conversation's next turn repeats its whole history as its prompt, so the worker that
served the last turn holds that history's KV cache, often before the router's index has
heard of it (the worker publishes its blocks after the prefill). The router remembers
``session key -> worker`` here and hands the worker to the policy as
``RouteRequest.affinity``, a soft score: load still decides (see :mod:`.policy`).

Memory stays bounded whatever clients send: at most ``capacity`` sessions, each key at
most 256 characters (longer keys are kept as a 16-byte BLAKE2b digest), and a session not
used for ``ttl_s`` seconds is forgotten. No I/O, no asyncio: the caller owns the clock and
the locking (the router calls it from its one event loop).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["MAX_KEY_CHARS", "SessionAffinity"]

#: keys longer than this are stored as a digest, so one entry's size is bounded
MAX_KEY_CHARS = 256

# A hashed key is bytes and a short key is str: the two never compare equal, so a client
# cannot collide with a long key by sending its digest as a key of its own.
_Key = str | bytes


def _key(key: str) -> _Key:
    if len(key) <= MAX_KEY_CHARS:
        return key
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionAffinity:
    """Session key -> (worker id, last used), least recently used first.

    :meth:`remember` is the only use: the router calls it for every request it routes, so
    :meth:`get` is a plain read. Entries then stay ordered by their last-used time, so the
    expired ones are always at the front and pruning them costs O(1) per entry pruned.
    A reverse index (worker -> its sessions) makes :meth:`forget_worker` cost the number
    of sessions on that worker, not the number of all sessions.
    """

    def __init__(
        self,
        capacity: int = 100_000,
        ttl_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"session affinity capacity must be at least 1, not {capacity}")
        if not ttl_s > 0:
            raise ValueError(f"session affinity ttl_s must be a positive number, not {ttl_s}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[_Key, tuple[str, float]] = OrderedDict()
        self._by_worker: dict[str, set[_Key]] = {}

    def get(self, key: str) -> str | None:
        """The worker the session was last sent to; None if unknown or expired (dropped)."""
        k = _key(key)
        entry = self._entries.get(k)
        if entry is None:
            return None
        worker, used = entry
        if self._expired(used, self._clock()):
            self._drop(k)
            return None
        return worker

    def remember(self, key: str, worker: str) -> None:
        """Record that the session's latest request went to ``worker`` (now its most recent)."""
        now = self._clock()
        k = _key(key)
        old = self._entries.pop(k, None)
        if old is not None and old[0] != worker:
            self._unlink(k, old[0])
        self._entries[k] = (worker, now)
        self._by_worker.setdefault(worker, set()).add(k)
        self._prune(now)
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))

    def forget_worker(self, worker: str) -> None:
        """Drop every session pointing at ``worker`` (it left the pool): their next turn
        is routed by cache and load alone, and remembered again wherever it goes."""
        for k in self._by_worker.pop(worker, ()):
            del self._entries[k]

    def __len__(self) -> int:
        self._prune(self._clock())
        return len(self._entries)

    def _expired(self, used: float, now: float) -> bool:
        return now - used >= self.ttl_s

    def _prune(self, now: float) -> None:
        while self._entries:
            k, (_, used) = next(iter(self._entries.items()))
            if not self._expired(used, now):
                return
            self._drop(k)

    def _drop(self, k: _Key) -> None:
        worker, _ = self._entries.pop(k)
        self._unlink(k, worker)

    def _unlink(self, k: _Key, worker: str) -> None:
        keys = self._by_worker.get(worker)
        if keys is not None:
            keys.discard(k)
            if not keys:
                del self._by_worker[worker]
