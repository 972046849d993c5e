"""The router's workers: membership, registration, health, scraping and circuit breakers.

For each worker the pool keeps what the policy needs at decision time (a
:class:`~kvpool.router.routing.inputs.WorkerView`) and three background tasks:

* **health**: ``GET /health`` every ``health_interval_s``. A refused connection, or no
  answer within ``health_timeout_s`` of the router's responsive time (a stall of the
  router's own loop is not the worker's slowness: :mod:`kvpool.stall`), takes the worker out of
  rotation; so does a 503 (loading or draining). Health is not cache loss: its index
  entries and its KV event stream stay, until there is evidence that its cache is gone
  (its events say ``AllBlocksCleared`` or show a restart, it registers with another boot
  id, or it leaves discovery), so a worker that was only slow comes back with everything
  it held, and without a replay. When it answers 200 again it is registered again:
  ``GET /kvpool/info`` tells block size, hash seed, model, event endpoints and boot id. A
  worker whose event stream is new enters rotation once its event history (the
  publisher's replay buffer, from the start) is in the index: ``syncing`` until then, at
  most ``index_sync_timeout_s``. A router that
  starts in front of busy workers so routes on what they hold, and stays unready (its
  ``/health``) meanwhile. A worker whose block size or hash
  seed differ from the router's is kept, but scored without cache credit, and reported.
  A worker without ``/kvpool/info`` (vLLM) is taken to share the router's hashing, the way
  an operator deploys them, with its model from ``/v1/models``.
* **models**: ``GET /v1/models`` at registration and every ``models_interval_s``: the base
  model and the LoRA adapters it serves now (vLLM loads adapters at run time).
* **load**: ``GET /metrics`` every ``scrape_interval_s``: KV cache usage, waiting requests
  and the mean time per output token, under vLLM's metric names.
* **events**: started when the worker registers, stopped when it goes down; the stream,
  its data-parallel ranks and the index entries they write are the feed's
  (:class:`~kvpool.router.state.feed.IndexFeed`), and the cost model, the worker's load
  (:class:`~kvpool.router.state.load.WorkerLoad`).

A worker that goes down takes its in-flight attempts with it: each is told to abort, so a
request still waiting on a hung worker for its first token is retried elsewhere at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp

from kvpool.stall import LoopClock

from ..routing.inputs import WorkerView
from .agreement import AgreementConfig, CacheAgreement
from .discovery import WorkerEndpoint
from .feed import IndexFeed
from .index import BlockIndex
from .load import PrefillModel
from .probes import Probes
from .scrape import parse_load
from .worker import (
    LEARNED_AFTER,
    TYPICAL_EVERY_S,
    CircuitBreaker,
    PoolConfig,
    PrefillSource,
    WorkerState,
)

__all__ = ["PoolConfig", "WorkerPool", "WorkerState", "parse_load"]

log = logging.getLogger(__name__)

#: a derived figure to be computed again
_STALE = object()


class WorkerPool(Probes):
    """The workers the router knows, kept current by discovery and by their own answers."""

    def __init__(
        self,
        config: PoolConfig,
        index: BlockIndex,
        client: aiohttp.ClientSession,
        *,
        on_event_lag: Callable[[float], None] | None = None,
        clock: LoopClock | None = None,
    ) -> None:
        self.config = config
        self.index = index
        #: the router's responsive time, which health checks are timed by
        self.clock = clock or LoopClock()
        #: (until when, how many learned models, their median model): see _typical_prefill
        self._typical: tuple[float, int, PrefillModel] | None = None
        #: one model fitted to every worker's TTFTs: see _typical_prefill
        self.pooled_prefill = PrefillModel()
        self.client = client
        self.workers: dict[str, WorkerState] = {}
        #: the index's writer: the workers' event streams, their ranks, speculation
        self.feed = IndexFeed(index, self.workers, on_event_lag)
        self.changed = asyncio.Event()  # set when a worker becomes routable
        #: the other router replicas (router.state.peers.PeerLink), when there are any
        self.peers: Any = None
        self._peer_load: dict[str, tuple[int, int, int]] = {}  # worker -> the peers' sums
        #: context_tokens, until the workers change (changed_roster)
        self._context: Any = _STALE

    # -- membership (from discovery) ------------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[WorkerEndpoint]) -> None:
        wanted = {e.id: e for e in endpoints}
        for wid in list(self.workers):
            if wid not in wanted:
                self._remove(wid)
        for wid, endpoint in wanted.items():
            state = self.workers.get(wid)
            if state is not None and state.endpoint.url == endpoint.url:
                state.endpoint = endpoint  # draining flag, role: taken as they are now
                continue
            if state is not None:
                self._remove(wid)
            self._add(endpoint)

    def _add(self, endpoint: WorkerEndpoint) -> None:
        self.feed.claim_name(endpoint.id)
        state = WorkerState(endpoint=endpoint, pooled_prefill=self.pooled_prefill)
        state.breaker = CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooldown_s)
        if self.peers is not None:
            state.on_load = self._own_load_changed
        state.peer_in_flight, state.peer_queued, state.peer_prefilling = self._peer_load.get(
            endpoint.id, (0, 0, 0)
        )
        cfg = self.config
        if cfg.cache_check_answers > 0:
            check = AgreementConfig(
                window=cfg.cache_check_answers,
                min_answers=min(8, cfg.cache_check_answers),
                flag_below=cfg.cache_check_flag_below,
            )
            state.agreement = CacheAgreement(endpoint.id, cfg.block_size, check)
        self.workers[endpoint.id] = state
        self.changed_roster()
        state.tasks.append(asyncio.create_task(self._health_loop(state)))
        state.tasks.append(asyncio.create_task(self._scrape_loop(state)))
        state.tasks.append(asyncio.create_task(self._models_loop(state)))
        log.info("worker %s added: %s (%s)", endpoint.id, endpoint.url, endpoint.role)

    def _remove(self, wid: str) -> None:
        state = self.workers.pop(wid)
        self.changed_roster()
        self.feed.forget(state, remove=True)
        for task in state.tasks:
            task.cancel()
        self._abort_attempts(state, "removed")
        log.info("worker %s removed", wid)

    async def close(self) -> None:
        tasks = [t for s in self.workers.values() for t in [*s.tasks, s.events_task] if t]
        for wid in list(self.workers):
            self._remove(wid)
        self.clock.close()
        sweeper = self.feed.close()
        if sweeper is not None:
            tasks.append(sweeper)
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- views for the policy -------------------------------------------------------------

    def views(self, now: float | None = None) -> list[WorkerView]:
        now = time.monotonic() if now is None else now
        max_age = 3 * self.config.scrape_interval_s
        views = [s.view(now, max_age) for s in self.workers.values()]
        # A worker the router has not yet seen prefill often is assumed to be like its
        # peers (same model, same hardware), not like the static prior or its own first
        # few TTFTs: a prior slower than the pool would keep a new or idle worker out of
        # rotation for good, and one faster than it (or a fit to one TTFT, whose error all
        # goes into the overhead) favours a worker whose first request is still
        # prefilling over the ones that have answered.
        typical = self._typical_prefill([v.prefill for v in views], now)
        if typical is not None:
            for v in views:
                if v.prefill.observations < LEARNED_AFTER:
                    v.prefill = typical
        # what is left of each queue, at the rate routing judges the worker by
        for s, v in zip(self.workers.values(), views, strict=True):
            if v.queued_tokens:
                v.queued_tokens = s.pending_tokens(now, v.prefill.rate) + s.peer_queued
        return views

    def prefill_models(
        self, now: float | None = None
    ) -> dict[str, tuple[PrefillModel, PrefillSource]]:
        """Per worker, the prefill model routing judges it by (:meth:`views`), and where it
        comes from: ``own`` (fitted to the worker's own ``LEARNED_AFTER`` TTFTs or more),
        ``median`` (the learned workers' median), ``pool`` (fitted to every TTFT seen,
        while no worker has its own) or ``prior`` (no TTFT seen yet: a guess)."""
        now = time.monotonic() if now is None else now
        states = self.workers.values()
        typical = self._typical_prefill([s.prefill for s in states], now)
        source: PrefillSource = "prior"
        if typical is not None:
            source = "pool" if typical is self.pooled_prefill else "median"
        out: dict[str, tuple[PrefillModel, PrefillSource]] = {}
        for s in states:
            if s.prefill.observations >= LEARNED_AFTER:
                out[s.id] = (s.prefill, "own")
            else:
                out[s.id] = (typical or s.prefill, source)
        return out

    def prefill_rates(self) -> dict[str, float]:
        """The prefill rate routing uses for each worker whose model is not the prior."""
        return {w: m.rate for w, (m, source) in self.prefill_models().items() if source != "prior"}

    def prefill_model(self, state: WorkerState) -> PrefillModel | None:
        """The prefill model routing judges ``state`` by (:meth:`prefill_models`, for one
        worker), or None while it would be the static prior: no TTFT seen in the pool."""
        if state.prefill.observations >= LEARNED_AFTER:
            return state.prefill
        return self._typical_prefill([s.prefill for s in self.workers.values()], time.monotonic())

    def _typical_prefill(self, models: list[PrefillModel], now: float) -> PrefillModel | None:
        """The model for workers the router has not yet seen prefill ``LEARNED_AFTER``
        times: the median of the workers' own learned models, or, while no worker has
        one, the pool's model (:attr:`pooled_prefill`, fitted to every TTFT seen, once
        it has seen one). None when every worker has its own, or nothing was seen. The
        median moves slowly, so it is computed at most every ``TYPICAL_EVERY_S`` while
        the learned set is the same."""
        learned = [m for m in models if m.observations >= LEARNED_AFTER]
        if len(learned) == len(models):
            return None
        if not learned:
            return self.pooled_prefill if self.pooled_prefill.observations else None
        cached = self._typical
        if cached is not None and cached[0] > now and cached[1] == len(learned):
            return cached[2]
        typical = PrefillModel(
            rate=statistics.median(m.rate for m in learned),
            overhead=statistics.median(m.overhead for m in learned),
        )
        self._typical = (now + TYPICAL_EVERY_S, len(learned), typical)
        return typical

    def models(self) -> set[str]:
        """Every model id an up worker serves: base models and LoRA adapters."""
        out: set[str] = set()
        for s in self.workers.values():
            if s.status == "up":
                out |= s.models
                if s.model:
                    out.add(s.model)
        return out

    def context_tokens(self) -> int | None:
        """The longest prompt an up worker takes: its ``max_model_len``, from its info (a
        kvpool worker) or its ``/v1/models`` card (vLLM); ``None`` while no worker said.
        Asked by every request: computed once per change of the workers (:meth:`changed_roster`),
        not per request."""
        if self._context is _STALE:
            self._context = self._longest_context()
        return self._context

    def changed_roster(self) -> None:
        """A worker joined or left, went up or down, or told its models: what the pool
        derives from all of them is computed again when next asked."""
        self._context = _STALE

    def _longest_context(self) -> int | None:
        lengths = []
        for s in self.workers.values():
            if s.status == "up":
                if s.info is not None:
                    lengths.append(s.info.max_model_len)
                lengths += [
                    n
                    for c in s.cards
                    if isinstance(n := c.get("max_model_len"), int) and not isinstance(n, bool)
                ]
        return max(lengths, default=None)

    def model_cards(self) -> list[dict[str, Any]]:
        """The up workers' ``/v1/models`` cards, one per id (the first seen), by id, each as
        its worker sent it (``parent``, ``root``, ``max_model_len`` and all)."""
        cards: dict[str, dict[str, Any]] = {}
        for s in self.workers.values():
            if s.status == "up":
                for card in s.cards:
                    cards.setdefault(card["id"], card)
        return [dict(cards[k]) for k in sorted(cards)]

    def adapters(self) -> dict[str, str | None]:
        """LoRA adapters the up workers serve, each with the path it was loaded from: vLLM
        lists one with its base as ``parent`` and the path as ``root``, and hashes its
        blocks with both (a worker that names another path is taken at the first seen)."""
        out: dict[str, str | None] = {}
        for s in self.workers.values():
            if s.status == "up":
                for c in s.cards:
                    if c.get("parent") is not None and c["parent"] != c["id"]:
                        root = c.get("root")
                        out.setdefault(c["id"], root if isinstance(root, str) else None)
        return out

    def routable(self) -> list[WorkerState]:
        return [s for s in self.workers.values() if s.routable]

    # -- the other router replicas ----------------------------------------------------------

    def share_with(self, peers: Any) -> None:
        """Tell ``peers`` (a :class:`router.state.peers.PeerLink`) this router's load and
        speculations from now on."""
        self.peers = self.feed.peers = peers
        for state in self.workers.values():
            state.on_load = self._own_load_changed

    def _own_load_changed(self, state: WorkerState) -> None:
        if self.peers is not None:
            self.peers.load_changed(
                state.id, state.in_flight, state.queued_tokens(time.monotonic()), state.prefilling
            )

    def own_rows(self) -> dict[str, tuple[int, int, int]]:
        """This router's load on every worker: (requests in flight, prompt tokens queued,
        requests still waiting for their first token)."""
        now = time.monotonic()
        return {
            s.id: (s.in_flight, s.queued_tokens(now), s.prefilling) for s in self.workers.values()
        }

    def peer_load(
        self, worker_id: str, in_flight: int, queued_tokens: int, prefilling: int
    ) -> None:
        """The other replicas' load on a worker, summed (kept for a worker not seen yet)."""
        self._peer_load[worker_id] = (in_flight, queued_tokens, prefilling)
        state = self.workers.get(worker_id)
        if state is not None:
            state.peer_in_flight, state.peer_queued = in_flight, queued_tokens
            state.peer_prefilling = prefilling
