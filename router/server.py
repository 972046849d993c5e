"""The router's HTTP face: an OpenAI-compatible gateway in front of the workers.

Per request: read what routing needs from the body (:mod:`.request`; the body itself is
forwarded unchanged, refusing a feature is the worker's job), tokenize and hash the
prompt, look the chain up in the block index, let the policy pick a worker, claim the
worker's load, and proxy.

How a request reaches a worker, is tried on others when it fails before its first token,
and is split into prefill and decode legs, is :mod:`.forward`'s. This module is the gateway
(parsing, admission, planning); the admin surface (health, metrics, debug endpoints) is
:mod:`.admin`'s, and running it under uvicorn :mod:`.serving`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from fractions import Fraction
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from kvpool import __version__, tracing
from kvpool.cost import COST
from kvpool.hashing import BlockHasher
from kvpool.httpguard import BodyError, raise_open_files_limit, read_body
from kvpool.openai_api import (
    OpenAIError,
    exception_handlers,
    model_not_found,
    output_over_context,
)
from kvpool.stall import LoopClock
from kvpool.tokenization import (
    PrefixTokenCache,
    load_tokenizer,
)

from .admin import AdminEndpoints
from .admission import Gate, Pass
from .affinity import SessionAffinity
from .discovery import StaticDiscovery, WorkerEndpoint
from .forward import PASSED_HEADERS, Forwarder, Routed
from .heat import PrefixHeat
from .index import BlockIndex
from .metrics import RouterMetrics
from .openapi import openapi_schema
from .policy import Decision, Plan, Planner, RouteRequest, saturation
from .pool import WorkerPool
from .processes import ProcessSlot
from .relay import (
    RelayResponse,
    until_client_leaves,
)
from .request import Kind, RoutingFields, parse_body, read_fields
from .settings import RouterSettings
from .tokens import PromptKeys, PromptTokens, media_part_tokens
from .upstream import Upstream

log = logging.getLogger(__name__)

#: a prompt's deepest shared prefix is judged for spreading from this many blocks on
SPREAD_MIN_BLOCKS = COST.spread_min_blocks
#: the share as an exact fraction (4/5): a block count times it, rounded down, in integers
_DEPTH = Fraction(COST.heat_depth_share).limit_denominator(100)

#: the longest ``X-Request-Id`` taken from a client (it is passed to the worker and logged)
MAX_REQUEST_ID = 256
#: the client's headers passed on to the worker: tracing context, and its credentials
#: when the router has none of its own for the workers (--worker-api-key)
FORWARDED_HEADERS = ("traceparent", "tracestate", "baggage")
#: the endpoints routed by the prompt, by path
GENERATE_PATHS: dict[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}
WORKER_PATHS: dict[Kind, str] = {kind: path for path, kind in GENERATE_PATHS.items()}
#: the endpoints passed to a healthy worker of the model as they are
PASSTHROUGH_PATHS = ("/v1/embeddings", "/tokenize", "/detokenize")


class Router(AdminEndpoints):
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
            from .peers import PeerLink

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
            from .discovery import KubernetesDiscovery

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
        from .discovery import KubernetesDiscovery

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

    async def passthrough(self, request: Request) -> Response:
        """``/v1/embeddings``, ``/tokenize``, ``/detokenize``: to the least busy healthy
        worker of the model, as they are; another worker if that one cannot be reached."""
        if self.draining:
            raise _draining()
        gate = self._gate()
        admitted = gate.enter(request.headers, _peer(request))
        try:
            return await self._pass(request, admitted)
        except OpenAIError as exc:
            admitted.error = exc.message
            raise
        finally:
            gate.finish(admitted)

    async def _pass(self, request: Request, admitted: Pass) -> Response:
        body = await self._body(request)
        obj = parse_body(body)
        model = obj.get("model")
        model = model if isinstance(model, str) and model != self.settings.model else None
        self._check_model(model)
        # an embeddings input is prefilled by the worker: load while it runs there, as a
        # generate request's is, so that the next one goes to another worker
        tokens = 0
        prefills = request.url.path == "/v1/embeddings"  # /tokenize, /detokenize: no engine
        if prefills and self.prompt_keys is not None:
            tokens = await self.prompt_keys.input_tokens(obj)
        pool = self._pool()
        now = time.monotonic()
        candidates = sorted(
            (
                s
                for s in pool.routable()
                if not s.breaker.is_open(now)
                and (model is None or model in s.models or s.model == model)
            ),
            key=lambda s: s.in_flight,
        )[: self.settings.max_attempts]
        headers = {"content-type": "application/json", "x-request-id": self._request_id(request)}
        headers.update({k: v for k in self._forwarded if (v := request.headers.get(k)) is not None})
        assert self.upstream is not None
        failures = []
        admitted.sent = bool(candidates)
        for state in candidates:
            ticket = (
                state.begin(tokens, state.prefill.predict(tokens), time.monotonic(), learn=False)
                if prefills
                else None
            )
            try:
                async with self.upstream.post(
                    state.url + request.url.path,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s),
                ) as resp:
                    content = await resp.read()
                    if resp.status >= 500:
                        failures.append(f"{resp.status}")
                        continue
                    passed = {k: v for k in PASSED_HEADERS if (v := resp.headers.get(k))}
                    return Response(content, status_code=resp.status, headers=passed)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("%s on worker %s failed: %r", request.url.path, state.id, exc)
                failures.append(type(exc).__name__)
            finally:
                if ticket is not None:
                    state.end(ticket)
        raise OpenAIError(
            503 if not failures else 502,
            "no worker can take this request now"
            + (f" ({len(failures)} tried: {', '.join(failures)})" if failures else ""),
            type="service_unavailable" if not failures else "server_error",
            code="no_worker" if not failures else "worker_unavailable",
            headers={"Retry-After": "1"},
        )

    # -- generation -----------------------------------------------------------------------

    async def _generate(self, request: Request, kind: Kind) -> Response:
        arrival = time.monotonic()
        metrics = self._metrics()
        if self.draining:
            metrics.requests.labels("no_worker").inc()
            raise _draining()
        gate = self._gate()
        # Who sends it, and within its requests limit: before its body is read, and before
        # it holds anything of the router's (no slot while a slow client dribbles a body).
        admitted = gate.enter(request.headers, _peer(request))
        if tracing.tracer() is not None:
            admitted.span = tracing.start_span(
                "kvpool.router.request",
                {"http.route": request.url.path, "kvpool.tenant": admitted.tenant.name},
                context=tracing.extract(request.headers),
            )
        handed_over = False
        try:
            with tracing.activated(admitted.span):
                try:
                    body = await self._body(request)
                    with tracing.span("kvpool.router.tokenize"):
                        routed = await self._parse(request, body, kind, check_model=True)
                except OpenAIError:
                    metrics.requests.labels("client_error").inc()
                    raise
                except ClientDisconnect:
                    metrics.requests.labels("cancelled").inc()
                    raise
                routed.admitted = admitted
                if admitted.span is not None:
                    admitted.span.set_attributes(
                        {
                            "kvpool.request_id": routed.request_id,
                            "kvpool.prompt_tokens": routed.num_tokens,
                        }
                    )
                # Its tokens, then a slot: at once, or after waiting its turn.
                wait = gate.admit_now(
                    admitted, routed, request.headers, max_tokens=routed.max_tokens, size=len(body)
                )
                if wait is not None:
                    await self._unless_client_leaves(request, wait)
                if not admitted.slot:  # the client left while it waited
                    return Response(status_code=499)
                s = self.settings
                # A stream's time limit is on its first token (then on silence between
                # chunks); a whole answer's on all of it.
                limit = s.first_token_timeout_s if routed.stream else s.request_timeout_s
                response = await self._unless_client_leaves(
                    request, self._proxy(routed, arrival, arrival + limit)
                )
                handed_over = isinstance(response, RelayResponse)
                return response
        except OpenAIError as exc:
            admitted.error = exc.message
            raise
        except BaseException as exc:
            admitted.error = type(exc).__name__
            raise
        finally:
            if not handed_over:
                gate.finish(admitted)

    async def _unless_client_leaves(
        self, request: Request, work: Coroutine[Any, Any, Response]
    ) -> Response:
        """Run ``work`` (a request on its way to an answer) but give up when the client
        hangs up, before the worker's headers too: the worker's connection is closed, which
        makes it abort the request and free its blocks."""
        async with until_client_leaves(request.receive):
            return await work
        self._metrics().requests.labels("cancelled").inc()
        return Response(status_code=499)  # nobody reads it; logs show why it ended

    async def _body(self, request: Request) -> bytes:
        """The body, read within ``body_timeout_s`` and ``max_request_body_bytes`` (a
        Content-Length over the limit is refused before anything is read)."""
        try:
            return await read_body(
                request,
                limit_bytes=self.settings.max_request_body_bytes,
                timeout_s=self.settings.body_timeout_s,
            )
        except BodyError as exc:
            raise OpenAIError(exc.status, str(exc), code=exc.code) from None

    def _request_id(self, request: Request) -> str:
        """The client's ``X-Request-Id`` (passed to the worker, logged), checked here: a
        header the worker's HTTP server would refuse must be the client's error, not a
        worker failure."""
        rid = request.headers.get("x-request-id")
        if rid is None or rid == "":
            return uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID or not rid.isascii() or not rid.isprintable():
            raise OpenAIError(
                400,
                f"x-request-id: must be at most {MAX_REQUEST_ID} printable ASCII characters "
                f"(got {len(rid)} characters)",
                code="invalid_request_id",
                param="x-request-id",
            )
        return rid

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        served = self._pool().models() | {self.model_name}
        if model not in served:
            # vLLM names its base models (not its adapters) as the valid aliases
            adapters = self._pool().adapters()
            raise model_not_found(model, sorted(m for m in served if m not in adapters))

    async def _parse(
        self, request: Request, body: bytes, kind: Kind, *, check_model: bool
    ) -> Routed:
        request_id = self._request_id(request)
        obj = parse_body(body)
        fields = read_fields(obj, kind)
        if fields.kv_transfer_params:
            raise OpenAIError(
                400,
                "kv_transfer_params: set by the router for the prefill/decode hand-off, "
                "not by clients",
                param="kv_transfer_params",
            )
        model = fields.model if fields.model != self.settings.model else None
        if check_model:
            self._check_model(model)
        # The served model (the usual case, model None) is no adapter: the workers' cards are
        # read only for a request that names another model
        adapters = self._pool().adapters() if model is not None else {}
        adapter = model if model is not None and model in adapters else None
        prompt = await self._tokens_and_keys(fields, adapter, adapters.get(adapter))
        strip_usage = False
        options = obj.get("stream_options") or {}
        if fields.stream and kind != "responses" and options.get("include_usage") in (None, False):
            # The bookkeeping exception: every stream's usage counts in the realised hit
            # ratio, so the router asks for it, and keeps it from a client that did not.
            options = {**options, "include_usage": True}
            options.pop("continuous_usage_stats", None)
            obj["stream_options"] = options
            body = json.dumps(obj, separators=(",", ":")).encode()
            strip_usage = True
        session = request.headers.get(self.settings.session_header) or (
            fields.user if self.settings.session_from_user else None
        )
        # each prompt of a batch generates its own
        max_tokens = _max_tokens(obj, self.settings.default_max_tokens) * max(
            len(fields.prompts), 1
        )
        forwarded = {k: v for k in self._forwarded if (v := request.headers.get(k)) is not None}
        pin = (
            self.responses.get(fields.previous_response_id) if fields.previous_response_id else None
        )
        return Routed(
            request_id=request_id,
            path=WORKER_PATHS[kind],
            body=body,
            model=model,
            stream=fields.stream,
            num_tokens=prompt.num_tokens,
            keys=prompt.keys,
            # the hand-off carries one prompt and one choice
            splittable=(kind == "chat" or (kind == "completion" and len(fields.prompts) == 1))
            and fields.choices == 1,
            strip_usage=strip_usage,
            session=session or None,
            credit_note=prompt.note,
            kind=kind,
            headers=forwarded,
            pin=pin,
            max_tokens=max_tokens,
            batch=prompt.batch,
            reads_cache=fields.reads_cache,
        )

    async def _tokens_and_keys(
        self, fields: RoutingFields, adapter: str | None, adapter_path: str | None = None
    ) -> PromptTokens:
        """See :meth:`PromptKeys.of`; the limit is the workers' context, unless the worker
        keeps the prompt's end (``truncate_prompt_tokens``)."""
        assert self.prompt_keys is not None
        truncate = fields.truncate_prompt_tokens
        context = self.pool.context_tokens() if self.pool is not None else None
        # With truncate_prompt_tokens vLLM cuts the prompt and checks no length (-1: the
        # longest prompt that leaves room for one token)
        limit = context if truncate is None else None
        if truncate is not None and truncate < 0 and context is not None:
            fields = dataclasses.replace(fields, truncate_prompt_tokens=context - 1)
        if context is not None and fields.max_output is not None:
            # vLLM refuses this before it reads the prompt: so does the router
            name, value = fields.max_output
            if value > context:
                raise output_over_context(name, value, context)
        return await self.prompt_keys.of(fields, adapter, limit, adapter_path)

    def _route_request(self, routed: Routed, *, observe: bool = True) -> RouteRequest:
        """The policy's input. ``observe``: the request is being routed (not a dry run): its
        deepest shared prefix counts in the heat, once."""
        pool = self._pool()
        matched = pool.feed.match(routed.keys)
        routed.ranks = {w: r for w, (_, r) in matched.items() if r is not None}
        blocks = {w: b for w, (b, _) in matched.items()}
        # The prefix is named at a power of two of blocks, at most four fifths of the
        # deepest match (COST.heat_depth_share): the blocks after it (where a question
        # starts) differ from request to request, and would split one system prompt's heat
        # over many names.
        most = max(blocks.values(), default=0) * _DEPTH.numerator // _DEPTH.denominator
        depth = 1 << (most.bit_length() - 1) if most else 0
        key = routed.keys[depth - 1] if depth >= SPREAD_MIN_BLOCKS else None
        if observe and not routed.heat_seen:
            routed.heat_seen = True
            self.heat.observe(key)
        affinity = self.sessions.get(routed.session) if routed.session else None
        starts = routed.session is not None and affinity is None  # a session's first request
        return RouteRequest(
            num_tokens=routed.num_tokens,
            block_size=self.settings.block_size,
            matched_blocks=blocks,
            model=routed.model,
            affinity=affinity,
            spread_wanted=self._spread_wanted(key, pool, starts_session=starts),
            starts_session=starts,
            spread_depth=depth,
            computed_blocks=self._computed(routed.keys, blocks, pool),
            reads_cache=routed.reads_cache,
            whole_prompt=routed.pin is None,
            batch=routed.batch.credit(pool.feed.match, self.settings.block_size)
            if routed.batch is not None
            else None,
        )

    @staticmethod
    def _computed(keys: list[int], blocks: dict[str, int], pool: WorkerPool) -> dict[str, int]:
        """Per worker whose matched blocks a request there is still prefilling: how many of
        them are computed (the ``prefix`` score credits the rest by how busy the pool is)."""
        out = {}
        for wid, n in blocks.items():
            state = pool.workers.get(wid)
            if state is not None and n:
                done = state.computing(keys[:n])
                if done < n:
                    out[wid] = done
        return out

    def _spread_wanted(self, key: int | None, pool: WorkerPool, *, starts_session: bool) -> int:
        """How many workers should hold the prefix ``key`` (0: no opinion), for a request
        that ``starts_session`` or not (:meth:`PrefixHeat.holders`)."""
        if key is None:
            return 0
        share = self.heat.share(key)
        if share == 0.0:
            return 0
        states = pool.workers.values()
        if starts_session:
            load = sum(s.in_flight + s.peer_in_flight for s in states)
        else:  # the requests still waiting for a first token, the other replicas' too
            load = sum(s.prefilling + s.peer_prefilling for s in states)
        workers = len(pool.workers)
        return self.heat.holders(share, workers, load + 1, session=starts_session)  # +1: this one

    def _plan(self, routed: Routed, *, dry_run: bool = False) -> Plan:
        return self.planner.plan(
            self._route_request(routed, observe=not dry_run),
            self._pool().views(),
            splittable=routed.splittable,
            dry_run=dry_run,
        )

    def _pinned(self, routed: Routed) -> Plan:
        """A request continuing a stored response goes to the worker that stored it (the
        others do not have it), whole, while that worker can take it."""
        views = [v for v in self._pool().views() if v.id == routed.pin]
        decision = self.planner.aggregated.decide(self._route_request(routed), views)
        if decision.worker is None:  # gone: another worker answers (404, most likely)
            return self._plan(routed)
        decision.reason = "pinned"
        return Plan("aggregated", "pinned", routed.num_tokens - decision.cached_tokens, decision)

    def _decide(
        self, routed: Routed, exclude: set[str], *, leg: str = "aggregated", dry_run: bool = False
    ) -> Decision:
        """Another worker for a request sent again: ``leg`` is ``aggregated`` (the request
        whole), ``prefill`` or ``decode`` (one half of a split)."""
        views = [v for v in self._pool().views() if v.id not in exclude]
        req = self._route_request(routed, observe=not dry_run)
        if leg == "prefill":
            return self.planner.prefill_decision(req, views, dry_run=dry_run)
        if leg == "decode":
            return self.planner.decode_decision(req, views, dry_run=dry_run)
        return self.planner.aggregated.decide(req, views, dry_run=dry_run)

    async def _proxy(self, routed: Routed, arrival: float, deadline: float) -> Response:
        """Plan the request's way (whole, or split), then serve it."""
        metrics = self._metrics()
        with tracing.span("kvpool.router.decide") as span:
            plan = routed.plan  # admission's, made a moment ago for the same pool
            routed.plan = None
            if plan is None:
                t0 = time.perf_counter()
                plan = self._plan(routed) if routed.pin is None else self._pinned(routed)
                metrics.decision_latency.observe(time.perf_counter() - t0)
            if span is not None:
                span.set_attributes(
                    {
                        "kvpool.worker": plan.worker or "",
                        "kvpool.reason": plan.decode.reason,
                        "kvpool.path": plan.path,
                        "kvpool.cached_tokens": plan.decode.cached_tokens,
                        "kvpool.explanation": plan.explain(),
                    }
                )
        metrics.pd_reason[plan.reason].inc()
        if plan.worker is not None:
            metrics.prompt_tokens.inc(routed.num_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", routed.request_id, plan.explain())
        return await self._forwarder().forward(routed, plan, arrival, deadline)

    def _pin(self, table: str, key: str, worker: str) -> None:
        """Remember where a conversation went (``session``: its key's worker, a soft
        score; ``response``: where a stored response is, a hard pin), and tell the other
        processes and replicas: its next turn may reach any of them."""
        self._peer_pinned(table, key, worker)
        if self.peers is not None:
            self.peers.pinned(table, key, worker)

    def _peer_pinned(self, table: str, key: str, worker: str) -> None:
        """Another process or replica placed a conversation: remember it as if here (a
        table this release does not know of: nothing)."""
        pins = {"session": self.sessions, "response": self.responses}.get(table)
        if pins is not None:
            pins.remember(key, worker)


def _max_tokens(obj: dict[str, Any], default: int) -> int:
    """The most tokens a request may generate, all its choices together: what the
    tokens-per-minute limit reserves until its usage says what it took."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            break
    else:
        value = default
    n = obj.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return value * n


async def _follow(discovery: Any, on_change: Any, failed: str) -> None:
    """Run a discovery until cancelled; a failure (logged as ``failed``) leaves what it
    found so far in place."""
    try:
        await discovery.run(on_change)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception(failed)


def _peer(request: Request) -> str | None:
    """The address the request's connection comes from (None over a Unix socket)."""
    return request.client.host if request.client is not None else None


def _draining() -> OpenAIError:
    return OpenAIError(
        503, "the router is shutting down", type="service_unavailable", code="draining"
    )
