"""The router's workers: membership, registration, health, scraping and circuit breakers.

For each worker the pool keeps what the policy needs at decision time (a
:class:`~kvpool.router.policy.WorkerView`) and three background tasks:

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
  (:class:`~kvpool.router.feed.IndexFeed`), and the cost model, the worker's load
  (:class:`~kvpool.router.load.WorkerLoad`).

A worker that goes down takes its in-flight attempts with it: each is told to abort, so a
request still waiting on a hung worker for its first token is retried elsewhere at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from kvpool.cost import COST
from kvpool.hashing import HASH_ALGORITHM
from kvpool.kv_events import EventSubscriber, RankedSubscriber
from kvpool.openai_api import WorkerInfo
from kvpool.signing import kv_events_credential
from kvpool.stall import LoopClock

from .agreement import AgreementConfig, CacheAgreement
from .discovery import WorkerEndpoint
from .feed import IndexFeed
from .index import BlockIndex
from .load import PrefillModel, WorkerLoad
from .policy import WorkerView

log = logging.getLogger(__name__)


@dataclass
class CircuitBreaker:
    """Opens after ``threshold`` failures in a row; after ``cooldown`` one trial request is
    let through (half-open): its success closes the breaker, its failure opens it again. A
    trial that ends with neither (a 4xx, a 429, the client gone) keeps it open for one more
    cooldown, then lets another trial through."""

    threshold: int = 3
    cooldown: float = 5.0
    failures: int = 0
    open_until: float = 0.0

    def is_open(self, now: float) -> bool:
        return self.failures >= self.threshold and now < self.open_until

    def on_attempt(self, now: float) -> None:
        if self.failures >= self.threshold and now >= self.open_until:
            self.open_until = now + self.cooldown  # the half-open trial: no other meanwhile

    def on_success(self) -> None:
        self.failures = 0

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = now + self.cooldown


@dataclass
class WorkerState(WorkerLoad):
    """A worker as the pool keeps it: where it is, whether it is up and compatible, what
    it serves, its event stream, and (from :class:`~.load.WorkerLoad`) its load."""

    endpoint: WorkerEndpoint
    # registering, syncing (its KV event history is being replayed), up, unavailable (503),
    # down
    status: str = "registering"
    info: WorkerInfo | None = None
    model: str | None = None  # the base model
    models: frozenset[str] = frozenset()  # every id at /v1/models: base and LoRA adapters
    cards: list[dict[str, Any]] = field(default_factory=list)  # /v1/models' data, as sent
    compatible: bool = True
    mismatch: str | None = None
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    #: of the requests it reported waiting at the last scrape, how many no router knew to
    #: be waiting for a first token there then (sent by someone else, or preempted)
    unaccounted_waiting: int = 0
    #: how many requests it takes at once: a kvpool worker's max_num_seqs from its info, a
    #: vLLM worker's from its deployment (``max-num-seqs=``, the pod's annotation), or the
    #: most it was seen running while others waited (vLLM's max_num_seqs, or what its KV
    #: cache holds); None until then
    batch_capacity: int | None = None
    batch_announced: bool = False  # batch_capacity is the worker's max_num_seqs, as told
    scraped_at: float | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    subscriber: EventSubscriber | RankedSubscriber | None = None
    #: its engines' data-parallel ranks, each publishing its own KV event stream (a vLLM
    #: started with --data-parallel-size lists them in vllm:cache_config_info)
    engines: tuple[int, ...] = (0,)
    events_task: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    events_seen: int = 0
    tracked: bool = False  # publishes KV events
    dp_ranks: dict[int, str] = field(default_factory=dict)  # rank > 0 -> its index id
    # the router's attempts in flight here: each has ``abort(reason)``, called when it goes down
    attempts: set[Any] = field(default_factory=set)
    # counted here, exported by the metrics collector: a removed worker's series go with it
    decisions: Counter[str] = field(default_factory=Counter)  # by reason
    mismatches: int = 0
    cache_flags: int = 0  # times its answers' cached tokens were found to disagree
    #: its answers' cached tokens against the index's predictions (None: not checked)
    agreement: CacheAgreement | None = None

    @property
    def credited(self) -> bool:
        """Whether its blocks earn cache credit: it hashes as the router does (by its own
        word at registration) and its answers have not shown otherwise."""
        return self.compatible and not (self.agreement is not None and self.agreement.flagged)

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def routable(self) -> bool:
        return self.status == "up" and not self.endpoint.draining

    def view(self, now: float, max_load_age: float = 3.0) -> WorkerView:
        # Load the scrape has not confirmed lately is not known: neither a reason to avoid
        # the worker (a last reading of a full cache) nor to prefer it. Every decision
        # asks every worker: fields in WorkerView's order, positionally (keywords cost a
        # fifth more at 64 workers).
        fresh = self.scraped_at is not None and now - self.scraped_at <= max_load_age
        endpoint = self.endpoint
        up = self.status == "up"
        own = self.in_flight
        return WorkerView(
            endpoint.id,
            endpoint.role,
            self.model,
            self.models,
            up,
            endpoint.draining,
            self.breaker.is_open(now),
            self.credited,
            self.in_flight + self.peer_in_flight,
            self.queued_tokens(now) + self.peer_queued,
            self.kv_usage if fresh else None,
            self.unaccounted_waiting if fresh else 0,
            self.prefill,
            self.batch_capacity,
            self.batch_announced,
            self.active_tokens,
            self.active_tokens / own if own else 0.0,
        )

    def set_models(self, cards: list[dict[str, Any]]) -> None:
        """Take a worker's ``/v1/models`` cards. The base model is kvpool's own word when it
        has one, else vLLM's base card (the one without a ``parent``), else the first."""
        self.cards = cards
        ids = [c["id"] for c in cards]
        if self.info is not None:
            self.model = self.info.served_model_name
            ids.append(self.info.served_model_name)
        else:
            base = next((c["id"] for c in cards if c.get("parent") is None), None)
            self.model = base if base is not None else (ids[0] if ids else None)
        self.models = frozenset(ids)


