"""The prefix index's parts (:mod:`.index`): each worker's record (its bit, its key log
and its guesses), a request's hold on the keys it routed, and the jobs that sweep a retired
bit off the table and compact a key log."""

from __future__ import annotations

import logging
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator

__all__ = ["Hold"]

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
