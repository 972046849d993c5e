"""The router's HTTP face: an OpenAI-compatible gateway in front of the workers, and its
lifecycle (start, discovery, peers, shutdown).

A request's walk, one sub-package after the other:

* :mod:`.proxy.receive`: its body read and parsed (:mod:`.proxy.request`), admitted
  (:mod:`.admission`), tokenized and hashed (:mod:`.routing.tokens`);
* :mod:`.routing.route`: the index's matches (:mod:`.state`) made into the policy's
  inputs, and the plan (:mod:`.routing.planner`, :mod:`.routing.policy`, priced by the
  cost model, :mod:`kvpool.cost`);
* :mod:`.proxy.forward`: the attempts on the chosen worker and others (:mod:`.proxy.tries`),
  the prefill leg of a split (:mod:`.proxy.split`), the answer relayed (:mod:`.proxy.relay`,
  :mod:`.proxy.sse`) over the one HTTP client to the workers (:mod:`.proxy.upstream`).

The admin surface (health, metrics, debug endpoints) is :mod:`.admin`'s, and running it
under uvicorn :mod:`.serving`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from kvpool import __version__, tracing
from kvpool.hashing import BlockHasher
from kvpool.httpguard import raise_open_files_limit
from kvpool.openai_api import (
    OpenAIError,
    exception_handlers,
)
from kvpool.stall import LoopClock
from kvpool.tokenization import (
    PrefixTokenCache,
    load_tokenizer,
)

from .admin.debug import AdminEndpoints
from .admin.metrics import RouterMetrics
from .admin.openapi import openapi_schema
from .admission.gate import Gate
from .processes import ProcessSlot
from .proxy.forward import Forwarder
from .proxy.passthrough import PASSTHROUGH_PATHS, Passthrough
from .proxy.receive import FORWARDED_HEADERS, GENERATE_PATHS, Receive
from .proxy.request import Kind
from .proxy.routed import Routed
from .proxy.upstream import Upstream
from .routing.affinity import SessionAffinity
from .routing.heat import PrefixHeat
from .routing.planner import Planner
from .routing.policy import saturation
from .routing.route import Decisions
from .routing.tokens import PromptKeys, media_part_tokens
from .settings import RouterSettings
from .state.discovery import StaticDiscovery, WorkerEndpoint
from .state.index import BlockIndex
from .state.pool import WorkerPool

log = logging.getLogger(__name__)


class Router(AdminEndpoints, Receive, Passthrough, Decisions):
    def __init__(self, settings: RouterSettings, slot: ProcessSlot | None = None) -> None:
        self.settings = s = settings
        self.slot = slot or ProcessSlot()  # its place among the processes on its port
        self.hasher = BlockHasher(
            block_size=s.block_size, hash_seed=s.hash_seed, extra_keys=s.extra_keys
        )
        self.planner = Planner(s.policy_config(), s.split_config())
        self.index = BlockIndex(
            speculative_ttl=s.speculative_ttl_s,
            hold_max=s.speculative_hold_max_s,
            approx_ttl=s.approx_ttl_s,
            approx_capacity_blocks=s.approx_capacity_blocks,
        )
        self.sessions = SessionAffinity(s.session_capacity, s.session_ttl_s)
        #: each shared prefix's share of the traffic, for the spread scorer
        self.heat = PrefixHeat()
        # Responses API ids -> the worker that stored them: vLLM keeps a stored response in
        # its process, so a request continuing it (previous_response_id) must go there.
        self.responses = SessionAffinity(s.session_capacity, s.session_ttl_s)
        # A client's own key goes to the workers (vLLM's --api-key) only while the router
        # neither has one for them nor checks keys itself: a tenant's key stays here.
        keep_auth = not s.worker_api_key and not s.api_keys_file
        self._forwarded = FORWARDED_HEADERS + (("authorization",) if keep_auth else ())
        self.discovery: Any = None  # static or Kubernetes, chosen at start by the settings
        self.tokenizer: Any = None
        self.token_cache: PrefixTokenCache | None = None
        self.prompt_keys: PromptKeys | None = None  # the prompt's tokens and block keys
        # To the workers: the generate requests on a client of our own (upstream.py), the
        # rest (health checks, scrapes, pass-through) on aiohttp's, a fifth of httpx's cost.
        self.upstream: aiohttp.ClientSession | None = None
        self.http: Upstream | None = None
        self.model_name = s.model_name
        self.pool: WorkerPool | None = None
        self.peers: Any = None  # the other router replicas (peers.PeerLink), if any
        self._peer_task: asyncio.Task[None] | None = None
        self._share_task: asyncio.Task[None] | None = None  # metrics for sibling processes
        self.metrics: RouterMetrics | None = None
        self.gate: Gate | None = None  # admission: tenants, limits, flow control
        self.draining = False
        self._warm = False  # /health: ready once the workers known at start are in
        self._first_up = 0.0
        self.bound_port: int | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self.forwarder: Forwarder | None = None  # the data path to the workers
        self._handlers = exception_handlers(log)
        self.app = self._build_app()  # everything, with its OpenAPI schema

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self.tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
        self.token_cache = PrefixTokenCache(
            self.tokenizer, capacity_bytes=int(s.token_cache_mib * 2**20)
        )
        media = s.media_part_tokens
        if media is None:  # what the model's config says one image is
            media = media_part_tokens(s.model)
        self.prompt_keys = PromptKeys(
            self.tokenizer,
            self.token_cache,
            self.hasher,
            media,
            content_format=s.chat_template_content_format,
        )
        if not self.token_cache.enabled:
            log.info("the tokenizer's pieces may cross words: prompts are tokenized whole")
        # vLLM started with --api-key wants it on /v1/* (its model list too)
        auth = {"Authorization": f"Bearer {s.worker_api_key}"} if s.worker_api_key else None
        self.upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s),
            auto_decompress=False,  # bodies are passed on as the worker sent them
            skip_auto_headers=("User-Agent",),
            headers=auth,
        )
        # health checks and connects are timed by the loop's responsive time (kvpool/stall.py)
        self.clock = LoopClock()
        self.clock.start()
        self.http = Upstream(s.connect_timeout_s, headers=auth, clock=self.clock)
        self.pool = WorkerPool(
            s.pool_config(),
            self.index,
            self.upstream,
            on_event_lag=self._on_event_lag,
            clock=self.clock,
        )
        pool = self.pool
        peer_bind, peers = self.slot.peering(s.peer_bind, s.peer)
        if peer_bind:
            from .state.peers import PeerLink

            secret = s.pool_secret.get_secret_value() if s.pool_secret else None
            self.peers = PeerLink(
                peer_bind,
                peers,
                rows=pool.own_rows,
                on_load=pool.peer_load,
                on_speculated=pool.feed.peer_speculated,
                on_held=pool.feed.peer_held,
                on_ended=pool.feed.peer_ended,
                hold_max_s=s.speculative_hold_max_s,
                on_pinned=self._peer_pinned,
                secret=secret,
            )
            self.peers.start()
            pool.share_with(self.peers)
            if s.peer_selector:
                self._peer_task = asyncio.create_task(self._discover_peers())
        self.metrics = RouterMetrics(
            lambda: list(pool.workers.values()),
            pool.feed.indexed_blocks,
            shared=self.slot.runtime_dir,
            prefill_rates=pool.prefill_rates,
        )
        self._share_task = asyncio.create_task(self.metrics.share())
        raise_open_files_limit()  # every stream is two open files: before the gate's bound
        self.gate = Gate(s, self.metrics, self._saturation)
        self.gate.start()
        self.forwarder = Forwarder(
            s, pool, self.metrics, self.gate, self.http, self.upstream, self._decide, self._pin
        )
        tracing.configure("kvpool-router")
        if s.discovery == "kubernetes":
            from .state.discovery import KubernetesDiscovery

            self.discovery = KubernetesDiscovery(
                s.namespace,
                s.selector,
                int(s.worker_port) if s.worker_port.isdigit() else s.worker_port,
                role_label=s.role_label,
                events_port=s.worker_events_port,
                replay_port=s.worker_replay_port,
            )
        else:
            self.discovery = StaticDiscovery(s.static_workers())
        self._discovery_task = asyncio.create_task(self._discover())
        self.slot.started()
        log.info(
            "router ready: policy %s, prefill/decode %s (threshold %d tokens), %s",
            s.policy,
            s.pd_mode,
            s.pd_threshold_tokens,
            self.hasher.fingerprint,
        )

    async def _discover_peers(self) -> None:
        """The other router replicas' pods (``--peer-selector``), on ``--peer-bind``'s port;
        this pod (its name is the hostname) is not its own peer."""
        from .state.discovery import KubernetesDiscovery

        s = self.settings
        assert s.peer_bind and s.peer_selector
        port = int(s.peer_bind.rsplit(":", 1)[1])
        me = socket.gethostname()

        def on_change(endpoints: list[WorkerEndpoint]) -> None:
            remote = ["tcp://" + e.url.split("://", 1)[1] for e in endpoints if e.id != me]
            # with this pod's other processes, and each pod's processes' ports
            self.peers.set_peers(self.slot.peering(s.peer_bind, remote)[1])

        peers = KubernetesDiscovery(s.namespace, s.peer_selector, port)
        await _follow(peers, on_change, "router peer discovery failed; the peers known so far stay")

    async def _discover(self) -> None:
        def on_change(endpoints: list[WorkerEndpoint]) -> None:
            self._pool().set_endpoints(endpoints)

        await _follow(
            self.discovery, on_change, "worker discovery failed; the workers known so far stay"
        )

    async def shutdown(self) -> None:
        if self.gate is not None:
            await self.gate.close()
        for task in (self._discovery_task, self._peer_task, self._share_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.pool is not None:
            await self.pool.close()  # and the loop clock it shares with the upstream
        if self.peers is not None:
            await self.peers.close()
        if self.http is not None:
            await self.http.close()
        if self.upstream is not None:
            await self.upstream.close()

    @property
    def active(self) -> int:
        """Requests past admission that have not ended (the concurrency bound's count)."""
        return self.gate.active if self.gate is not None else 0

    def _gate(self) -> Gate:
        if self.gate is None:
            raise OpenAIError(503, "the router is starting", type="service_unavailable")
        return self.gate

    def _saturation(self, routed: Routed, commit: bool) -> str | None:
        """Why the pool cannot take ``routed`` now without a worker queue growing.
        ``commit``: when it can, the request goes at once (nothing runs in between), so
        this plan is the one it is sent by; otherwise planning moves no round-robin
        position (the dispatcher asks about a waiting request again and again)."""
        if routed.pin is not None:
            return None  # only its own worker has what it continues: no choice to wait for
        t0 = time.perf_counter()
        plan = self._plan(routed, dry_run=not commit)
        decision = plan.prefill if plan.prefill is not None else plan.decode
        guard = self.planner.aggregated.config.guard_kv_usage
        why = saturation(decision, self.settings.saturation_ttft_s, guard)
        if commit and why is None:
            self._metrics().decision_latency.observe(time.perf_counter() - t0)
            routed.plan = plan
        return why

    def _pool(self) -> WorkerPool:
        if self.pool is None:
            raise OpenAIError(503, "the router is starting", type="service_unavailable")
        return self.pool

    def _forwarder(self) -> Forwarder:
        if self.forwarder is None:
            raise OpenAIError(503, "the router is starting", type="service_unavailable")
        return self.forwarder

    def _metrics(self) -> RouterMetrics:
        assert self.metrics is not None
        return self.metrics

    def _on_event_lag(self, lag: float) -> None:
        if self.metrics is not None:
            self.metrics.event_lag.observe(max(lag, 0.0))

    # -- app ------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            await self.start()
            yield
            await self.shutdown()

        handlers = self._handlers

        async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
            # The client hung up while sending its body: nobody reads an answer, and it is
            # no fault of the router's (no traceback, no 500).
            log.info("%s %s: the client left while sending", request.method, request.url.path)
            return Response(status_code=499)

        handlers[ClientDisconnect] = client_gone
        app = FastAPI(
            title="kvpool router",
            version=__version__,
            lifespan=lifespan,
            exception_handlers=handlers,
        )
        app.state.router = self
        app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]

        for path, kind in GENERATE_PATHS.items():
            app.add_route(path, self._generate_endpoint(kind), methods=["POST"])
        for path in PASSTHROUGH_PATHS:
            app.add_route(path, self.passthrough, methods=["POST"])
        app.add_route("/v1/models", self.models, methods=["GET"])
        app.add_route("/health", self.health, methods=["GET"])
        app.add_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.add_route("/debug/route", self.debug_route, methods=["POST"])
        app.add_route("/debug/workers", self.debug_workers, methods=["GET"])
        app.add_route("/debug/index", self.debug_index, methods=["GET"])
        app.add_route("/debug/peers", self.debug_peers, methods=["GET"])
        return app

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """What the HTTP server runs: the generate endpoints straight to their handler,
        everything else (lifespan, admin, debug, 404s) through FastAPI. The data path skips
        FastAPI's and Starlette's middleware stack and router (about 6% of the router's
        CPU per request, by py-spy); its errors get the same handlers and answers."""
        kind = GENERATE_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await self._generate(request, kind)
        except Exception as exc:
            response = await self._error_response(request, exc)
        await response(scope, receive, send)

    async def _error_response(self, request: Request, exc: Exception) -> Response:
        """The answer the app's exception handlers give ``exc`` (the nearest class)."""
        for cls in type(exc).__mro__:
            handler = self._handlers.get(cls)
            if handler is not None:
                response: Response = await handler(request, exc)
                return response
        raise exc  # not an Exception's subclass: nothing to answer with

    def _generate_endpoint(self, kind: Kind) -> Any:
        async def endpoint(request: Request) -> Response:
            return await self._generate(request, kind)

        endpoint.__name__ = f"{kind}_endpoint"
        return endpoint


async def _follow(discovery: Any, on_change: Any, failed: str) -> None:
    """Run a discovery until cancelled; a failure (logged as ``failed``) leaves what it
    found so far in place."""
    try:
        await discovery.run(on_change)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception(failed)