@dataclass
class PoolConfig:
    block_size: int
    hash_seed: str
    served_model_name: str | None = None
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    scrape_interval_s: float = 1.0
    models_interval_s: float = 10.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    # each worker's last answers whose cached tokens are checked against the index's
    # predictions (0: not checked), and the agreement under which it loses cache credit
    cache_check_answers: int = 32
    cache_check_flag_below: float = 0.25
    # the longest a registering worker waits out of rotation for its KV event history
    # (the publisher's replay buffer) to be in the index
    index_sync_timeout_s: float = 30.0
    # the pool secret shared with kvpool workers: their KV event sockets want the
    # credential derived from it (never logged)
    pool_secret: str | None = field(default=None, repr=False)


#: TTFTs seen before a worker's own prefill model is trusted over its peers'
LEARNED_AFTER = COST.learned_after
#: where the prefill model routing uses for a worker comes from: see prefill_models
PrefillSource = Literal["own", "median", "pool", "prior"]
#: how long the pool's typical prefill model (the median of the learned ones) is reused
TYPICAL_EVERY_S = COST.typical_every_s


def _boot(info: WorkerInfo) -> str:
    """What names a worker's process: its boot id, or for a release without one its KV
    transfer engine id (also new at each start)."""
    return info.boot_id or info.kv_transfer_engine_id


