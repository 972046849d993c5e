"""The router's HTTP face: an OpenAI-compatible gateway in front of the workers.

Per request: validate the body (the same models as the workers, so the same 400s),
tokenize and hash the prompt, look the chain up in the block index, let the policy pick a
worker, claim the worker's load, and proxy. A connection error, a 5xx or a 429 before the
first byte reaches the client sends the request to another worker (bounded attempts, with
backoff); once a stream has begun, a worker failure ends it with an SSE error event and
``[DONE]``, never a hang. The body the client sent is forwarded as it is.

A request the planner splits goes first to a prefill worker (``max_tokens: 1``, not
streamed, ``kv_transfer_params.do_remote_decode``), whose answer's ``kv_transfer_params``
are added to the client's body for the decode worker, whose answer is relayed like any
other. A failed prefill leg is tried on another prefill worker; when none is left, the
request is served whole (the decode worker computes its prefill): a split never costs the
client an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool import __version__
from kvpool.hashing import BlockHasher
from kvpool.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    exception_handlers,
    parse_request,
)
from kvpool.tokenization import PrefixTokenCache, encode_prompt, load_tokenizer, render_chat

from .discovery import StaticDiscovery, WorkerEndpoint
from .index import BlockIndex
from .metrics import RouterMetrics
from .policy import Decision, Plan, Planner, RouteRequest
from .pool import Ticket, WorkerPool, WorkerState
from .settings import RouterSettings

log = logging.getLogger(__name__)

#: prompts up to this many characters (or token ids) are tokenized and hashed on the event
#: loop, where a thread hop would cost more; longer ones, and chats, in a thread
INLINE_PROMPT_SIZE = 4000
#: response headers passed back from the worker
PASSED_HEADERS = ("content-type", "retry-after")


@dataclass
class Routed:
    """A request, tokenized and hashed, ready for the policy."""

    request_id: str
    path: str  # the worker's endpoint: completions or chat completions
    body: bytes
    model: str | None
    stream: bool
    num_tokens: int
    keys: list[int]
    splittable: bool = True  # one prompt: the prefill/decode hand-off carries one


@dataclass
class _DecodeLeg:
    """The second half of a split: the body with the prefill worker's ``kv_transfer_params``
    and where they came from (to release the blocks if no decode worker takes them)."""

    body: bytes
    params: dict[str, Any]
    prefill: WorkerState
    tail_tokens: int  # what the decode worker computes itself: the part of a block
    sent: bool = False  # a decode worker got it: that worker pulls and releases the blocks


class _Failed(Exception):
    """A worker failed this attempt before any byte reached the client."""

    def __init__(self, reason: str, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = s = settings
        self.hasher = BlockHasher(block_size=s.block_size, hash_seed=s.hash_seed)
        self.planner = Planner(s.policy_config(), s.split_config())
        self.policy = self.planner.aggregated
        self.index = BlockIndex(
            speculative_ttl=s.speculative_ttl_s,
            approx_ttl=s.approx_ttl_s,
            approx_capacity_blocks=s.approx_capacity_blocks,
        )
        self.discovery: Any = None  # static or Kubernetes, chosen at start by the settings
        self.tokenizer: Any = None
        self.token_cache: PrefixTokenCache | None = None
        # To the workers (requests, health checks, scrapes): aiohttp's client costs a fifth of
        # httpx's CPU per request, which was most of what the router added.
        self.upstream: aiohttp.ClientSession | None = None
        self.model_name = s.model_name
        self.pool: WorkerPool | None = None
        self.metrics: RouterMetrics | None = None
        self.active = 0
        self.draining = False
        self.bound_port: int | None = None
        self._discovery_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[None]] = set()  # fire-and-forget releases
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self.tokenizer = await asyncio.to_thread(load_tokenizer, s.model)
        self.token_cache = PrefixTokenCache(self.tokenizer)
        if not self.token_cache.enabled:
            log.info("the tokenizer's pieces may cross words: prompts are tokenized whole")
        self.upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
            timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s),
            auto_decompress=False,  # bodies are passed on as the worker sent them
            skip_auto_headers=("User-Agent",),
        )
        self.pool = WorkerPool(
            s.pool_config(), self.index, self.upstream, on_event_lag=self._on_event_lag
        )
        self.metrics = RouterMetrics(lambda: list(self._pool().workers.values()), self.index)
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
        log.info(
            "router ready: policy %s, prefill/decode %s (threshold %d tokens), %s",
            s.policy,
            s.pd_mode,
            s.pd_threshold_tokens,
            self.hasher.fingerprint,
        )

    async def _discover(self) -> None:
        def on_change(endpoints: list[WorkerEndpoint]) -> None:
            self._pool().set_endpoints(endpoints)

        try:
            await self.discovery.run(on_change)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker discovery failed; the workers known so far stay")

    async def shutdown(self) -> None:
        if self._discovery_task is not None:
            self._discovery_task.cancel()
            with contextlib.suppress(BaseException):
                await self._discovery_task
        if self.pool is not None:
            await self.pool.close()
        if self.upstream is not None:
            await self.upstream.close()

    def _pool(self) -> WorkerPool:
        if self.pool is None:
            raise OpenAIError(503, "the router is starting", type="service_unavailable")
        return self.pool

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

        app = FastAPI(
            title="kvpool router",
            version=__version__,
            lifespan=lifespan,
            exception_handlers=exception_handlers(log),
        )
        app.state.router = self

        app.add_route("/v1/completions", self.completions, methods=["POST"])
        app.add_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_route("/v1/models", self.models, methods=["GET"])
        app.add_route("/health", self.health, methods=["GET"])
        app.add_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.add_route("/debug/route", self.debug_route, methods=["POST"])
        app.add_route("/debug/workers", self.debug_workers, methods=["GET"])
        app.add_route("/debug/index", self.debug_index, methods=["GET"])
        return app

    # -- small endpoints ------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        up = len(self._pool().routable())
        body = {"status": "ok" if up else "no_workers", "workers_up": up}
        return JSONResponse(body, status_code=200 if up else 503)

    async def models(self, request: Request) -> JSONResponse:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "kvpool"}
            for m in sorted(self._pool().models())
        ]
        return JSONResponse({"object": "list", "data": data})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self._metrics().render(), media_type="text/plain; version=0.0.4")

    async def debug_workers(self, request: Request) -> JSONResponse:
        now = time.monotonic()
        known = set(self.index.workers())
        rows = []
        for s in self._pool().workers.values():
            rows.append(
                {
                    "id": s.id,
                    "url": s.url,
                    "role": s.endpoint.role,
                    "status": s.status,
                    "draining": s.endpoint.draining,
                    "model": s.model,
                    "compatible": s.compatible,
                    "mismatch": s.mismatch,
                    "in_flight": s.in_flight,
                    "queued_prefill_tokens": s.queued_tokens(now),
                    "prefill_rate_tokens_per_s": round(s.prefill.rate, 1),
                    "prefill_overhead_s": round(s.prefill.overhead, 4),
                    "kv_usage": s.kv_usage,
                    "waiting": s.waiting,
                    "running": s.running,
                    "circuit_open": s.breaker.is_open(now),
                    "kv_events": s.subscriber.endpoint if s.subscriber else None,
                    "events_seen": s.events_seen,
                    "indexed_blocks": self.index.num_blocks(s.id) if s.id in known else 0,
                }
            )
        return JSONResponse({"workers": rows})

    async def debug_index(self, request: Request) -> JSONResponse:
        return JSONResponse(self.index.summary())

    async def debug_route(self, request: Request) -> JSONResponse:
        """A dry run: what the policy would do with this body (a completion or a chat
        request), every worker's line included. Nothing is claimed or sent."""
        body = await self._body(request)
        try:
            is_chat = "messages" in json.loads(body)
        except (ValueError, TypeError):
            is_chat = False  # parse_request names what is wrong with it
        kind = "chat" if is_chat else "completion"
        routed = await self._parse(request, body, kind, check_model=False)
        plan = self._plan(routed, dry_run=True)
        decision = plan.decode
        prefill = plan.prefill
        return JSONResponse(
            {
                "worker": decision.worker,
                "reason": decision.reason,
                "policy": decision.policy,
                "num_tokens": routed.num_tokens,
                "num_blocks": len(routed.keys),
                "cached_tokens": decision.cached_tokens,
                "predicted_ttft_s": decision.predicted_ttft_s,
                "candidates": [asdict(c) for c in decision.candidates],
                # the prefill/decode split: path, why, and the prefill leg's own decision
                "path": plan.path,
                "pd_reason": plan.reason,
                "uncached_tokens": plan.uncached_tokens,
                "prefill": None
                if prefill is None
                else {
                    "worker": prefill.worker,
                    "reason": prefill.reason,
                    "cached_tokens": prefill.cached_tokens,
                    "predicted_ttft_s": prefill.predicted_ttft_s,
                    "candidates": [asdict(c) for c in prefill.candidates],
                },
                "explanation": plan.explain(),
            }
        )

    # -- generation -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        arrival = time.monotonic()
        metrics = self._metrics()
        if self.draining:
            metrics.requests.labels("no_worker").inc()
            raise OpenAIError(
                503, "the router is shutting down", type="service_unavailable", code="draining"
            )
        if self.active >= self.settings.max_concurrency:
            metrics.requests.labels("overloaded").inc()
            raise OpenAIError(
                429,
                f"the router has {self.active} requests in flight, its limit",
                type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
        self.active += 1
        handed_over = False
        try:
            try:
                body = await self._body(request)
                routed = await self._parse(request, body, kind, check_model=True)
            except OpenAIError:
                metrics.requests.labels("client_error").inc()
                raise
            deadline = arrival + self.settings.request_timeout_s
            if routed.stream:  # a stream's relay sees the client leave as it writes
                response = await self._proxy(routed, arrival, deadline)
            else:
                response = await self._unless_client_leaves(
                    request, self._proxy(routed, arrival, deadline)
                )
            handed_over = isinstance(response, _RelayResponse)
            return response
        finally:
            if not handed_over:
                self.active -= 1

    async def _unless_client_leaves(
        self, request: Request, work: Coroutine[Any, Any, Response]
    ) -> Response:
        """Run ``work`` (a whole answer being awaited) but give up when the client hangs up:
        the worker's connection is closed, which makes it abort the request and free its
        blocks, instead of computing an answer nobody will read."""
        async with _until_client_leaves(request.receive):
            return await work
        self._metrics().requests.labels("cancelled").inc()
        return Response(status_code=499)  # nobody reads it; logs show why it ended

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_request_body_bytes
        declared = request.headers.get("content-length")
        size = int(declared) if declared is not None and declared.isdigit() else 0
        body = bytearray()
        if size <= limit:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    size = len(body)
                    break
        if size > limit or len(body) > limit:
            raise OpenAIError(
                413,
                f"the request body has at least {max(size, len(body))} bytes; the limit is {limit}",
                code="request_too_large",
            )
        return bytes(body)

    async def _parse(
        self, request: Request, body: bytes, kind: str, *, check_model: bool
    ) -> Routed:
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_request(model_cls, body)
        bad = req.unsupported()
        if bad is not None:
            raise OpenAIError(400, f"{bad[0]}: {bad[1]}", code="unsupported", param=bad[0])
        if req.kv_transfer_params is not None:
            raise OpenAIError(
                400,
                "kv_transfer_params: set by the router for the prefill/decode hand-off, "
                "not by clients",
                param="kv_transfer_params",
            )
        if check_model and req.model is not None:
            served = self._pool().models() | {self.model_name}
            if req.model not in served and req.model != self.settings.model:
                raise OpenAIError(
                    404,
                    f"the model {req.model!r} does not exist here; served: {sorted(served)}",
                    type="not_found_error",
                    code="model_not_found",
                    param="model",
                )
        tokens, keys = await self._tokens_and_keys(req)
        return Routed(
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            path="/v1/chat/completions" if kind == "chat" else "/v1/completions",
            body=body,
            model=req.model,
            stream=bool(req.stream),
            num_tokens=len(tokens),
            keys=keys,
            splittable=isinstance(req, ChatCompletionRequest) or len(req.prompts()) == 1,
        )

    async def _tokens_and_keys(
        self, req: CompletionRequest | ChatCompletionRequest
    ) -> tuple[list[int], list[int]]:
        """The prompt's token ids and block keys. A chat (its template rendered) and a long
        prompt are done in a thread: hashing alone takes ~0.3 ms per 1000 tokens, which
        would stall every stream the router relays."""
        if isinstance(req, ChatCompletionRequest):
            messages = [m.model_dump(exclude_none=True) for m in req.messages]

            def tokenize() -> list[int]:
                try:
                    return render_chat(
                        self.tokenizer,
                        messages,
                        add_generation_prompt=req.add_generation_prompt,
                        continue_final_message=req.continue_final_message,
                        chat_template_kwargs=req.chat_template_kwargs,
                        cache=self.token_cache,
                    )
                except ValueError as exc:
                    raise OpenAIError(400, str(exc), param="messages") from None

            inline = False
        else:
            prompts = req.prompts()
            if not prompts:
                raise OpenAIError(400, "prompt: must not be empty", param="prompt")
            # A batch of prompts goes to one worker: it is routed by its first prompt.
            first = prompts[0]

            def tokenize() -> list[int]:
                return encode_prompt(self.tokenizer, first, self.token_cache)

            inline = len(first) <= INLINE_PROMPT_SIZE

        def tokens_and_keys() -> tuple[list[int], list[int]]:
            tokens = tokenize()
            return tokens, self.hasher.prompt_keys(tokens, cache_salt=req.cache_salt)

        return tokens_and_keys() if inline else await asyncio.to_thread(tokens_and_keys)

    def _route_request(self, routed: Routed) -> RouteRequest:
        return RouteRequest(
            num_tokens=routed.num_tokens,
            block_size=self.settings.block_size,
            matched_blocks=self.index.match(routed.keys),
            model=routed.model if routed.model != self.settings.model else None,
        )

    def _plan(self, routed: Routed, *, dry_run: bool = False) -> Plan:
        return self.planner.plan(
            self._route_request(routed),
            self._pool().views(),
            splittable=routed.splittable,
            dry_run=dry_run,
        )

    def _decide(
        self, routed: Routed, exclude: set[str], *, leg: str = "aggregated", dry_run: bool = False
    ) -> Decision:
        """Another worker for a request sent again: ``leg`` is ``aggregated`` (the request
        whole), ``prefill`` or ``decode`` (one half of a split)."""
        views = [v for v in self._pool().views() if v.id not in exclude]
        req = self._route_request(routed)
        if leg == "prefill":
            return self.planner.prefill_decision(req, views, dry_run=dry_run)
        if leg == "decode":
            return self.planner.decode_decision(req, views, dry_run=dry_run)
        return self.planner.aggregated.decide(req, views, dry_run=dry_run)

    async def _proxy(self, routed: Routed, arrival: float, deadline: float) -> Response:
        """Plan the request's way (whole, or split), then serve it."""
        metrics = self._metrics()
        t0 = time.perf_counter()
        plan = self._plan(routed)
        metrics.decision_latency.observe(time.perf_counter() - t0)
        metrics.pd_reason[plan.reason].inc()
        if plan.worker is not None:
            metrics.prompt_tokens.inc(routed.num_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: %s", routed.request_id, plan.explain())
        if plan.prefill is None:
            metrics.pd_path["aggregated"].inc()
            return await self._serve(routed, arrival, deadline, first=plan.decode)
        assert plan.prefill is not None
        metrics.predicted_hit_tokens.inc(plan.prefill.cached_tokens)
        leg = await self._prefill(routed, plan.prefill, deadline)
        if leg is None:  # no prefill worker could do it: the request is served whole
            metrics.pd_path["fallback"].inc()
            return await self._serve(routed, arrival, deadline, first=None, count_hit=True)
        metrics.pd_path["disaggregated"].inc()
        try:  # the decode worker is chosen now, by its load now that the prefill is done
            return await self._serve(routed, arrival, deadline, first=None, leg=leg)
        finally:
            if not leg.sent:  # no decode worker got the blocks: free them now
                self._release_prefill(leg)

    async def _serve(
        self,
        routed: Routed,
        arrival: float,
        deadline: float,
        *,
        first: Decision | None,
        leg: _DecodeLeg | None = None,
        count_hit: bool = False,
    ) -> Response:
        """Send the request (whole, or a split's decode leg) to the worker of ``first`` or,
        failing that, to others in turn, and answer the client with what one of them says."""
        s = self.settings
        metrics = self._metrics()
        pool = self._pool()
        tried: set[str] = set()
        failures: list[str] = []
        suspects: list[WorkerState] = []  # answered 5xx: charged once another worker answers
        last: _Failed | None = None
        headers = {"x-kvpool-prefill-worker": leg.prefill.id} if leg is not None else {}
        for attempt in range(s.max_attempts):
            if attempt:
                await asyncio.sleep(min(s.retry_backoff_s * 2 ** (attempt - 1), 1.0))
                if time.monotonic() >= deadline:
                    break  # the request's time is spent: no other worker gets it
            if attempt == 0 and first is not None:
                decision = first
            else:
                t0 = time.perf_counter()
                decision = self._decide(routed, tried, leg="decode" if leg else "aggregated")
                metrics.decision_latency.observe(time.perf_counter() - t0)
            if decision.worker is None:
                break
            if last is not None:  # sent again: the last worker failed before any byte
                metrics.retries.labels(last.reason).inc()
            state = pool.workers[decision.worker]
            state.decisions[decision.reason] += 1
            if attempt == 0 and (first is not None or count_hit) and leg is None:
                metrics.predicted_hit_tokens.inc(decision.cached_tokens)
            if decision is not first and log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: %s", routed.request_id, decision.explain())
            self.index.speculate(state.id, routed.keys)
            now = time.monotonic()
            if leg is None:
                ticket = state.begin(
                    routed.num_tokens - decision.cached_tokens,
                    decision.predicted_ttft_s or 0.0,
                    now,
                )
            else:  # its prefill is pulled: it computes the tail, after the transfer
                ticket = state.begin(leg.tail_tokens, 0.0, now, learn=False)
            state.breaker.on_attempt(now)
            tried.add(state.id)
            try:
                resp = await self._send(
                    state, routed, deadline, body=leg.body if leg is not None else None
                )
                if leg is not None:
                    leg.sent = True
                # Another worker answered: the 5xx before it were those workers' fault.
                for suspect in suspects:
                    suspect.breaker.on_failure(time.monotonic())
                suspects.clear()
                return await self._respond(
                    state,
                    ticket,
                    routed,
                    resp,
                    arrival,
                    deadline,
                    headers=headers,
                    count_usage=leg is None,
                )
            except _Failed as exc:
                state.end(ticket)
                last = exc
                failures.append(f"{state.id}: {exc}")
                if exc.reason == "5xx":
                    suspects.append(state)
            except BaseException:  # cancelled (the client left, shutdown) or a bug
                state.end(ticket)
                raise
        if last is None:
            metrics.requests.labels("no_worker").inc()
            raise OpenAIError(
                503,
                "no worker can take this request now"
                + (f" (tried: {'; '.join(failures)})" if failures else ""),
                type="service_unavailable",
                code="no_worker",
                headers={"Retry-After": "1"},
            )
        outcome = {"overloaded": "overloaded", "timeout": "timeout"}.get(
            last.reason, "worker_error"
        )
        metrics.requests.labels(outcome).inc()
        raise OpenAIError(
            last.status,
            f"the request failed on {len(failures)} worker(s): {'; '.join(failures)}",
            type="rate_limit_error" if last.status == 429 else "server_error",
            code={"overloaded": "workers_overloaded", "timeout": "timeout"}.get(
                last.reason, "worker_unavailable"
            ),
            headers={"Retry-After": "1"} if last.status in (429, 503) else None,
        )

    # -- the prefill leg of a split ---------------------------------------------------------

    async def _prefill(self, routed: Routed, first: Decision, deadline: float) -> _DecodeLeg | None:
        """Run the prefill leg on the worker of ``first``, or on other prefill workers in
        turn if it fails; the decode leg that follows, or None if no prefill worker did it
        (the caller then serves the request whole)."""
        s = self.settings
        metrics = self._metrics()
        pool = self._pool()
        request = json.loads(routed.body)
        body = _prefill_body(request)
        tried: set[str] = set()
        suspects: list[WorkerState] = []
        last: _Failed | None = None
        decision: Decision | None = first
        for attempt in range(s.max_attempts):
            if attempt:
                await asyncio.sleep(min(s.retry_backoff_s * 2 ** (attempt - 1), 1.0))
                if time.monotonic() >= deadline:
                    break
                t0 = time.perf_counter()
                decision = self._decide(routed, tried, leg="prefill")
                metrics.decision_latency.observe(time.perf_counter() - t0)
            if decision is None or decision.worker is None:
                break
            if last is not None:
                metrics.retries.labels(last.reason).inc()
            state = pool.workers[decision.worker]
            state.decisions[decision.reason] += 1
            if attempt and log.isEnabledFor(logging.DEBUG):
                log.debug("request %s: prefill %s", routed.request_id, decision.explain())
            self.index.speculate(state.id, routed.keys)
            now = time.monotonic()
            ticket = state.begin(
                routed.num_tokens - decision.cached_tokens, decision.predicted_ttft_s or 0.0, now
            )
            state.breaker.on_attempt(now)
            tried.add(state.id)
            leg_deadline = min(deadline, now + s.pd_prefill_timeout_s)
            try:
                answer = await self._prefill_leg(state, routed, body, leg_deadline)
                state.first_token(ticket, time.monotonic())  # the leg's TTFT: a prefill's
            except _Failed as exc:
                last = exc
                metrics.prefill_failures.labels(exc.reason).inc()
                log.warning(
                    "request %s: prefill leg on %s failed: %s", routed.request_id, state.id, exc
                )
                if exc.reason == "5xx":
                    suspects.append(state)
                if exc.reason in ("refused", "no_params"):
                    break  # a refusal of the split itself: another prefill worker would too
                continue
            finally:
                state.end(ticket)
            for suspect in suspects:
                suspect.breaker.on_failure(time.monotonic())
            metrics.prefill_leg.observe(time.monotonic() - now)
            usage = answer.get("usage")
            if isinstance(usage, dict):  # the prefill worker's cache is the one that counts
                self._observe_usage(usage)
            params = answer["kv_transfer_params"]
            full = routed.num_tokens // self.settings.block_size * self.settings.block_size
            return _DecodeLeg(
                body=json.dumps({**request, "kv_transfer_params": params}).encode(),
                params=params,
                prefill=state,
                tail_tokens=max(routed.num_tokens - full, 1),
            )
        log.warning(
            "request %s: no prefill leg succeeded (%s); serving it whole",
            routed.request_id,
            last or "no prefill worker",
        )
        return None

    async def _prefill_leg(
        self, state: WorkerState, routed: Routed, body: bytes, deadline: float
    ) -> dict[str, Any]:
        """The prefill worker's answer, with its ``kv_transfer_params``, or :class:`_Failed`."""
        resp = await self._send(state, routed, deadline, body=body)
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                content = await resp.read()
        except TimeoutError:
            state.breaker.on_failure(time.monotonic())
            raise _Failed("timeout", "no answer before the prefill timeout", 504) from None
        except (aiohttp.ClientError, OSError) as exc:
            state.breaker.on_failure(time.monotonic())
            raise _Failed("connection", f"{type(exc).__name__}: {exc}") from None
        finally:
            resp.release()  # kept if read to its end, closed if not
        text = content.decode(errors="replace")
        if resp.status != 200:
            raise _Failed("refused", f"{resp.status} {_error_message(text)[:300]}")
        try:
            answer = json.loads(content)
            params = answer.get("kv_transfer_params")
        except (ValueError, AttributeError):
            answer, params = None, None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise _Failed("no_params", f"the answer has no kv_transfer_params: {text[:200]}")
        state.breaker.on_success()
        return answer

    def _release_prefill(self, leg: _DecodeLeg) -> None:
        """Free blocks pinned for a decode leg that no worker got (a kvpool prefill worker's
        ``DELETE /kv/{id}``; any other's pin times out on its own)."""
        rid = leg.params.get("remote_request_id")
        if leg.prefill.info is None or not isinstance(rid, str) or self.upstream is None:
            return
        url = f"{leg.prefill.url}/kv/{urllib.parse.quote(rid, safe='')}"
        upstream = self.upstream

        async def delete() -> None:
            with contextlib.suppress(Exception):  # best effort: the pin times out anyway
                async with upstream.delete(url, timeout=aiohttp.ClientTimeout(total=5.0)):
                    pass

        task = asyncio.ensure_future(delete())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(
        self, state: WorkerState, routed: Routed, deadline: float, *, body: bytes | None = None
    ) -> aiohttp.ClientResponse:
        """The worker's response with its headers read, or :class:`_Failed` if this worker
        cannot answer it (and another may). ``body``: a split's leg, not the client's."""
        assert self.upstream is not None
        pool = self._pool()
        now = time.monotonic()
        try:
            async with asyncio.timeout(max(deadline - now, 0.001)):
                resp = await self.upstream.post(
                    state.url + routed.path,
                    data=routed.body if body is None else body,
                    headers={"content-type": "application/json", "x-request-id": routed.request_id},
                )
        except aiohttp.ConnectionTimeoutError as exc:  # perhaps only busy: the health check decides
            state.breaker.on_failure(time.monotonic())
            raise _Failed("connect", f"connection timed out ({exc or 'connect timeout'})") from None
        except TimeoutError:
            state.breaker.on_failure(time.monotonic())
            raise _Failed("timeout", "no answer before the request timeout", 504) from None
        except aiohttp.ClientConnectorError as exc:  # refused: nothing listens there any more
            state.breaker.on_failure(time.monotonic())
            pool.mark_down(state, f"connection failed: {exc.os_error}")
            raise _Failed("connect", f"connection failed ({exc.os_error})") from None
        except (aiohttp.ClientError, OSError) as exc:
            state.breaker.on_failure(time.monotonic())
            raise _Failed("connection", f"{type(exc).__name__}: {exc}") from None
        if resp.status < 500 and resp.status != 429:
            return resp
        # Retried elsewhere: the worker said nothing the client has seen yet.
        text = ""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with asyncio.timeout(1.0):
                text = (await resp.read()).decode(errors="replace")[:300]
        resp.release()
        if resp.status == 429:
            raise _Failed("overloaded", f"429 {_error_message(text)}", 429)
        # Not charged to the breaker yet: a request that fails on every worker is more
        # likely bad than every worker broken (see _proxy).
        raise _Failed("5xx", f"{resp.status} {_error_message(text)}")

    async def _respond(
        self,
        state: WorkerState,
        ticket: Ticket,
        routed: Routed,
        resp: aiohttp.ClientResponse,
        arrival: float,
        deadline: float,
        *,
        headers: dict[str, str] | None = None,
        count_usage: bool = True,
    ) -> Response:
        """``count_usage=False``: a decode leg, whose cached prompt tokens are the blocks it
        pulled, not a cache hit (the prefill leg's usage was counted instead)."""
        headers = {
            **{k: v for k in PASSED_HEADERS if (v := resp.headers.get(k)) is not None},
            **(headers or {}),
        }
        headers["x-request-id"] = routed.request_id
        headers["x-kvpool-worker"] = state.id
        if routed.stream and resp.status == 200:
            relay = _Relay(
                self, state, ticket, routed, resp, arrival, deadline, count_usage=count_usage
            )
            return _RelayResponse(relay, headers)
        metrics = self._metrics()
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                content = await resp.read()
        except TimeoutError:
            resp.close()
            metrics.requests.labels("timeout").inc()
            state.breaker.on_failure(time.monotonic())
            raise OpenAIError(
                504,
                f"worker {state.id} did not answer before the request timeout",
                type="server_error",
                code="timeout",
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            # Nothing has reached the client yet: another worker may answer it.
            resp.close()
            state.breaker.on_failure(time.monotonic())
            message = f"failed while answering: {type(exc).__name__}: {exc}"
            raise _Failed("connection", message) from None
        except BaseException:  # cancelled: the worker's connection is closed, so it aborts
            resp.close()
            raise
        finally:
            resp.release()
            state.end(ticket)
        ok = resp.status < 400
        metrics.requests.labels("success" if ok else "client_error").inc()
        if ok:
            state.breaker.on_success()
            metrics.e2e.observe(time.monotonic() - arrival)
            if count_usage:
                self._count_usage(content)
        return Response(content, status_code=resp.status, headers=headers)

    def _count_usage(self, payload: bytes) -> None:
        try:
            usage = json.loads(payload).get("usage") or {}
        except (ValueError, AttributeError):
            return
        self._observe_usage(usage)

    def _observe_usage(self, usage: dict[str, Any]) -> None:
        metrics = self._metrics()
        prompt = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if isinstance(prompt, int) and isinstance(cached, int):
            metrics.reported_prompt_tokens.inc(prompt)
            metrics.realised_hit_tokens.inc(cached)


@dataclass
class _Relay:
    """The worker's SSE stream passed on as it arrives, with the router's TTFT and
    inter-token latencies taken from it; a failure mid-stream ends it with an error event.
    :meth:`close` releases the worker and the router's slot exactly once, whether the
    stream ended, failed, or never started because the client had already gone."""

    router: Router
    state: WorkerState
    ticket: Ticket
    routed: Routed
    resp: aiohttp.ClientResponse
    arrival: float
    deadline: float
    count_usage: bool = True
    outcome: str = "cancelled"
    closed: bool = False

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.outcome == "success":
            self.resp.release()  # read to its end: the connection is kept
        else:  # closed mid-answer: the worker sees it and aborts the request
            self.resp.close()
        self.state.end(self.ticket)
        self.router.active -= 1
        metrics = self.router._metrics()
        metrics.requests.labels(self.outcome).inc()
        if self.outcome == "success":
            metrics.e2e.observe(time.monotonic() - self.arrival)

    async def stream(self) -> AsyncIterator[bytes]:
        router, state = self.router, self.state
        metrics = router._metrics()
        events = _SSEWatch()
        last_token: float | None = None
        try:
            chunks = self.resp.content.iter_any()
            while True:
                try:
                    async with asyncio.timeout(max(self.deadline - time.monotonic(), 0.001)):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                now = time.monotonic()
                for kind, payload in events.feed(chunk):
                    if kind == "token":
                        if last_token is None:
                            metrics.ttft.observe(now - self.arrival)
                            state.first_token(self.ticket, now)
                        else:
                            metrics.itl.observe(now - last_token)
                        last_token = now
                    elif kind == "usage" and self.count_usage:
                        router._observe_usage(payload)
                yield chunk
            if not events.done:  # the worker closed the stream without [DONE]
                self.outcome = "stream_error"
                state.breaker.on_failure(time.monotonic())
                yield events.cut() + _sse_error(
                    f"worker {state.id} ended the stream early", "worker_failed"
                )
            else:
                self.outcome = "stream_error" if events.error else "success"
                state.breaker.on_success()
        except TimeoutError:
            self.outcome = "timeout"
            yield events.cut() + _sse_error(
                f"the request timeout ({router.settings.request_timeout_s:g} s) passed", "timeout"
            )
        except (aiohttp.ClientError, OSError) as exc:
            self.outcome = "stream_error"
            state.breaker.on_failure(time.monotonic())
            log.warning(
                "request %s: worker %s failed mid-stream: %s", self.routed.request_id, state.id, exc
            )
            yield events.cut() + _sse_error(
                f"worker {state.id} failed mid-stream: {type(exc).__name__}", "worker_failed"
            )
        finally:
            await self.close()


class _RelayResponse(StreamingResponse):
    """Starlette's streaming response watches for the client leaving with an anyio task
    group, two tasks a request; this one relays in the request's own task, with one
    watcher that cancels it when the client hangs up."""

    def __init__(self, relay: _Relay, headers: dict[str, str]) -> None:
        super().__init__(relay.stream(), headers=headers, media_type="text/event-stream")
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with _until_client_leaves(receive):
                await self.stream_response(send)
        finally:
            await self.relay.close()


@asynccontextmanager
async def _until_client_leaves(receive: Any) -> AsyncIterator[None]:
    """Cancel the body of the ``async with`` when the client disconnects (its request body
    has been read: nothing else comes), and carry on after it; a cancellation from
    elsewhere passes through. Cheaper than a task for the work and one for the watch."""
    this = asyncio.current_task()
    assert this is not None
    left = False

    async def watch() -> None:
        nonlocal left
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # cannot tell whether the client is there: carry on
            return
        left = True
        this.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left:
            raise
        this.uncancel()
    finally:
        watcher.cancel()


def _prefill_body(request: dict[str, Any]) -> bytes:
    """The prefill leg of a client's body, as vLLM's disaggregated proxy sends it: one
    token, not streamed, ``do_remote_decode`` (its answer says where the blocks are)."""
    body = {k: v for k, v in request.items() if k not in ("stream_options", "min_tokens")}
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return json.dumps(body).encode()


def _sse_error(message: str, code: str) -> bytes:
    err = OpenAIError(502, message, type="server_error", code=code)
    return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"


def _error_message(text: str) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(text)["error"]["message"])
    return text


class _SSEWatch:
    """Reads an SSE stream as it passes, to see its first token, its usage and its end,
    without holding it back. Events are parsed only until the first token (later ones are
    only counted), except a final usage chunk."""

    def __init__(self) -> None:
        self.buffer = b""
        self.seen_token = False
        self.done = False
        self.error = False

    def feed(self, chunk: bytes) -> Iterator[tuple[str, Any]]:
        self.buffer += chunk
        while True:
            end = self.buffer.find(b"\n\n")
            if end < 0:
                return
            event, self.buffer = self.buffer[:end], self.buffer[end + 2 :]
            yield from self._event(event)

    def cut(self) -> bytes:
        """What ends an event the client got only part of, so that what follows is read
        as an event of its own (and a half event is dropped by the client's parser)."""
        cut, self.buffer = (b"\n\n" if self.buffer else b""), b""
        return cut

    def _event(self, event: bytes) -> Iterator[tuple[str, Any]]:
        data = b"\n".join(
            line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            return
        if data == b"[DONE]":
            self.done = True
            return
        if self.seen_token and b'"usage"' not in data and b'"error"' not in data:
            yield "token", None
            return
        try:
            body = json.loads(data)
        except ValueError:
            return
        if not isinstance(body, dict):
            return
        if "error" in body:
            self.error = True
            return
        usage = body.get("usage")
        if usage:
            yield "usage", usage
        if any(_has_token(c) for c in body.get("choices") or ()):
            self.seen_token = True
            yield "token", None


def _has_token(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text") or choice.get("finish_reason"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls"))


# -- running it ----------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """The first signal closes the listening socket (new connections are refused), answers
    503 to requests on connections still open, and lets the streams in flight finish, up to
    ``drain_timeout_s`` (uvicorn's graceful shutdown); a second Ctrl-C stops at once."""

    def __init__(self, config: uvicorn.Config, router: Router) -> None:
        super().__init__(config)
        self.router = router

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.router.draining:
            log.info("signal %s: draining %d requests", sig, self.router.active)
        self.router.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                self.router.bound_port = sock.getsockname()[1]


def uvicorn_server(router: Router, log_level: str = "warning") -> _Uvicorn:
    s = router.settings
    config = uvicorn.Config(
        router.app,
        host=s.host,
        port=s.port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(s.drain_timeout_s),
        access_log=False,
        lifespan="on",
    )
    return _Uvicorn(config, router)


def serve(settings: RouterSettings, log_level: str = "info") -> None:
    """Run the router until SIGTERM/SIGINT, then drain."""
    uvicorn_server(Router(settings), log_level=log_level).run()
