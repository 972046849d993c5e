"""One worker as the router's pool keeps it (:class:`WorkerState`: where it is, whether it
is up and compatible, what it serves, and its load), its circuit breaker, and the pool's
settings."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpool.cost import COST
from kvpool.kv_events import EventSubscriber, RankedSubscriber
from kvpool.openai_api import WorkerInfo

from ..routing.inputs import WorkerView
from .agreement import CacheAgreement
from .discovery import WorkerEndpoint
from .load import WorkerLoad

__all__ = ["LEARNED_AFTER", "CircuitBreaker", "PoolConfig", "PrefillSource", "WorkerState"]


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
