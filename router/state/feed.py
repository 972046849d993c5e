"""The block index's feed: each worker's KV event stream into the index, and the lookups.

The pool decides which workers exist and whether they are up; this module keeps what the
index says of them:

* **events**: a :class:`~kvpool.kv_events.EventSubscriber` per worker feeding the index;
  a lost stretch of events clears that worker's entries (never a silently wrong index),
  and a stream that fails is started again.
* **data-parallel ranks**: a data-parallel worker runs one engine, and one cache, per
  rank: its batches are indexed apart by rank (index id ``worker`` for rank 0,
  ``worker@dp<r>`` above), so one engine's eviction never takes away what another still
  holds. :meth:`IndexFeed.match` answers per worker, with the rank holding the most.
* **speculation**: a request sent to a worker holds its chain there from then
  (:meth:`BlockIndex.hold`) while it waits for its first token, however long the worker's
  queue: then the worker's own events confirm it, after a short grace for them to arrive,
  or, if the attempt fails, what no other request holds is taken back; the other router
  replicas are told of each, and count it too.
* **sweeping**: a cleared or removed worker leaves the index at once, and its entries are
  swept out in slices of about a millisecond between other work on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvpool.kv_events import EventSubscriber, RankedSubscriber, Received

from .index import BlockIndex, Hold


class WorkerState(Protocol):
    """What the feed reads and keeps of a worker (the pool's :class:`.pool.WorkerState`;
    named here so that the feed needs nothing of the pool)."""

    @property
    def id(self) -> str: ...

    subscriber: EventSubscriber | RankedSubscriber | None
    events_task: asyncio.Task[None] | None
    events_seen: int
    tracked: bool
    dp_ranks: dict[int, str]


log = logging.getLogger(__name__)


class IndexFeed:
    """The index's writer for a pool's workers (``workers``: the pool's, by id)."""

    def __init__(
        self,
        index: BlockIndex,
        workers: dict[str, WorkerState],
        on_event_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.index = index
        self.workers = workers
        self._on_event_lag = on_event_lag
        # index id of a data-parallel rank above 0 -> (worker id, rank); empty for a pool
        # of single-engine workers, which keeps :meth:`match` to one pass over the index's
        self._rank_of: dict[str, tuple[str, int]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        #: the other router replicas (router.state.peers.PeerLink), told of speculations
        self.peers: Any = None

    # -- a worker's entries ---------------------------------------------------------------

    def claim_name(self, worker_id: str) -> None:
        """A worker is added under ``worker_id``: a rank indexed under that name gives it up
        (the name is the worker's)."""
        owner = self._rank_of.get(worker_id)
        if owner is not None:
            self._drop_rank(self.workers[owner[0]], owner[1])

    def track(self, state: WorkerState) -> None:
        """The worker is up: it has entries from now (confirmed by its events, if it
        publishes them; speculated only, if not)."""
        if state.id not in self.index:
            self.index.add_worker(state.id, tracked=state.tracked)

    def forget(self, state: WorkerState, *, remove: bool) -> None:
        """The worker is down (``remove``: gone): its events stop and its entries go. Its
        ranks are seen again when its events start again, maybe fewer of them."""
        self.stop(state)
        for rank in list(state.dp_ranks):
            self._drop_rank(state, rank)
        if state.id in self.index:
            if remove:
                self.index.remove_worker(state.id)
            else:
                self.index.clear_worker(state.id)
        self._sweep_later()

    def clear(self, state: WorkerState) -> None:
        for iid in self._index_ids(state):
            self.index.clear_worker(iid)
        self._sweep_later()

    def clear_worker(self, worker_id: str) -> None:
        """Drop every index entry of a worker, all its ranks'; unknown worker: nothing."""
        state = self.workers.get(worker_id)
        if state is not None:
            self.clear(state)

    def close(self) -> asyncio.Task[None] | None:
        """Stop sweeping; the sweeper's task, to await."""
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.cancel()
        return sweeper

    # -- KV events ------------------------------------------------------------------------

    def start(
        self,
        state: WorkerState,
        endpoint: str,
        replay: str | None,
        topic: str,
        credential: str | None,
        ranks: tuple[int, ...] = (0,),
    ) -> None:
        """Read the worker's events. ``ranks``: a data-parallel vLLM's engines, each of which
        publishes its own stream (at the events and replay ports plus its rank); one stream
        otherwise, whose batches name their rank."""
        before = _ranks(state.subscriber) if state.subscriber is not None else (0,)
        self.stop(state)
        for rank in [r for r in before if r and r not in ranks and r in state.dp_ranks]:
            self._drop_rank(state, rank)  # an engine it no longer runs: its entries go
        options: dict[str, Any] = dict(
            topic=topic,
            # With a replay buffer, start from its beginning: the blocks it stored before
            # the router came are indexed too.
            start_seq=0 if replay else None,
            name=state.id,
            credential=credential,
        )
        sub: EventSubscriber | RankedSubscriber
        if ranks == (0,):
            sub = EventSubscriber(endpoint, replay, **options)
        else:
            sub = RankedSubscriber(endpoint, replay, ranks, **options)
        state.subscriber = sub
        state.events_task = asyncio.create_task(self._events_loop(state, sub, credential))

    async def caught_up(self, state: WorkerState, timeout: float) -> bool:
        """Wait until the worker's event history (its publisher's replay buffer, read from
        the start) is in the index, at most ``timeout`` seconds; whether it is. True at once
        for a worker without an event stream."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # A stream that fails meanwhile is started again, with a new subscriber: its
        # replay is the one to wait for.
        while (sub := state.subscriber) is not None:
            try:
                await asyncio.wait_for(sub.caught_up.wait(), max(deadline - loop.time(), 0))
            except TimeoutError:
                return False
            if state.subscriber is sub:
                return True
        return True

    def streaming(
        self,
        state: WorkerState,
        endpoint: str,
        replay: str | None,
        topic: str,
        ranks: tuple[int, ...] = (0,),
    ) -> bool:
        """Whether the worker's events from this publisher are being read now (a worker
        coming back after failing its checks, whose stream ran on meanwhile)."""
        sub, task = state.subscriber, state.events_task
        return (
            sub is not None
            and task is not None
            and not task.done()
            and (sub.endpoint, sub.replay_endpoint, sub.topic) == (endpoint, replay, topic.encode())
            and _ranks(sub) == ranks
        )

    def stop(self, state: WorkerState) -> None:
        sub, state.subscriber = state.subscriber, None
        task, state.events_task = state.events_task, None
        if task is not None:
            task.cancel()
        if sub is not None:
            sub.close()

    async def _events_loop(
        self, state: WorkerState, sub: EventSubscriber | RankedSubscriber, credential: str | None
    ) -> None:
        try:
            async for item in sub.start():
                if state.subscriber is not sub:
                    return
                if isinstance(item, Received):
                    rank = item.batch.data_parallel_rank
                    # vLLM's single engine says rank 0, others may say None: one cache.
                    iid = state.id if not rank or rank < 0 else self._rank_id(state, rank)
                    self.index.apply(iid, item.batch)  # AllBlocksCleared: a sweep to do
                    self._sweep_later()
                    state.events_seen += len(item.batch.events)
                    # A replayed batch is late by design: its lag says nothing.
                    if self._on_event_lag and item.batch.ts > 0 and not item.replayed:
                        self._on_event_lag(time.time() - item.batch.ts)
                elif item.rank is not None:  # one rank's stream lost events: its entries go
                    iid = state.id if item.rank == 0 else state.dp_ranks.get(item.rank)
                    if iid is not None:
                        self.index.clear_worker(iid)
                        self._sweep_later()
                else:  # events were lost: what the index says of this worker may be wrong
                    self.clear(state)
        except asyncio.CancelledError:
            raise
        except Exception:  # the stream is lost, not the router: start it again
            log.exception("worker %s: KV event stream failed; restarting it", state.id)
            self.clear(state)
            await asyncio.sleep(1.0)
            # Out of rotation too: a worker that fails its checks keeps its stream.
            if state.subscriber is sub and self.workers.get(state.id) is state:
                state.subscriber = state.events_task = None  # this task ends here
                topic = sub.topic.decode()
                self.start(state, sub.endpoint, sub.replay_endpoint, topic, credential, _ranks(sub))
        finally:
            sub.close()

    # -- the index, by data-parallel rank ---------------------------------------------------

    def _rank_id(self, state: WorkerState, rank: int) -> str:
        """The index id of a worker's rank above 0, registered the first time it is seen."""
        iid = state.dp_ranks.get(rank)
        if iid is not None:
            return iid
        iid = f"{state.id}@dp{rank}"
        if iid in self.workers or iid in self.index:  # a worker is named so: share rank 0's
            log.warning("worker %s: rank %d's index id %s is taken", state.id, rank, iid)
            return state.id
        self.index.add_worker(iid, tracked=state.tracked)
        state.dp_ranks[rank] = iid
        self._rank_of[iid] = (state.id, rank)
        return iid

    def _drop_rank(self, state: WorkerState, rank: int) -> None:
        iid = state.dp_ranks.pop(rank)
        del self._rank_of[iid]
        if iid in self.index:
            self.index.remove_worker(iid)

    def _index_ids(self, state: WorkerState) -> list[str]:
        ids = [state.id] if state.id in self.index else []
        return [*ids, *state.dp_ranks.values()]

    def _sweep_later(self) -> None:
        """A cleared or removed worker leaves the index at once (its bit is retired: no
        lookup counts it) and its entries are swept out in slices of about a millisecond
        each, between other work on the loop: clearing a million blocks at once stalled
        every stream for most of a second."""
        if self._sweeper is None and self.index.pending_sweep():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        try:
            while self.index.sweep():  # noqa: ASYNC110 - a slice, then the loop's turn
                await asyncio.sleep(0)
        finally:
            self._sweeper = None

    # -- lookups --------------------------------------------------------------------------

    def indexed_blocks(self, worker_id: str) -> int:
        """Confirmed blocks indexed for the worker, all its ranks together."""
        state = self.workers.get(worker_id)
        if state is None:
            return 0
        return sum(self.index.num_blocks(iid) for iid in self._index_ids(state))

    def confirmations(self, state: WorkerState) -> tuple[int, int, int]:
        """Summed over the worker's ranks: see :meth:`BlockIndex.confirmations`."""
        total = [0, 0, 0]
        for index_id in self._index_ids(state):
            if index_id in self.index:
                for i, n in enumerate(self.index.confirmations(index_id)):
                    total[i] += n
        return total[0], total[1], total[2]

    def ranks(self, worker_id: str) -> list[int]:
        """The data-parallel ranks indexed for the worker (0 stands for its plain id)."""
        state = self.workers.get(worker_id)
        if state is None:
            return []
        return [0] * (worker_id in self.index) + sorted(state.dp_ranks)

    def match(self, keys: list[int]) -> dict[str, tuple[int, int | None]]:
        """Per worker holding the prompt's first block: the leading blocks held by its rank
        that holds the most, and that rank (None for a worker with one rank; a tie goes to
        the lower rank). A worker with several ranks names rank 0 too: vLLM's own
        balancer would otherwise be free to send the request to another rank."""
        raw = self.index.match(keys)
        rank_of = self._rank_of
        if not rank_of:
            return {wid: (n, None) for wid, n in raw.items()}
        workers = self.workers
        out: dict[str, tuple[int, int | None]] = {}
        for iid, n in raw.items():
            owner = rank_of.get(iid)
            if owner is None:
                state = workers.get(iid)
                wid, rank = iid, (0 if state is not None and state.dp_ranks else None)
            else:
                wid, rank = owner
            best = out.get(wid)
            if best is None or n > best[0] or (n == best[0] and (rank or 0) < (best[1] or 0)):
                out[wid] = (n, rank)
        return out

    # -- speculation ----------------------------------------------------------------------

    def _speculation_id(self, worker_id: str, rank: int | None, register: bool) -> str | None:
        if not rank or rank < 0:
            return worker_id if worker_id in self.index else None
        state = self.workers.get(worker_id)
        if state is None or worker_id not in self.index:
            return None
        iid = state.dp_ranks.get(rank)
        if iid is None and register:
            iid = self._rank_id(state, rank)
        return iid

    def speculate(self, worker_id: str, keys: list[int], rank: int | None = None) -> Hold | None:
        """A request is sent to the worker (its ``rank``, when the router chose one) with
        this chain: count it as held there while the request waits for it (see
        :meth:`BlockIndex.hold`). The request ends the hold this returns with
        :meth:`release` or :meth:`withdraw`; a worker gone meanwhile: None. The other
        router replicas are told, and hold it too until they hear how it ended."""
        iid = self._speculation_id(worker_id, rank, register=True)
        if iid is None:
            return None
        hold = self.index.hold(iid, keys)
        if self.peers is not None:
            hold.chain = self.peers.speculated(worker_id, rank, keys)
        return hold

    def release(self, hold: Hold | None) -> None:
        """The request saw its first token or ended: its chain is the worker's to confirm,
        with the short grace of ``speculative_ttl`` for the event (see
        :meth:`BlockIndex.release`). Once per hold; the peers are told."""
        self._end(hold, failed=False)

    def withdraw(self, hold: Hold | None) -> None:
        """The attempt failed before the worker computed anything: what it alone held is
        taken back (what other requests hold stays); the peers are told."""
        self._end(hold, failed=True)

    def _end(self, hold: Hold | None, *, failed: bool) -> None:
        if hold is None or hold.done:
            return
        self.index.release(hold, failed=failed)
        if self.peers is not None and hold.chain is not None:
            self.peers.ended(hold.chain, failed=failed)

    def peer_speculated(self, worker_id: str, rank: int | None, keys: list[int]) -> None:
        """A replica of the release before holds sent this chain to the worker: an unowned
        guess, for ``speculative_ttl`` as that release counts it."""
        iid = self._speculation_id(worker_id, rank, register=True)
        if iid is not None:
            self.index.speculate(iid, keys)

    def peer_held(self, worker_id: str, rank: int | None, keys: list[int]) -> Hold | None:
        """Another replica sent this chain to the worker for a request: held as the sender
        holds it, until :meth:`peer_ended` (the link also ends it when the sender goes)."""
        iid = self._speculation_id(worker_id, rank, register=True)
        return self.index.hold(iid, keys) if iid is not None else None

    def peer_ended(self, hold: Hold | None, failed: bool) -> None:
        """A peer's request is done with its chain (``failed``: it failed there)."""
        if hold is not None:
            self.index.release(hold, failed=failed)


def _ranks(sub: EventSubscriber | RankedSubscriber) -> tuple[int, ...]:
    return sub.ranks if isinstance(sub, RankedSubscriber) else (0,)
