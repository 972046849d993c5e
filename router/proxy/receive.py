"""Receiving a generate request (:class:`.server.Router`'s part): its body read and
parsed, admitted, tokenized and hashed, then planned and forwarded (:mod:`.forward`).
The client's address and the answer a draining router gives are here too."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from kvpool import tracing
from kvpool.httpguard import BodyError, read_body
from kvpool.openai_api import (
    OpenAIError,
    model_not_found,
    output_over_context,
)

from ..routing.tokens import PromptTokens
from .relay import (
    RelayResponse,
    until_client_leaves,
)
from .request import Kind, RoutingFields, parse_body, read_fields
from .routed import Routed

__all__ = ["FORWARDED_HEADERS", "GENERATE_PATHS", "MAX_REQUEST_ID", "WORKER_PATHS", "Receive"]

log = logging.getLogger(__name__)

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


class Receive:
    """:class:`.server.Router`'s generate path, from the body to the forwarder."""

    async def _generate(self, request: Request, kind: Kind) -> Response:
        arrival = time.monotonic()
        metrics = self._metrics()
        if self.draining:
            metrics.requests.labels("no_worker").inc()
            raise draining_error()
        gate = self._gate()
        # Who sends it, and within its requests limit: before its body is read, and before
        # it holds anything of the router's (no slot while a slow client dribbles a body).
        admitted = gate.enter(request.headers, client_address(request))
        if tracing.tracer() is not None:
            admitted.span = tracing.start_span(
                "kvpool.router.proxy.request",
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


def client_address(request: Request) -> str | None:
    """The address the request's connection comes from (None over a Unix socket)."""
    return request.client.host if request.client is not None else None


def draining_error() -> OpenAIError:
    return OpenAIError(
        503, "the router is shutting down", type="service_unavailable", code="draining"
    )