class WorkerPool:
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
        #: the other router replicas (router.peers.PeerLink), when there are any
        self.peers: Any = None
        self._peer_load: dict[str, tuple[int, int, int]] = {}  # worker -> the peers' sums

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
        state.tasks.append(asyncio.create_task(self._health_loop(state)))
        state.tasks.append(asyncio.create_task(self._scrape_loop(state)))
        state.tasks.append(asyncio.create_task(self._models_loop(state)))
        log.info("worker %s added: %s (%s)", endpoint.id, endpoint.url, endpoint.role)

    def _remove(self, wid: str) -> None:
        state = self.workers.pop(wid)
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
        kvpool worker) or its ``/v1/models`` card (vLLM); ``None`` while no worker said."""
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

    # -- health and registration ----------------------------------------------------------

    def mark_down(self, state: WorkerState, why: str, *, dead: bool = False) -> None:
        """Out of rotation now. Its index entries and its event stream stay: failing a
        check is no evidence that its cache is gone (see the module's docstring). The
        attempts in flight on it are aborted (a hung worker answers them never) when it is
        ``dead`` (its connections are refused) or fails a second check in a row: one slow
        health check of a busy worker must not send all its requests to the others."""
        if self.workers.get(state.id) is not state:
            return  # removed, or replaced under the same id: that one is not down
        was_down = state.status == "down"
        if not was_down:
            log.warning("worker %s is down: %s", state.id, why)
        state.kv_usage = state.waiting = state.running = state.scraped_at = None
        state.unaccounted_waiting = 0
        state.itl_totals = None  # a restarted worker counts from zero again
        state.status = "down"
        if dead and not state.tracked:
            # No events to show a restart: its entries are the router's own guesses, and a
            # refused connection says the process they were about is gone.
            self.feed.clear(state)
        if dead or was_down:
            self._abort_attempts(state, why)

    @staticmethod
    def _abort_attempts(state: WorkerState, why: str) -> None:
        for attempt in list(state.attempts):
            try:
                attempt.abort(f"worker {state.id} down: {why}")
            except Exception:  # one attempt's bug must not spare the others
                log.exception("worker %s: aborting an attempt failed", state.id)

    async def _health_loop(self, state: WorkerState) -> None:
        cfg = self.config
        while True:
            try:
                await self._check_health(state)
            except Exception:  # a surprise must not freeze the worker in its last status
                log.exception("worker %s: health check failed", state.id)
                self.mark_down(state, "health check failed")
            await asyncio.sleep(cfg.health_interval_s)

    async def _get(self, url: str) -> tuple[int, bytes]:
        """A GET within the health timeout (of the router's responsive time): the status
        and the body."""
        return await self.clock.within(self._get_now(url), self.config.health_timeout_s)

    async def _get_now(self, url: str) -> tuple[int, bytes]:
        untimed = aiohttp.ClientTimeout(total=None, connect=None)  # timed by the caller
        async with self.client.get(url, timeout=untimed) as resp:
            return resp.status, await resp.read()

    async def _check_health(self, state: WorkerState) -> None:
        try:
            status, _ = await self._get(state.url + "/health")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            refused = isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(
                exc, aiohttp.ServerTimeoutError
            )
            self.mark_down(state, f"/health: {type(exc).__name__} {exc}".strip(), dead=refused)
            return
        if status == 200:
            if state.status != "up":
                await self._register(state)
        elif state.status == "up":
            log.warning("worker %s answers /health %d", state.id, status)
            state.status = "unavailable"
        elif state.status == "registering":
            state.status = "unavailable"

    async def _register(self, state: WorkerState) -> None:
        try:
            status, body = await self._get(state.url + "/kvpool/info")
            if status == 404:
                info = None
                cards = await self._model_cards(state)
            else:
                _raise_for_status("/kvpool/info", status)
                info = WorkerInfo.model_validate_json(body)
                try:
                    cards = await self._model_cards(state)
                except Exception as exc:  # its info names its model; adapters come later
                    log.warning("worker %s: /v1/models: %s", state.id, exc)
                    cards = [{"id": info.served_model_name, "object": "model"}]
        except Exception as exc:  # whatever answers there is not a worker we understand
            log.warning("worker %s: registration failed: %s", state.id, exc)
            if state.status == "registering":
                state.status = "unavailable"  # not in rotation, and known not to be coming
            return
        if info is not None and state.info is not None and _boot(info) != _boot(state.info):
            # Another process under the same address: what the last one held is gone.
            log.warning("worker %s restarted (a new boot id): its index entries go", state.id)
            self.feed.forget(state, remove=False)
        state.info = info
        if state.agreement is not None:
            state.agreement.restarted()
        state.set_models(cards)
        vllm_cache = await self._vllm_cache_config(state) if info is None else None
        if info is not None:
            state.engines = (0,)
        elif vllm_cache is not None:  # (not read this time: the ranks it had stay)
            state.engines = _engines(vllm_cache)
        slots = info.max_num_seqs if info is not None else None
        if slots is None and state.endpoint.max_num_seqs is not None:
            # its deployment's word (vLLM says it nowhere): vLLM's --max-num-seqs is per
            # engine, and a data-parallel vLLM runs one engine per rank
            slots = state.endpoint.max_num_seqs * len(state.engines)
        if slots is not None:  # before any scrape
            state.batch_capacity = slots
            state.batch_announced = True
        first = vllm_cache[0] if vllm_cache else None
        state.mismatch = self._mismatch(info) or self._vllm_mismatch(first)
        state.compatible = state.mismatch is None
        if state.mismatch:
            log.error(
                "worker %s: %s; it gets requests but no cache credit", state.id, state.mismatch
            )
            state.mismatches += 1
        events = self._events_endpoints(state)
        state.tracked = events is not None
        if state.subscriber is not None and (events is None or not state.compatible):
            self.feed.forget(state, remove=False)  # its stream is no longer to be read
        self.feed.track(state)
        ranks = state.engines
        if events is not None and state.compatible and self.feed.streaming(state, *events, ranks):
            pass  # its stream ran on while it was out: nothing was lost, nothing to replay
        elif events is not None and state.compatible:
            secret = self.config.pool_secret
            # Only a kvpool worker (it has /kvpool/info) checks the credential; a vLLM
            # publisher speaks ZMQ's NULL mechanism and would refuse one.
            credential = kv_events_credential(secret) if secret and state.info else None
            self.feed.start(state, *events, credential, ranks)
            state.status = "syncing"
            started = time.monotonic()
            if not await self.feed.caught_up(state, self.config.index_sync_timeout_s):
                log.warning(
                    "worker %s: its KV event history did not replay within %.0f s; it is in "
                    "rotation before its index caught up",
                    state.id,
                    self.config.index_sync_timeout_s,
                )
            elif state.events_seen:
                log.info(
                    "worker %s: %d KV events of its history replayed in %.2f s",
                    state.id,
                    state.events_seen,
                    time.monotonic() - started,
                )
            if self.workers.get(state.id) is not state or state.status != "syncing":
                return  # removed, or taken down, while it synced
        state.status = "up"
        self.changed.set()
        log.info(
            "worker %s is up: model %s, %s",
            state.id,
            state.model,
            "KV events " + events[0] if events else "no KV events (approximate tracking)",
        )

    async def _model_cards(self, state: WorkerState) -> list[dict[str, Any]]:
        """The worker's ``/v1/models`` cards; one without a string id is left out."""
        status, body = await self._get(state.url + "/v1/models")
        _raise_for_status("/v1/models", status)
        data = json.loads(body).get("data") or []
        if not isinstance(data, list):
            raise ValueError("/v1/models: data is not a list")
        return [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)]

    async def _models_loop(self, state: WorkerState) -> None:
        """Adapters come and go at run time (vLLM's ``/v1/load_lora_adapter``): read the
        list again now and then; a failed read keeps the last one."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.models_interval_s)
            if state.status != "up":
                continue  # registration reads it when the worker is back
            try:
                cards = await self._model_cards(state)
            except Exception as exc:
                log.debug("worker %s: /v1/models: %s", state.id, exc)
                continue
            if state.status != "up":
                continue  # went down meanwhile: registration reads it again
            before = state.models
            state.set_models(cards)
            if state.models != before:
                log.info(
                    "worker %s serves %s (was %s)",
                    state.id,
                    sorted(state.models),
                    sorted(before),
                )

    def _mismatch(self, info: WorkerInfo | None) -> str | None:
        cfg = self.config
        if info is None:
            return None
        problems = []
        if info.block_size != cfg.block_size:
            problems.append(f"block size {info.block_size}, the router's {cfg.block_size}")
        if info.hash_seed != cfg.hash_seed:
            problems.append(f"hash seed {info.hash_seed!r}, the router's {cfg.hash_seed!r}")
        if info.hash_algo != HASH_ALGORITHM:
            problems.append(f"hash {info.hash_algo}, the router's {HASH_ALGORITHM}")
        if cfg.served_model_name and info.served_model_name != cfg.served_model_name:
            problems.append(
                f"model {info.served_model_name!r}, the router tokenizes for "
                f"{cfg.served_model_name!r}"
            )
        return "; ".join(problems) or None

    async def _vllm_cache_config(self, state: WorkerState) -> list[dict[str, str]] | None:
        """The labels of a vLLM worker's ``vllm:cache_config_info`` (its block size, prefix
        caching and hash algorithm), one set per engine (data-parallel rank), or None where
        its ``/metrics`` has none."""
        try:
            status, body = await self._get(state.url + "/metrics")
            _raise_for_status("/metrics", status)
        except Exception as exc:  # checked again at the next registration
            log.debug("worker %s: /metrics: %s", state.id, exc)
            return None
        return info_label_sets(body.decode(errors="replace"), CACHE_CONFIG_INFO) or None

    def _vllm_mismatch(self, labels: dict[str, str] | None) -> str | None:
        """What a vLLM worker's cache configuration says the router would get wrong: vLLM
        does not say its hash seed, but its block size, prefix caching and hash are in
        ``vllm:cache_config_info``."""
        if not labels:
            return None
        cfg = self.config
        problems = []
        size = labels.get("hash_block_size", "None")
        size = labels.get("block_size", "None") if size == "None" else size
        if size.isdigit() and int(size) != cfg.block_size:
            problems.append(
                f"vLLM hashes blocks of {size} tokens, the router {cfg.block_size} "
                f"(start the router with --block-size {size})"
            )
        if labels.get("enable_prefix_caching") == "False":
            problems.append("vLLM runs without prefix caching (--enable-prefix-caching)")
        algo = labels.get("prefix_caching_hash_algo")
        if algo and algo != HASH_ALGORITHM:
            problems.append(
                f"vLLM hashes with {algo}, the router with {HASH_ALGORITHM} "
                f"(--prefix-caching-hash-algo {HASH_ALGORITHM})"
            )
        return "; ".join(problems) or None

    @staticmethod
    def _events_endpoints(state: WorkerState) -> tuple[str, str | None, str] | None:
        e = state.endpoint
        if e.kv_events_endpoint:
            return e.kv_events_endpoint, e.kv_events_replay_endpoint, ""
        if state.info is not None and state.info.kv_events is not None:
            ev = state.info.kv_events
            return ev.endpoint, ev.replay_endpoint, ev.topic
        return None

    def check_cache(self, state: WorkerState, predicted: int, reported: int | None) -> None:
        """An answer's ``reported`` cached prompt tokens against the ``predicted``: see
        :mod:`.agreement`. A verdict that changes counts in ``kvpool_router_worker_cache_flags``."""
        check = state.agreement
        if check is None or state.id not in self.workers:
            return
        events = self.feed.confirmations(state) if state.tracked else None
        if check.observe(predicted, reported, events) and check.flagged:
            state.cache_flags += 1

    # -- load -----------------------------------------------------------------------------

    async def _scrape_loop(self, state: WorkerState) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.scrape_interval_s)
            if state.status == "up":
                await self.scrape(state)

    async def scrape(self, state: WorkerState) -> bool:
        """One reading of a worker's load from its ``/metrics``: whether it came. A
        vLLM-size page costs the router ~0.4 ms of CPU a scrape, fetch included
        (``bench/scrape.py``): no thread hop needed."""
        # the requests routers know to be waiting for a first token there (decode legs, which
        # wait for a KV transfer in the worker's queue, too), as the page is read
        known = len(state.queued) + state.peer_prefilling
        try:
            status, body = await self._get(state.url + "/metrics")
            _raise_for_status("/metrics", status)
            values = parse_load(body.decode(errors="replace"))
        except Exception as exc:  # no load reading this time; it goes stale, then unknown
            log.debug("worker %s: /metrics: %s", state.id, exc)
            return False
        state.kv_usage = values.get("vllm:kv_cache_usage_perc")
        state.waiting = values.get("vllm:num_requests_waiting")
        state.running = values.get("vllm:num_requests_running")
        # counted against the more the routers knew of while the page was read: a request
        # whose first token came meanwhile was not waiting when the worker wrote it
        known = max(known, len(state.queued) + state.peer_prefilling)
        state.unaccounted_waiting = max(0, int(state.waiting or 0) - known)
        queueing = state.waiting and state.running and state.waiting >= 1
        if queueing and not state.batch_announced:
            state.batch_capacity = max(state.batch_capacity or 0, int(state.running or 0))
        state.scraped_at = time.monotonic()
        state.learn_itl(values.get(ITL_SUM), values.get(ITL_COUNT))
        return True

    # -- the other router replicas ----------------------------------------------------------

    def share_with(self, peers: Any) -> None:
        """Tell ``peers`` (a :class:`router.peers.PeerLink`) this router's load and
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


