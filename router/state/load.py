"""A worker's load as this router knows it: what it has been sent, and how long its
prefill takes (the cost model that prices it is :mod:`kvpool.cost`).

Each worker's load, as the router sees it, is written here and nowhere else:

* its requests in flight, and the prompt tokens each brought that it has not prefilled
  yet (a :class:`Ticket` from routing to the request's end; its tokens leave the queue at
  the first token, or, for an answer that shows none, when they should have been done);
  the queue drains at the prefill rate from when the worker began on it
  (:meth:`WorkerLoad.pending_tokens`): a request sent behind a prefill that is nearly
  done waits for what is left of it, and one sent behind a prefill just begun, for all;
* what the other router replicas report they sent it (their rows, summed);
* its prefill rate (:class:`PrefillModel`), learned from every time to first token seen;
* its time per output token, from streamed gaps and from its own ITL histogram;
* which of its requests are still prefilling, and the prompt blocks each brings
  (:meth:`WorkerLoad.leader`): a request sharing many of them is better held back until
  they are computed than sent to compute them a second time beside the first.

The policy reads a snapshot of this (:class:`~kvpool.router.routing.inputs.WorkerView`); the
pool owns the worker's membership, health and event streams; the data path claims and
releases load through :meth:`WorkerLoad.begin` and :meth:`WorkerLoad.end`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cost import COST, PrefillModel

__all__ = ["PrefillModel", "Ticket", "WorkerLoad", "common_prefix"]


@dataclass(slots=True)
class Ticket:
    """One request's claim on a worker's load, from routing to its end."""

    tokens: int  # uncached prompt tokens it brings to the worker's prefill queue
    queued_ahead: int  # prompt tokens queued there before it
    routed_at: float
    expires_at: float  # when its tokens stop counting as queued if no first token is seen
    learn: bool = True  # its TTFT measures the worker's prefill (not a decode leg's pull)
    #: the KV cache it takes there while it runs: its prompt and the most it may generate
    kv_tokens: int = 0
    first_token_seen: bool = False
    ended: bool = False
    #: its prompt's block hashes, and how many of them it was credited as cached there
    #: (the rest it computes itself): a follower sharing them waits for its prefill
    keys: Sequence[int] = ()
    credited_blocks: int = 0
    shows_first_token: bool = False
    #: set when its prefill is done (the first token) or it ended; made for a follower
    _prefilled: asyncio.Event | None = None

    def prefilled(self) -> asyncio.Event:
        """Set once its first token is seen or it ends (made on the first ask)."""
        if self._prefilled is None:
            self._prefilled = asyncio.Event()
            if self.first_token_seen or self.ended:
                self._prefilled.set()
        return self._prefilled

    def _done_prefilling(self) -> None:
        if self._prefilled is not None:
            self._prefilled.set()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:  # chained hashes: the last equal means all equal
        return n
    lo, hi = 1, n - 1  # a[lo-1] == b[lo-1], a[hi] != b[hi]: chained, so bisect
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(kw_only=True)
class WorkerLoad:
    """One worker's load and speed, as this router knows them (the pool's worker state
    extends it with membership and health)."""

    in_flight: int = 0
    #: the KV cache its requests in flight take (prompt and most output, in tokens): ten
    #: 32k-token conversations weigh what they hold, not what ten questions do
    active_tokens: int = 0
    queued: dict[int, Ticket] = field(default_factory=dict)
    prefill: PrefillModel = field(default_factory=PrefillModel)
    #: the pool's model, fitted to every worker's TTFTs at once (shared by the pool's
    #: workers): what a worker without enough TTFTs of its own is judged by
    pooled_prefill: PrefillModel | None = field(default=None, repr=False)
    itl: float | None = None  # seconds per output token, averaged (COST.itl_weight)
    itl_totals: tuple[float, float] | None = None  # the last scrape's ITL histogram sum, count
    #: what the other router replicas have on it (router.state.peers): requests in flight and
    #: prompt tokens not yet prefilled, their rows summed, each written by its replica
    peer_in_flight: int = 0
    peer_queued: int = 0
    #: and how many of their requests there still wait for a first token (:attr:`prefilling`)
    peer_prefilling: int = 0
    #: told of this router's own load here whenever it changes (for the other replicas)
    on_load: Callable[[Any], None] | None = field(default=None, repr=False)
    #: the queued tickets' tokens, summed, and the earliest of their expiries: every
    #: decision asks every worker, and most of the time nothing has expired
    _queued_sum: int = field(default=0, repr=False)
    _queued_due: float = field(default=math.inf, repr=False)
    #: how many of them measure its prefill (:attr:`prefilling`), kept with the sum
    _queued_learning: int = field(default=0, repr=False)
    #: since when the worker has been prefilling what is queued now: when its queue last
    #: went from empty to not, or a queued request's prefill last ended
    _drain_from: float = field(default=0.0, repr=False)

    @property
    def prefilling(self) -> int:
        """This router's requests here still waiting for their first token, decode legs
        aside (theirs waits for a transfer too): how many the worker's prefill has to go.
        A non-streamed answer shows no first token: it counts until its tokens have expired
        and the queue was last looked at (:meth:`queued_tokens`)."""
        return self._queued_learning

    def queued_tokens(self, now: float) -> int:
        if now < self._queued_due:
            return self._queued_sum
        queued = self.queued
        for k in [k for k, t in queued.items() if t.expires_at <= now]:
            del queued[k]
        self._requeue()
        self._drain_from = now
        return self._queued_sum

    def pending_tokens(self, now: float, rate: float) -> int:
        """The queued prompt tokens (:meth:`queued_tokens`) the worker has not prefilled
        yet, at ``rate`` tokens a second since it began on them: a request routed behind a
        prefill that is nearly done waits for what is left of it, not for all of it."""
        queued = self.queued_tokens(now)
        if not queued:
            return 0
        return max(0, queued - round((now - self._drain_from) * rate))

    def _requeue(self) -> None:
        """Sum the queued tickets again (after some left)."""
        queued = self.queued
        self._queued_sum = sum(t.tokens for t in queued.values())
        self._queued_learning = sum(1 for t in queued.values() if t.learn)
        self._queued_due = min((t.expires_at for t in queued.values()), default=math.inf)

    def _dequeue(self, ticket: Ticket, now: float | None = None) -> None:
        if self.queued.pop(id(ticket), None) is not None:
            self._queued_sum -= ticket.tokens
            self._queued_learning -= ticket.learn
            if now is not None:
                self._drain_from = now
            if ticket.expires_at == self._queued_due != math.inf:
                self._requeue()  # the earliest expiry left

    def begin(
        self,
        tokens: int,
        predicted_ttft: float,
        now: float,
        *,
        learn: bool = True,
        shows_first_token: bool = False,
        kv_tokens: int = 0,
        keys: Sequence[int] = (),
        credited_blocks: int = 0,
        queued_ahead: int | None = None,
    ) -> Ticket:
        """``queued_ahead``: the tokens routing judged ahead of it (what is left of the
        queue, :meth:`pending_tokens`, at the rate it judged the worker by); by default,
        at the worker's own rate. ``learn=False``: a decode leg, whose first token waits
        for a block transfer as well as for its prefill, so its TTFT would teach the
        prefill model wrong.
        ``shows_first_token``: the router will see its first token (a stream, a prefill
        leg's answer), so its tokens count as queued until then, however long the worker's
        queue has grown. ``keys``: its prompt's block hashes, ``credited_blocks`` of them
        cached there (a request still prefilling the rest leads those that share them)."""
        ticket = Ticket(
            tokens=tokens,
            # everything ahead of it there, the other replicas' too: its TTFT waits for
            # all of it, and the prefill model is learned and asked on the same figure
            queued_ahead=(
                self.pending_tokens(now, self.prefill.rate) + self.peer_queued
                if queued_ahead is None
                else queued_ahead
            ),
            routed_at=now,
            # A non-streamed answer shows no first token: its tokens leave the queue when
            # they should have been prefilled (twice the prediction, at least 2 s).
            expires_at=math.inf if shows_first_token else now + max(2 * predicted_ttft, 2.0),
            learn=learn,
            kv_tokens=kv_tokens,
            keys=keys,
            credited_blocks=credited_blocks,
            shows_first_token=shows_first_token,
        )
        self.in_flight += 1
        self.active_tokens += kv_tokens
        if not self.queued:
            self._drain_from = now
        self.queued[id(ticket)] = ticket
        self._queued_sum += tokens
        self._queued_learning += learn
        self._queued_due = min(self._queued_due, ticket.expires_at)
        self._load_changed()
        return ticket

    def first_token(self, ticket: Ticket, now: float) -> float:
        """Record the first token; returns the TTFT seen from the router."""
        ttft = now - ticket.routed_at
        if not ticket.first_token_seen:
            ticket.first_token_seen = True
            ticket._done_prefilling()
            self._dequeue(ticket, now)
            if ticket.learn:
                self.prefill.observe(ticket.queued_ahead + ticket.tokens, ttft)
                if self.pooled_prefill is not None:
                    self.pooled_prefill.observe(ticket.queued_ahead + ticket.tokens, ttft)
            self._load_changed()
        return ttft

    def finish_whole(
        self, ticket: Ticket, now: float, completion_tokens: int | None
    ) -> float | None:
        """Learn from an answer that came back whole (not streamed); returns the TTFT it
        implies, or None when it implies nothing.

        A whole answer shows no first token, but its time is the prefill's plus its decode:
        the tokens after the first, each taking the worker's time per output token
        (:attr:`itl`, learned from streams and from the worker's own histogram). What is
        left is the TTFT, taught to the prefill model as :meth:`first_token` does, so a
        pool that streams nothing still learns each worker's prefill rate. An estimate
        that leaves nothing (a long answer on a worker that decoded faster than usual)
        teaches nothing."""
        if ticket.first_token_seen or not ticket.learn or self.itl is None:
            return None
        if not isinstance(completion_tokens, int) or isinstance(completion_tokens, bool):
            return None
        if completion_tokens < 1:
            return None
        ttft = (now - ticket.routed_at) - (completion_tokens - 1) * self.itl
        if not ttft > 0:
            return None
        return self.first_token(ticket, ticket.routed_at + ttft)

    def end(self, ticket: Ticket) -> None:
        if not ticket.ended:
            ticket.ended = True
            ticket._done_prefilling()
            self.in_flight -= 1
            self.active_tokens -= ticket.kv_tokens
            self._dequeue(ticket)
            self._load_changed()

    def leader(
        self,
        follower: Ticket,
        min_blocks: int,
        block_size: int,
        model: Callable[[], PrefillModel | None] | None = None,
    ) -> tuple[Ticket, float] | None:
        """The request here still prefilling most of ``follower``'s prompt, and by when it
        should have computed that much, or None when none computes ``min_blocks`` of it.

        Sent now, the follower would be scheduled beside it and compute those blocks a
        second time (an engine's prefix cache holds only blocks already computed), and
        each of the two prefills would slow the other; held until the leader's first token,
        it computes only its own tail. Only a request whose first token this router sees
        leads (a stream or a prefill leg), and only one routed before the follower. The
        time: the leader's predicted TTFT for its queue and the blocks they share, from
        when it was routed, times ``COST.leader_margin`` (:mod:`kvpool.cost`): a prediction
        that was wrong costs the follower a bounded wait, not a hang.

        ``model``: gives the prefill model the prediction uses, the one routing judges this
        worker by (its own without it), asked only when there is a leader (most requests
        have none); it gives None while no TTFT has been seen anywhere, when no prediction
        is worth a cap: the time is then unbounded, and the follower waits for its
        leader's first token or its end (the leader's own first-token limit bounds that,
        and a stuck leader would have stalled the follower beside it)."""
        keys = follower.keys
        if not keys or min_blocks <= 0:
            return None
        best: Ticket | None = None
        most = min_blocks - 1
        for t in self.queued.values():
            if t is follower or t.first_token_seen or not t.shows_first_token or not t.keys:
                continue
            if t.routed_at > follower.routed_at:
                continue
            shared = common_prefix(t.keys, keys)
            pending = shared - t.credited_blocks  # the shared blocks it computes itself
            if pending > most:
                best, most = t, pending
        if best is None:
            return None
        prefill = self.prefill if model is None else model()
        if prefill is None:
            return best, math.inf
        work = best.queued_ahead + most * block_size  # ahead of it, then the shared blocks
        return best, best.routed_at + COST.leader_margin * prefill.predict(work)

    def computing(self, keys: Sequence[int]) -> int:
        """How many of the prompt ``keys``' leading blocks are computed here at most: the
        fewest credited to a request here still prefilling blocks it shares with them
        (``len(keys)`` when none is). The index counts a routed prompt's blocks as held at
        once (speculation); a request sent now would find those still being computed,
        and wait for them (:meth:`leader`) or compute them again."""
        done = len(keys)
        if not keys:
            return 0
        for t in self.queued.values():
            if t.first_token_seen or not t.keys or t.credited_blocks >= done:
                continue
            shared = common_prefix(t.keys, keys)
            if shared > t.credited_blocks:
                done = t.credited_blocks
                if not done:
                    break  # none computed: it cannot be fewer
        return done

    def observe_itl(self, seconds: float) -> None:
        """One reading of the worker's time per output token: a streamed inter-chunk gap,
        or the mean over a scrape interval."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        if self.itl is None:
            self.itl = seconds
        else:
            self.itl += COST.itl_weight * (seconds - self.itl)

    def learn_itl(self, total: float | None, count: float | None) -> None:
        """The mean time per output token since the last scrape, from the growth of the
        worker's ITL histogram (its sum and count); a counter that fell means the worker
        started again."""
        if total is None or count is None:
            return
        last, self.itl_totals = self.itl_totals, (total, count)
        if last is None:
            return
        d_sum, d_count = total - last[0], count - last[1]
        if d_count > 0 and d_sum >= 0:
            self.observe_itl(d_sum / d_count)

    def _load_changed(self) -> None:
        if self.on_load is not None:
            self.on_load(self)
