"""How hot each shared prefix is: its share of the pool's recent requests.

A prefix that a large share of the traffic starts with (one system prompt for every
request, a popular document) is best held by as many workers as its requests' prefill
calls for: on a few holders, their prefill queues grow while the other workers idle. Its
share of the workers, but no more than its share of the requests still waiting for their
first token, three to a holder, says how many holders it needs. That count is the
prefill queue's length, which by Little's law is the requests' rate times their wait for
a first token: it grows with either, and stays small while the holders keep up, however
many requests are decoding. (The requests in flight, decodes included,
copied one system prompt at 8 requests a second to every worker of eight, each copy
computing its 2,000 tokens again for requests that a holder's decode batch took on at
little cost.) A session's first request is the exception: the session's later steps stay
where it goes, so for it the requests in flight, decodes included, size the holders
(``COST.heat_session_per_holder`` a holder; the constants are :mod:`kvpool.cost`'s).
The policy's ``spread`` scorer asks for a new copy when a prompt's deepest shared prefix
has fewer holders than that (:meth:`PrefixHeat.holders`); the queue-driven spill stays as
it was.

A prefix is named by the key of its last block (a block key names its whole chain): the
router names a prompt's at a power of two of blocks, at most four fifths of its deepest
match, so that what follows a shared system prompt does not split its heat. Counts
decay exponentially (``half_life_s``), so a share follows the traffic of the last tens of
seconds; at most ``capacity`` prefixes are remembered, the least recently seen forgotten
first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from kvpool.cost import COST

__all__ = ["SESSION_PER_HOLDER", "PrefixHeat"]

#: requests in flight a holder of a prefix that sessions start with should carry
SESSION_PER_HOLDER = COST.heat_session_per_holder


class PrefixHeat:
    """Decayed request counts per prefix and in all (one writer: the router's loop)."""

    def __init__(
        self,
        half_life_s: float = COST.heat_half_life_s,
        capacity: int = 4096,
        min_requests: float = COST.heat_min_requests,
        per_holder: float = COST.heat_per_holder,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if half_life_s <= 0 or capacity < 1:
            raise ValueError("half_life_s must be positive and capacity at least 1")
        self._rate = math.log(2) / half_life_s
        self.capacity = capacity
        self.min_requests = min_requests  # a prefix seen fewer times is not judged hot
        self.per_holder = per_holder  # its requests still prefilling each holder may have
        self._clock = clock
        self._counts: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key: (n, t)
        self._total = (0.0, clock())

    def _decayed(self, value: tuple[float, float], now: float) -> float:
        n, t = value
        return n * math.exp(-self._rate * (now - t))

    def observe(self, key: int | None) -> None:
        """One request whose deepest shared prefix is ``key`` (None: it shares none)."""
        now = self._clock()
        if key is not None:
            counts = self._counts
            old = counts.pop(key, None)
            counts[key] = (1.0 + (self._decayed(old, now) if old else 0.0), now)
            if len(counts) > self.capacity:
                counts.popitem(last=False)
        self._total = (1.0 + self._decayed(self._total, now), now)

    def share(self, key: int) -> float:
        """The prefix's share of the recent requests (0 when seen too rarely to say)."""
        value = self._counts.get(key)
        if value is None:
            return 0.0
        now = self._clock()
        n = self._decayed(value, now)
        if n < self.min_requests:
            return 0.0
        total = self._decayed(self._total, now)
        return min(n / total, 1.0) if total > 0 else 0.0

    def holders(self, share: float, workers: int, load: float, *, session: bool = False) -> int:
        """How many of ``workers`` should hold a prefix with this ``share`` of the traffic
        (:meth:`share`): its share of them, but no more than its share of ``load``, the
        requests still waiting for their first token over the pool, at ``per_holder`` a
        holder; at least one. Requests that each finish prefilling before the next comes
        need one holder, however many are decoding and however much of the traffic shares
        the prefix; a prefix a thirty-second of the traffic shares needs one of eight
        workers, however busy the pool.

        For a request that starts a session (``session``), ``load`` is the requests in
        flight, decodes included, at ``SESSION_PER_HOLDER`` a holder: the session's later
        steps stay where it goes (their own context is there), so where its first request
        goes places their load too, and a prefix that sessions start with (an agent's
        system prompt) on a few holders gathers the sessions there."""
        per_holder = SESSION_PER_HOLDER if session else self.per_holder
        by_load = math.ceil(share * load / per_holder - 1e-9)
        by_share = math.ceil(share * workers - 1e-9)
        return max(1, min(by_load, by_share))