def _raise_for_status(path: str, status: int) -> None:
    if status >= 400:
        raise ValueError(f"{path} answered {status}")


LOAD_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
)
ITL_HISTOGRAM = "vllm:inter_token_latency_seconds"
ITL_SUM, ITL_COUNT = ITL_HISTOGRAM + "_sum", ITL_HISTOGRAM + "_count"


#: the series a scrape reads: the load gauges, and the ITL histogram's sum and count
SCRAPED_SERIES = (*LOAD_METRICS, ITL_SUM, ITL_COUNT)


CACHE_CONFIG_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_label_sets(text: str, name: str) -> list[dict[str, str]]:
    """The labels of every sample of an info gauge in Prometheus text (a data-parallel
    vLLM writes one per engine)."""
    return [
        dict(_LABEL.findall(rest[: rest.rfind("}") + 1]))
        for rest in _sample_lines(text, name)
        if rest.startswith("{")
    ]


def _engines(labels: list[dict[str, str]] | None) -> tuple[int, ...]:
    """The data-parallel ranks a vLLM's ``vllm:cache_config_info`` names (its ``engine``
    label); rank 0 alone where it names none."""
    ranks = {int(e) for series in labels or () if (e := series.get("engine", "")).isdecimal()}
    return tuple(sorted(ranks)) or (0,)


