"""Admission: who may send a request, how much, and when it goes to a worker.

Between reading a request and sending it on, the router asks three things in turn:

1. **Who sends it.** With a tenants file (``--api-keys-file``), ``Authorization: Bearer``
   names a tenant, or the request gets 401 before its body is read.
2. **Is the tenant within its limits.** Requests per second before the body is read;
   tokens per minute (the prompt plus ``max_tokens``, settled with the real usage when the
   answer ends) once it is tokenized. Over either: 429 with ``Retry-After`` and OpenAI's
   ``x-ratelimit-*`` headers.
3. **Can the pool take it now.** The pool is saturated for a request when every worker
   that could serve it predicts a time to first token over ``saturation_ttft_s`` or trips
   its decode guard (:func:`.policy.saturation`), or the router's concurrency bound is
   reached. Sending it anyway would only lengthen a worker's queue, where a high-priority
   request waits behind a batch job. So it waits here instead: in priority bands served
   strictly in order, tenants within a band served fairly by tokens (:mod:`.flow`),
   bounded in count and bytes. A request whose deadline (a header, or its tenant's TTFT
   SLO) the predicted wait already passes is shed at once with 503 and ``Retry-After``,
   not after it times out.

The pure parts (keys, buckets, the fair queue) live in :mod:`.tenants` and :mod:`.flow`;
this module is their async shell: the waiting, the dispatcher, the request's slot, and
settling what a request reserved once it ends (:meth:`Gate.finish`, called exactly once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool import tracing
from kvpool.httpguard import client_address, connections_bound
from kvpool.openai_api import OpenAIError

from ..admin.metrics import RouterMetrics
from ..settings import RouterSettings
from .entries import Band, Entry, QueueRefused, parse_band, shed_error
from .flow import FairQueue
from .limits import RateLimiter, RateLimitExceeded
from .tenants import ANONYMOUS, AuthError, KeyStore, Tenant

log = logging.getLogger(__name__)

#: how often the dispatcher looks again at a saturated pool while requests wait (the
#: predictions change as first tokens come back, which sends no signal of its own)
DISPATCH_POLL_S = 0.01
#: the longest the dispatcher waits for a request it let go to reach a worker before it
#: asks about the next one (it is a few function calls away: routing, then its ticket)
PLACE_WAIT_S = 0.2
#: what a waiting request holds besides its body: its token ids and block keys (a Python
#: int in a list: 36 bytes, and the block keys), twice the body (the bytes and what was
#: parsed from them), and its connection, task and request objects
BYTES_PER_TOKEN = 48
BYTES_PER_REQUEST = 8 * 2**10


@dataclass
class Pass:
    """What one request holds from its admission to its end."""

    tenant: Tenant
    arrival: float
    band: str = "normal"
    span: Any = None
    slot: bool = False  # it counts against the router's concurrency bound
    reservation: Any = None  # tokens reserved from the tenant's tokens-per-minute bucket
    sent: bool = False  # some worker got it
    #: set once its load counts at a worker (its ticket began), or it ended without one
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    usage: dict[str, Any] | None = None
    #: x-ratelimit-* headers for the answer
    headers: dict[str, str] = field(default_factory=dict)
    waited_s: float | None = None
    cost: int = 0  # the tokens its band's fairness counted for it: settled with its usage
    error: str | None = None
    outcome: str | None = None  # how admission ended it: rate_limited or shed
    done: bool = False
    client: str | None = None  # counted in the per-client limit under this address

    def on_worker(self) -> None:
        """A worker has it now, and its load counts there: the dispatcher may ask about
        the next request."""
        self.sent = True
        self.placed.set()


class Gate:
    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        saturation: Callable[[Any, bool], str | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        s = self.settings = settings
        self.metrics = metrics
        #: (routed request, commit) -> why the pool cannot take it now. ``commit``: the
        #: request goes at once when the answer is None, so the routing decision behind the
        #: answer is the one it is sent by (asked again, it would be the same)
        self.saturation = saturation
        self.clock = clock
        self.keys = KeyStore.from_file(s.api_keys_file) if s.api_keys_file else None
        self.limiter = RateLimiter(clock=clock)
        self.queue = FairQueue(
            max_requests=max(s.queue_max_requests, 1),
            max_bytes=max(s.queue_max_bytes, 4096),
            on_shed=self._on_shed,
            clock=clock,
        )
        self.active = 0
        self.admitted = 0  # requests given a slot, since start (this process's)
        self.trusted = s.trusted_networks()
        self.max_concurrency = s.max_concurrency or connections_bound()
        #: requests in flight per client address, with --max-requests-per-client
        self.per_client: dict[str, int] = {}
        self.saturated_by: str | None = None  # why the pool was saturated when last asked
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None
        self._reloader: asyncio.Task[None] | None = None
        metrics.watch_queue(self.queue.depth_by_band)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self.keys is not None:
            self._reloader = asyncio.create_task(self._reload_keys())

    async def close(self) -> None:
        for task in (self._dispatcher, self._reloader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _reload_keys(self) -> None:
        """A mounted Secret changes in place: its keys are read again when it does."""
        assert self.keys is not None
        while True:
            await asyncio.sleep(self.settings.api_keys_reload_s)
            try:
                result = await asyncio.to_thread(self.keys.reload_if_changed)
            except Exception:
                log.exception("tenants: reading the keys file again failed; the old keys stay")
                continue
            if result.changed:
                log.info("tenants: the keys file changed: %d tenants", len(self.keys.tenants))
                self.limiter.prune(t.name for t in self.keys.tenants)

    # -- 1 and 2: who, and within which limits ---------------------------------------------

    @property
    def auth(self) -> bool:
        return self.keys is not None

    def tenant_of(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant the request's key names; 401 without one (the key is never echoed)."""
        if self.keys is None:
            return ANONYMOUS
        try:
            return self.keys.authenticate(headers.get("authorization"))
        except AuthError:
            self.metrics.requests.labels("unauthorized").inc()
            raise

    def require_admin(self, headers: Mapping[str, str]) -> None:
        """``/debug/*`` with auth on: an admin tenant's key, else 401 or 403."""
        if self.keys is None:
            return
        tenant = self.tenant_of(headers)
        if not tenant.admin:
            raise OpenAIError(
                403,
                f"tenant {tenant.name!r} is not an admin: /debug needs an admin key",
                type="permission_error",
                code="admin_required",
            )

    def enter(self, headers: Mapping[str, str], peer: str | None = None) -> Pass:
        """Before the body is read: the tenant, its requests-per-second limit, and the
        client address's requests in flight (``peer``: the connection's address)."""
        tenant = self.tenant_of(headers)
        p = Pass(tenant=tenant, arrival=self.clock())
        try:
            self._enter_client(p, headers, peer)  # first: a refusal spends none of the tenant's
            p.headers.update(self.limiter.admit_request(tenant))
        except RateLimitExceeded as exc:
            self._refused(p, exc.limit)
            self.finish(p)
            raise
        return p

    def _enter_client(self, p: Pass, headers: Mapping[str, str], peer: str | None) -> None:
        limit = self.settings.max_requests_per_client
        if limit is None or peer is None:
            return
        client = client_address(peer, headers, self.trusted, self.settings.client_address_header)
        held = self.per_client.get(client, 0)
        if held >= limit:
            raise RateLimitExceeded(
                "client", f"the client {client} has {held} requests in flight, its limit", 1.0, {}
            )
        self.per_client[client] = held + 1
        p.client = client

    def _refused(self, p: Pass, limit: str) -> None:
        self.metrics.requests.labels("rate_limited").inc()
        self.metrics.rate_limited.labels(p.tenant.name, limit).inc()
        p.outcome = "rate_limited"

    # -- 3: when ---------------------------------------------------------------------------

    def band_of(self, p: Pass, headers: Mapping[str, str]) -> Band:
        """The header's band (with auth, at most the tenant's class), else the tenant's."""
        asked = headers.get(self.settings.priority_header)
        if asked is None or not asked.strip():
            return p.tenant.band
        band = parse_band(asked.strip().lower(), self.settings.priority_header)
        # Without keys anyone may ask for any band; a tenant may lower its own, not raise it.
        return p.tenant.band_for(band) if self.auth else band

    def deadline_of(self, p: Pass, headers: Mapping[str, str]) -> float | None:
        """When the request must be on its way to a worker (absolute, on the gate's clock):
        a header's milliseconds from arrival, else its tenant's TTFT SLO, else never."""
        name = self.settings.deadline_header
        text = headers.get(name)
        if text:
            try:
                ms = float(text)
            except ValueError:
                ms = math.nan
            if not (math.isfinite(ms) and ms > 0):
                raise OpenAIError(
                    400,
                    f"{name}: milliseconds to the first token, a positive number",
                    code="invalid_deadline",
                    param=name,
                )
            return p.arrival + ms / 1000.0
        if p.tenant.ttft_slo_s is not None:
            return p.arrival + p.tenant.ttft_slo_s
        return None

    def admit_now(
        self, p: Pass, routed: Any, headers: Mapping[str, str], *, max_tokens: int, size: int
    ) -> Coroutine[Any, Any, None] | None:
        """Reserve the request's tokens, then take a slot now or a place in the queue: None
        when the request has its slot now, else its place, to be awaited at once (the
        caller watches for the client leaving meanwhile, which costs a task that most
        requests never need). An :class:`OpenAIError` (429, 503) otherwise."""
        s = self.settings
        band = self.band_of(p, headers)
        p.band = band.label
        deadline = self.deadline_of(p, headers)
        cost = routed.num_tokens + max_tokens
        try:
            admission = self.limiter.reserve_tokens(p.tenant, cost)
        except RateLimitExceeded as exc:
            self._refused(p, exc.limit)
            raise
        p.reservation = admission.reservation
        p.headers.update(admission.headers)
        if not s.flow_control:
            if self.active >= self.max_concurrency:
                self.metrics.requests.labels("overloaded").inc()
                raise OpenAIError(
                    429,
                    f"the router has {self.active} requests in flight, its limit",
                    type="rate_limit_error",
                    code="too_many_requests",
                    headers={"Retry-After": "1"},
                )
            self._take(p, band, cost)
            return
        # Behind those already waiting (fairness), or alone with the pool saturated.
        why = self.saturated_by if len(self.queue) else self._saturated(routed, commit=True)
        if why is None and not len(self.queue):
            self._take(p, band, cost)
            return
        # Every request that waits is counted, with why the pool last refused one.
        self.metrics.saturated.labels(why or "ttft").inc()
        now = self.clock()
        try:
            entry = self.queue.push(
                band,
                p.tenant.name,
                cost=cost,
                size=2 * size + BYTES_PER_TOKEN * routed.num_tokens + BYTES_PER_REQUEST,
                payload=(p, routed, cost),
                deadline=deadline,
                weight=p.tenant.weight,
            )
        except QueueRefused as refused:
            self._shed(p, refused.reason)
            raise
        entry.future = asyncio.get_running_loop().create_future()
        self._kick()
        return self._wait_turn(p, entry, now)

    async def _wait_turn(self, p: Pass, entry: Entry, now: float) -> None:
        limit = self.settings.queue_timeout_s
        future = entry.future
        assert future is not None
        with tracing.span("kvpool.router.queue", {"kvpool.band": p.band}) as span:
            try:
                async with asyncio.timeout(limit):
                    await future  # set by the dispatcher, or failed by a shed
            except TimeoutError:
                if self.queue.remove(entry):
                    self._shed(p, "queue_timeout")
                    raise OpenAIError(
                        503,
                        f"the pool stayed saturated for {limit:g} s, the longest a request "
                        "waits in the router",
                        type="service_unavailable",
                        code="queue_timeout",
                        headers={"Retry-After": "1"},
                    ) from None
                if not p.slot:  # shed meanwhile: its error is in the future
                    raise shed_error(entry) from None
            except OpenAIError:  # shed while waiting (deadline, displaced)
                self._shed(p, entry.shed_reason or "deadline")
                raise
            except BaseException:  # the client left, or shutdown
                self.queue.remove(entry)
                raise
            finally:
                if span is not None:
                    span.set_attribute("kvpool.waited_s", self.clock() - now)
        p.waited_s = entry.waited_s if entry.waited_s is not None else self.clock() - now
        self.metrics.queue_wait.labels(p.band).observe(p.waited_s)

    def _saturated(self, routed: Any, *, commit: bool = False) -> str | None:
        if self.active >= self.max_concurrency:
            why: str | None = "concurrency"
        else:
            why = self.saturation(routed, commit)
        if why is not None:
            self.saturated_by = why
        return why

    def _take(self, p: Pass, band: Band, cost: int) -> None:
        p.slot = True
        p.cost = cost
        self.active += 1
        self.admitted += 1
        self.queue.charge(band, p.tenant.name, cost, p.tenant.weight)

    def _shed(self, p: Pass, reason: str) -> None:
        self.metrics.requests.labels("shed").inc()
        self.metrics.shed.labels(reason, p.band).inc()
        p.outcome = "shed"

    def _on_shed(self, entry: Entry, reason: str) -> None:
        """The queue dropped a waiting entry (its deadline passed, or a more deserving one
        took its place): its request answers with the error."""
        if entry.future is not None and not entry.future.done():
            entry.future.set_exception(shed_error(entry))

    def _kick(self) -> None:
        self._wake.set()
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())

    async def _dispatch(self) -> None:
        """Send waiting requests on, best first, for as long as the pool can take them;
        shed those whose deadline passed."""
        while len(self.queue):
            self._wake.clear()
            self.queue.expire()
            while (entry := self.queue.peek()) is not None:
                p, routed, _ = entry.payload
                if entry.future is None or entry.future.done():  # gone while waiting
                    self.queue.remove(entry)
                    continue
                try:
                    why = self._saturated(routed)
                except Exception:  # its own task meets the same error and answers it
                    log.exception("flow control: the saturation check failed; sending it on")
                    why = None
                if why is not None:
                    break
                self.queue.pop_next()  # counts its cost for its tenant, as _take does
                p.slot = True
                p.cost = entry.cost
                self.active += 1
                self.admitted += 1
                entry.future.set_result(None)
                # Its load must count at its worker before the next saturation check, or
                # one moment of room would let the whole queue through at once.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PLACE_WAIT_S):
                        await p.placed.wait()
            if not len(self.queue):
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DISPATCH_POLL_S):
                    await self._wake.wait()

    # -- the end -----------------------------------------------------------------------------

    def finish(self, p: Pass) -> None:
        """The request is over, however it ended: its slot is freed, its tokens settled with
        its real usage, its tenant's tokens counted, its span ended. Once."""
        if p.done:
            return
        p.done = True
        p.placed.set()
        if p.client is not None:
            left = self.per_client.pop(p.client) - 1
            if left:
                self.per_client[p.client] = left
        if p.slot:
            self.active -= 1
            if len(self.queue):
                self._wake.set()
        usage = p.usage or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        used = None
        if isinstance(prompt, int) and isinstance(completion, int):
            used = prompt + completion
            self.metrics.tenant_tokens.labels(p.tenant.name, "prompt").inc(prompt)
            self.metrics.tenant_tokens.labels(p.tenant.name, "completion").inc(completion)
        elif not p.sent:
            used = 0  # no worker spent anything on it
        if p.reservation is not None:
            self.limiter.settle(p.reservation, used)
        if p.cost and used is not None:  # fairness by the tokens it really took
            self.queue.adjust(p.band, p.tenant.name, used - p.cost, p.tenant.weight)
        outcome = p.outcome or ("error" if p.error else "success")
        self.metrics.tenant_requests.labels(p.tenant.name, outcome).inc()
        tracing.end_span(p.span, p.error, **{"kvpool.tenant": p.tenant.name, "kvpool.band": p.band})
