"""The router's workers: registration, health, load, circuit breakers and event streams.

For each worker the pool keeps what the policy needs at decision time (a
:class:`~kvpool.router.policy.WorkerView`) and three background tasks:

* **health**: ``GET /health`` every ``health_interval_s``. A refused connection or no
  answer within ``health_timeout_s`` takes the worker out of rotation and drops its index
  entries (a dead worker's cache is gone); a 503 (loading or draining) takes it out of
  rotation only. When it answers 200 again it is registered again: ``GET /kvpool/info``
  tells block size, hash seed, model and event endpoints. A worker whose block size or hash
  seed differ from the router's is kept, but scored without cache credit, and reported.
  A worker without ``/kvpool/info`` (vLLM) is taken to share the router's hashing, the way
  an operator deploys them, with its model from ``/v1/models``.
* **load**: ``GET /metrics`` every ``scrape_interval_s``: KV cache usage and waiting
  requests, under vLLM's metric names.
* **events**: a :class:`~kvpool.kv_events.EventSubscriber` feeding the block index; a
  lost stretch of events clears that worker's entries (never a silently wrong index).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpool.hashing import HASH_ALGORITHM
from kvpool.kv_events import EventSubscriber, Received
from kvpool.openai_api import WorkerInfo

from .discovery import WorkerEndpoint
from .index import BlockIndex
from .policy import PrefillModel, WorkerView

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
class Ticket:
    """One request's claim on a worker's load, from routing to its end."""

    worker: str
    tokens: int  # uncached prompt tokens it brings to the worker's prefill queue
    queued_ahead: int  # prompt tokens queued there before it
    routed_at: float
    expires_at: float  # when its tokens stop counting as queued if no first token is seen
    learn: bool = True  # its TTFT measures the worker's prefill (not a decode leg's pull)
    first_token_seen: bool = False
    ended: bool = False


@dataclass
class WorkerState:
    endpoint: WorkerEndpoint
    status: str = "registering"  # registering, up, unavailable (503), down
    info: WorkerInfo | None = None
    model: str | None = None
    compatible: bool = True
    mismatch: str | None = None
    in_flight: int = 0
    queued: dict[int, Ticket] = field(default_factory=dict)
    prefill: PrefillModel = field(default_factory=PrefillModel)
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    scraped_at: float | None = None
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    subscriber: EventSubscriber | None = None
    events_task: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    events_seen: int = 0
    # counted here, exported by the metrics collector: a removed worker's series go with it
    decisions: Counter[str] = field(default_factory=Counter)  # by reason
    mismatches: int = 0

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def routable(self) -> bool:
        return self.status == "up" and not self.endpoint.draining

    def queued_tokens(self, now: float) -> int:
        stale = [k for k, t in self.queued.items() if t.expires_at <= now]
        for k in stale:
            del self.queued[k]
        return sum(t.tokens for t in self.queued.values())

    def view(self, now: float, max_load_age: float = 3.0) -> WorkerView:
        # Load the scrape has not confirmed lately is not known: neither a reason to avoid
        # the worker (a last reading of a full cache) nor to prefer it.
        fresh = self.scraped_at is not None and now - self.scraped_at <= max_load_age
        return WorkerView(
            id=self.id,
            role=self.endpoint.role,
            model=self.model,
            healthy=self.status == "up",
            draining=self.endpoint.draining,
            breaker_open=self.breaker.is_open(now),
            compatible=self.compatible,
            in_flight=self.in_flight,
            queued_tokens=self.queued_tokens(now),
            kv_usage=self.kv_usage if fresh else None,
            waiting=None if self.waiting is None or not fresh else int(self.waiting),
            prefill=self.prefill,
        )

    # -- a request's life on this worker --------------------------------------------------

    def begin(
        self, tokens: int, predicted_ttft: float, now: float, *, learn: bool = True
    ) -> Ticket:
        """``learn=False``: a decode leg, whose first token waits for a block transfer as
        well as for its prefill, so its TTFT would teach the prefill model wrong."""
        ticket = Ticket(
            worker=self.id,
            tokens=tokens,
            queued_ahead=self.queued_tokens(now),
            routed_at=now,
            # A non-streamed answer shows no first token: its tokens leave the queue when
            # they should have been prefilled (twice the prediction, at least 2 s).
            expires_at=now + max(2 * predicted_ttft, 2.0),
            learn=learn,
        )
        self.in_flight += 1
        self.queued[id(ticket)] = ticket
        return ticket

    def first_token(self, ticket: Ticket, now: float) -> float:
        """Record the first token; returns the TTFT seen from the router."""
        ttft = now - ticket.routed_at
        if not ticket.first_token_seen:
            ticket.first_token_seen = True
            self.queued.pop(id(ticket), None)
            if ticket.learn:
                self.prefill.observe(ticket.queued_ahead + ticket.tokens, ttft)
        return ttft

    def end(self, ticket: Ticket) -> None:
        if not ticket.ended:
            ticket.ended = True
            self.in_flight -= 1
            self.queued.pop(id(ticket), None)


@dataclass
class PoolConfig:
    block_size: int
    hash_seed: str
    served_model_name: str | None = None
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    scrape_interval_s: float = 1.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0


#: TTFTs seen before a worker's own prefill model is trusted over its peers'
LEARNED_AFTER = 8


class WorkerPool:
    """The workers the router knows, kept current by discovery and by their own answers."""

    def __init__(
        self,
        config: PoolConfig,
        index: BlockIndex,
        client: aiohttp.ClientSession,
        *,
        on_event_lag: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self.index = index
        self.client = client
        self.workers: dict[str, WorkerState] = {}
        self._on_event_lag = on_event_lag
        self.changed = asyncio.Event()  # set when a worker becomes routable

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
        state = WorkerState(endpoint=endpoint)
        state.breaker = CircuitBreaker(self.config.breaker_failures, self.config.breaker_cooldown_s)
        self.workers[endpoint.id] = state
        state.tasks.append(asyncio.create_task(self._health_loop(state)))
        state.tasks.append(asyncio.create_task(self._scrape_loop(state)))
        log.info("worker %s added: %s (%s)", endpoint.id, endpoint.url, endpoint.role)

    def _remove(self, wid: str) -> None:
        state = self.workers.pop(wid)
        self._stop_events(state)
        for task in state.tasks:
            task.cancel()
        if wid in self.index.workers():
            self.index.remove_worker(wid)
        log.info("worker %s removed", wid)

    async def close(self) -> None:
        tasks = [t for s in self.workers.values() for t in [*s.tasks, s.events_task] if t]
        for wid in list(self.workers):
            self._remove(wid)
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- views for the policy -------------------------------------------------------------

    def views(self, now: float | None = None) -> list[WorkerView]:
        now = time.monotonic() if now is None else now
        max_age = 3 * self.config.scrape_interval_s
        views = [s.view(now, max_age) for s in self.workers.values()]
        # A worker the router has not yet seen prefill is assumed to be like its peers
        # (same model, same hardware), not like the static prior: a prior slower than
        # the pool would keep a new or idle worker out of rotation for good.
        learned = [v.prefill for v in views if v.prefill.observations >= LEARNED_AFTER]
        if learned and len(learned) < len(views):
            typical = PrefillModel(
                rate=statistics.median(m.rate for m in learned),
                overhead=statistics.median(m.overhead for m in learned),
            )
            for v in views:
                if v.prefill.observations < LEARNED_AFTER:
                    v.prefill = typical
        return views

    def models(self) -> set[str]:
        return {s.model for s in self.workers.values() if s.model and s.status == "up"}

    def routable(self) -> list[WorkerState]:
        return [s for s in self.workers.values() if s.routable]

    # -- health and registration ----------------------------------------------------------

    def mark_down(self, state: WorkerState, why: str) -> None:
        """Out of rotation now, and its index entries dropped (its cache went with it)."""
        if self.workers.get(state.id) is not state:
            return  # removed, or replaced under the same id: that one is not down
        if state.status != "down":
            log.warning("worker %s is down: %s", state.id, why)
        state.kv_usage = state.waiting = state.running = state.scraped_at = None
        state.status = "down"
        self._stop_events(state)
        if state.id in self.index.workers():
            self.index.clear_worker(state.id)

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
        """A GET within the health timeout: the status and the body."""
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        async with self.client.get(url, timeout=timeout) as resp:
            return resp.status, await resp.read()

    async def _check_health(self, state: WorkerState) -> None:
        try:
            status, _ = await self._get(state.url + "/health")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.mark_down(state, f"/health: {type(exc).__name__} {exc}".strip())
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
                state.model = await self._served_model(state)
            else:
                _raise_for_status("/kvpool/info", status)
                info = WorkerInfo.model_validate_json(body)
                state.model = info.served_model_name
        except Exception as exc:  # whatever answers there is not a worker we understand
            log.warning("worker %s: registration failed: %s", state.id, exc)
            return
        state.info = info
        state.mismatch = self._mismatch(info)
        state.compatible = state.mismatch is None
        if state.mismatch:
            log.error(
                "worker %s: %s; it gets requests but no cache credit", state.id, state.mismatch
            )
            state.mismatches += 1
        events = self._events_endpoints(state)
        if state.id not in self.index.workers():
            self.index.add_worker(state.id, tracked=events is not None)
        if events is not None and state.compatible:
            self._start_events(state, *events)
        state.status = "up"
        self.changed.set()
        log.info(
            "worker %s is up: model %s, %s",
            state.id,
            state.model,
            "KV events " + events[0] if events else "no KV events (approximate tracking)",
        )

    async def _served_model(self, state: WorkerState) -> str | None:
        status, body = await self._get(state.url + "/v1/models")
        _raise_for_status("/v1/models", status)
        data = json.loads(body).get("data") or []
        return data[0]["id"] if data else None

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

    @staticmethod
    def _events_endpoints(state: WorkerState) -> tuple[str, str | None, str] | None:
        e = state.endpoint
        if e.kv_events_endpoint:
            return e.kv_events_endpoint, e.kv_events_replay_endpoint, ""
        if state.info is not None and state.info.kv_events is not None:
            ev = state.info.kv_events
            return ev.endpoint, ev.replay_endpoint, ev.topic
        return None

    # -- KV events ------------------------------------------------------------------------

    def _start_events(
        self, state: WorkerState, endpoint: str, replay: str | None, topic: str
    ) -> None:
        self._stop_events(state)
        sub = EventSubscriber(
            endpoint,
            replay,
            topic=topic,
            # With a replay buffer, start from its beginning: the blocks it stored before
            # the router came are indexed too.
            start_seq=0 if replay else None,
            name=state.id,
        )
        state.subscriber = sub
        state.events_task = asyncio.create_task(self._events_loop(state, sub))

    def _stop_events(self, state: WorkerState) -> None:
        sub, state.subscriber = state.subscriber, None
        task, state.events_task = state.events_task, None
        if task is not None:
            task.cancel()
        if sub is not None:
            sub.close()

    async def _events_loop(self, state: WorkerState, sub: EventSubscriber) -> None:
        try:
            async for item in sub.start():
                if state.subscriber is not sub:
                    return
                if isinstance(item, Received):
                    self.index.apply(state.id, item.batch)
                    state.events_seen += len(item.batch.events)
                    # A replayed batch is late by design: its lag says nothing.
                    if self._on_event_lag and item.batch.ts > 0 and not item.replayed:
                        self._on_event_lag(time.time() - item.batch.ts)
                else:  # events were lost: what the index says of this worker may be wrong
                    self.index.clear_worker(state.id)
        except asyncio.CancelledError:
            raise
        except Exception:  # the stream is lost, not the router: start it again
            log.exception("worker %s: KV event stream failed; restarting it", state.id)
            self.index.clear_worker(state.id)
            await asyncio.sleep(1.0)
            if state.subscriber is sub and state.status == "up":
                state.subscriber = state.events_task = None  # this task ends here
                self._start_events(state, sub.endpoint, sub.replay_endpoint, sub.topic.decode())
        finally:
            sub.close()

    # -- load -----------------------------------------------------------------------------

    async def _scrape_loop(self, state: WorkerState) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.scrape_interval_s)
            if state.status != "up":
                continue
            try:
                status, body = await self._get(state.url + "/metrics")
                _raise_for_status("/metrics", status)
                values = await asyncio.to_thread(parse_load, body.decode(errors="replace"))
            except Exception as exc:  # no load reading this time; it goes stale, then unknown
                log.debug("worker %s: /metrics: %s", state.id, exc)
                continue
            state.kv_usage = values.get("vllm:kv_cache_usage_perc")
            state.waiting = values.get("vllm:num_requests_waiting")
            state.running = values.get("vllm:num_requests_running")
            state.scraped_at = time.monotonic()


def _raise_for_status(path: str, status: int) -> None:
    if status >= 400:
        raise ValueError(f"{path} answered {status}")


LOAD_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
)


def parse_load(text: str) -> dict[str, float]:
    """The load gauges of a worker's Prometheus text, summed over label sets (a worker
    serves one model, but a data-parallel vLLM reports one series per engine); the KV
    usage is the highest engine's."""
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in LOAD_METRICS:
            continue
        # A NaN or an infinity says nothing about load: such samples are left out.
        values = [
            s.value for s in family.samples if s.name == family.name and math.isfinite(s.value)
        ]
        if not values:
            continue
        out[family.name] = max(values) if family.name.endswith("_perc") else sum(values)
    return out