def parse_load(text: str) -> dict[str, float]:
    """The load gauges of a worker's Prometheus text, summed over label sets (a worker
    serves one model, but a data-parallel vLLM reports one series per engine); the KV
    usage is the highest engine's. Also the inter-token latency histogram's ``_sum`` and
    ``_count``, summed over label sets: their growth between two scrapes gives the mean
    time per output token meanwhile.

    Only the lines of :data:`SCRAPED_SERIES` are read, found with ``str.find``: a vLLM page
    is thousands of lines, mostly histogram buckets, and parsing it whole took ~10 ms a
    scrape (a core at 100 workers); finding five series takes tens of microseconds."""
    out: dict[str, float] = {}
    for name in SCRAPED_SERIES:
        # A NaN or an infinity says nothing about load: such samples are left out.
        values = [v for v in _sample_values(text, name) if math.isfinite(v)]
        if values:
            out[name] = max(values) if name.endswith("_perc") else sum(values)
    return out


def _sample_lines(text: str, name: str) -> Iterator[str]:
    """What follows ``name`` on each line of Prometheus text that begins with it (its
    labels and value, or a longer name's rest: the caller tells)."""
    n, start = len(name), 0
    while (i := text.find(name, start)) >= 0:
        start = i + n
        if i and text[i - 1] != "\n":
            continue  # within a line: a comment, or a name that ends with this one
        end = text.find("\n", i)
        yield text[i + n : end if end >= 0 else len(text)]


def _sample_values(text: str, name: str) -> Iterator[float]:
    """The values of the samples of one series in Prometheus text: lines that begin with
    ``name``, then labels in braces or a space (not a longer name, not a comment)."""
    for rest in _sample_lines(text, name):
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :] if "}" in rest else ""
        elif not rest.startswith((" ", "\t")):
            continue  # a longer name
        fields = rest.split()
        if fields:
            try:
                yield float(fields[0])
            except ValueError:
                continue
