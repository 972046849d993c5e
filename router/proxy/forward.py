"""The data path's way to the workers: a routed request sent to the worker the plan chose
or, failing that, to others in turn, and the client answered with what one of them says.

A failure before the first token is invisible to the client. Nothing is sent to the
client before the worker's first output event (or its whole answer, when not streamed):
a connection error, a 5xx or a 429, a reset, a stream that ends or errors with no output,
no output before the time-to-first-token limit, or the worker failing its health check
meanwhile sends the request to another worker (bounded attempts, with backoff). Once
output has reached the client, a worker failure, or a stream silent for longer than the
idle timeout, ends it with an SSE error event and ``[DONE]``, never a hang. A client that
leaves at any moment cancels the worker's request and releases what was counted for it.

A request the planner splits goes first to a prefill worker (``max_tokens: 1``, not
streamed, ``kv_transfer_params.do_remote_decode``), whose answer's ``kv_transfer_params``
are added to the client's body for the decode worker, whose answer is relayed like any
other. A failed prefill leg is tried on another prefill worker; when none is left, the
request is served whole (the decode worker computes its prefill): a split never costs the
client an answer.

Its interface is narrow: the gateway (:mod:`.server`) hands it a :class:`Routed` request
and the planner's :class:`~.policy.Plan`; it asks back for another worker (``decide``) and
says where a conversation went (``pin``). It writes the load it sends each worker (a
ticket per attempt, :mod:`.load`) and nothing else of the routing state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from fastapi.responses import Response

from kvpool import tracing
from kvpool.openai_api import OpenAIError

from ..admin.metrics import RouterMetrics
from ..admission.gate import Gate
from ..routing.inputs import Decision
from ..routing.planner import Plan
from ..settings import RouterSettings
from ..state.load import Ticket
from ..state.pool import WorkerPool
from ..state.worker import WorkerState
from .http1 import ConnectFailed, ConnectTimedOut, UpstreamResponse
from .relay import Failed, Relay, RelayResponse, error_message
from .routed import DecodeLeg, Routed
from .split import PrefillLeg
from .sse import SSEWatch
from .tries import Attempt, Tries
from .upstream import Upstream

__all__ = ["DP_RANK_HEADER", "PASSED_HEADERS", "Forwarder"]

log = logging.getLogger("kvpool.router.server")

#: response headers passed back from the worker
PASSED_HEADERS = ("content-type", "retry-after")
#: vLLM's header that sends a request to one data-parallel rank of a pod
DP_RANK_HEADER = "X-data-parallel-rank"
#: another worker for a request sent again: ``decide(routed, tried, leg=...)``, the leg
#: ``aggregated``, ``prefill`` or ``decode``; the policy's decision
Decide = Callable[..., Decision]
#: where a conversation went: (table, key, worker)
Pin = Callable[[str, str, str], None]


class Forwarder(PrefillLeg):
    """Sends routed requests to workers and answers their clients (see the module)."""

    def __init__(
        self,
        settings: RouterSettings,
        pool: WorkerPool,
        metrics: RouterMetrics,
        gate: Gate,
        http: Upstream,
        upstream: aiohttp.ClientSession,
        decide: Decide,
        pin: Pin,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.gate = gate
        self.http = http  # the generate requests (our own client)
        self.upstream = upstream  # the rest: a split's clean-up
        self.decide = decide
        self.pin = pin
        self._leader_blocks = settings.leader_blocks()
        self._background: set[asyncio.Future[None]] = set()  # fire-and-forget releases

    async def forward(
        self, routed: Routed, plan: Plan, arrival: float, deadline: float
    ) -> Response:
        """Serve ``routed`` the way ``plan`` says: whole, or split in two legs."""
        metrics = self.metrics
        if plan.prefill is None:
            metrics.pd_path["aggregated"].inc()
            return await self._serve(routed, arrival, deadline, first=plan.decode)
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
        leg: DecodeLeg | None = None,
        count_hit: bool = False,
    ) -> Response:
        """Send the request (whole, or a split's decode leg) to the worker of ``first`` or,
        failing that, to others in turn, and answer the client with what one of them says.
        ``deadline``, for a whole answer: no attempt starts after it, and none waits past it.
        A stream's attempts each wait ``first_token_timeout_s`` for their first token: a
        worker that hangs while its health check still answers (a stuck engine behind a live
        API server) loses the request to another worker, not the client."""
        s = self.settings
        metrics = self.metrics
        tries = Tries(
            s,
            self.pool,
            metrics,
            routed.request_id,
            routed.keys,
            lambda tried: self.decide(routed, tried, leg="decode" if leg else "aggregated"),
            first=first,
            ranks=routed.ranks,
            stop_at=None if routed.stream else deadline,
        )
        headers = {"x-kvpool-prefill-worker": leg.prefill.id} if leg is not None else {}
        while (t := await tries.next()) is not None:
            state, decision = t.state, t.decision
            if t.number == 0 and (first is not None or count_hit) and leg is None:
                metrics.predicted_hit_tokens.inc(decision.cached_tokens)
            now = time.monotonic()
            held = routed.num_tokens + routed.max_tokens  # its KV there while it runs
            if leg is None:
                ticket = state.begin(
                    routed.num_tokens - decision.cached_tokens,
                    decision.predicted_ttft_s or 0.0,
                    now,
                    shows_first_token=routed.stream,
                    kv_tokens=held,
                    keys=routed.keys,
                    credited_blocks=decision.cached_tokens // s.block_size,
                    queued_ahead=decision.queued_tokens,
                )
            else:  # its prefill is pulled: it computes the tail, after the transfer
                ticket = state.begin(
                    leg.tail_tokens,
                    0.0,
                    now,
                    learn=False,
                    shows_first_token=routed.stream,
                    kv_tokens=held,
                )
            attempt = Attempt()
            state.attempts.add(attempt)
            limit = now + s.first_token_timeout_s if routed.stream else deadline
            if routed.admitted is not None:
                routed.admitted.on_worker()
            # The attempt's span lasts as long as the attempt: a stream's, to its end.
            span = tracing.start_span(
                "kvpool.router.proxy.upstream",
                {"kvpool.worker": state.id, "kvpool.attempt": t.number + 1},
            )
            span_error: str | None = "cancelled"
            try:
                if leg is None and routed.reads_cache:  # one that reads none waits for none
                    await self._follow(state, ticket, limit)
                extra = {DP_RANK_HEADER: str(t.rank)} if t.rank is not None else {}
                with tracing.activated(span):
                    tracing.inject(extra)  # the worker's spans join this trace
                    resp = await self._send(
                        state,
                        routed,
                        limit,
                        body=leg.body if leg is not None else None,
                        headers=extra,
                    )
                if leg is not None:
                    leg.sent = True
                response = await self._respond(
                    state,
                    ticket,
                    routed,
                    resp,
                    arrival,
                    limit,
                    attempt,
                    headers=headers,
                    predicted=decision.matched_tokens if leg is None else None,
                )
            except asyncio.CancelledError:
                failure = attempt.failure()
                if failure is None:  # the client left, shutdown, or a bug: not retried
                    state.end(ticket)
                    tries.reached(t)
                    raise
                exc = failure
                span_error = str(failure)
            except Failed as failed:
                exc = failed
                span_error = str(failed)
            except BaseException:
                state.end(ticket)
                tries.reached(t)
                raise
            else:
                # its first token (a stream) or its whole answer: the worker has its blocks
                tries.reached(t, computed=not _refused(response))
                tries.succeeded()
                if routed.session:
                    self.pin("session", routed.session, state.id)
                if isinstance(response, RelayResponse):
                    response.relay.span, span = span, None  # it ends with the stream
                span_error = None
                return response
            finally:
                state.attempts.discard(attempt)
                if span is not None:
                    tracing.end_span(span, span_error)
            state.end(ticket)
            tries.failed(t, exc, suspect=exc.reason in ("5xx", "no_token"))
            log.warning("request %s: worker %s failed: %s", routed.request_id, state.id, exc)
        last, failures = tries.last, tries.failures
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
        outcome = {"overloaded": "overloaded", "timeout": "timeout", "ttft_timeout": "timeout"}
        metrics.requests.labels(outcome.get(last.reason, "worker_error")).inc()
        raise OpenAIError(
            last.status,
            f"the request failed on {len(failures)} worker(s): {'; '.join(failures)}",
            type="rate_limit_error" if last.status == 429 else "server_error",
            code={
                "overloaded": "workers_overloaded",
                "timeout": "timeout",
                "ttft_timeout": "timeout",
            }.get(last.reason, "worker_unavailable"),
            headers={"Retry-After": "1"} if last.status in (429, 503) else None,
        )

    async def _follow(self, state: WorkerState, ticket: Ticket, limit: float) -> None:
        """Hold a request back while a request routed before it to the same worker is
        still prefilling prompt blocks they share (:meth:`~.load.WorkerLoad.leader`): then
        it finds them cached instead of computing them a second time beside the first.
        Its ticket is already counted there, so decisions made meanwhile see its load."""
        min_blocks, block_size = self._leader_blocks, self.settings.block_size
        model = lambda: self.pool.prefill_model(state)  # noqa: E731 - asked only with a leader
        while (found := state.leader(ticket, min_blocks, block_size, model)) is not None:
            leader, until = found
            start = time.monotonic()
            wait = min(until, limit) - start
            if wait <= 0:
                return
            try:
                async with asyncio.timeout(wait):
                    await leader.prefilled().wait()
            except TimeoutError:
                self.metrics.prefix_wait.labels("timeout").observe(time.monotonic() - start)
                return
            self.metrics.prefix_wait.labels("prefilled").observe(time.monotonic() - start)

    async def _send(
        self,
        state: WorkerState,
        routed: Routed,
        deadline: float,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> UpstreamResponse:
        """The worker's response with its headers read, or :class:`Failed` if this worker
        cannot answer it (and another may). ``body``: a split's leg, not the client's."""
        assert self.http is not None
        pool = self.pool
        now = time.monotonic()
        sent = {"content-type": "application/json", "x-request-id": routed.request_id}
        sent.update(routed.headers)
        if headers:
            sent.update(headers)
        try:
            async with asyncio.timeout(max(deadline - now, 0.001)):
                resp = await self.http.post(
                    state.url, routed.path, routed.body if body is None else body, sent
                )
        except ConnectTimedOut:  # perhaps only busy: the health check decides
            state.breaker.on_failure(time.monotonic())
            raise Failed("connect", "connection timed out") from None
        except TimeoutError:
            state.breaker.on_failure(time.monotonic())
            reason = "ttft_timeout" if routed.stream else "timeout"
            raise Failed(reason, "no answer before the time limit", 504) from None
        except ConnectFailed as exc:  # refused: nothing listens there any more
            state.breaker.on_failure(time.monotonic())
            pool.mark_down(state, f"connection failed: {exc.os_error}", dead=True)
            raise Failed("connect", "connection refused") from None
        except OSError as exc:
            if not self.http.closed:  # at shutdown it is the router's doing, not the worker's
                state.breaker.on_failure(time.monotonic())
            log.info("request %s: %s: %r", routed.request_id, state.id, exc)
            raise Failed("connection", f"connection lost ({type(exc).__name__})") from None
        if resp.status < 500 and resp.status != 429:
            return resp
        # Retried elsewhere: the worker said nothing the client has seen yet.
        text = ""
        try:
            with contextlib.suppress(OSError):  # TimeoutError too
                async with asyncio.timeout(1.0):
                    text = (await resp.read()).decode(errors="replace")[:300]
        finally:
            resp.release()
        if resp.status == 429:
            raise Failed("overloaded", f"429 {error_message(text)}", 429)
        # Not charged to the breaker yet: a request that fails on every worker is more
        # likely bad than every worker broken (see _serve).
        raise Failed("5xx", f"{resp.status} {error_message(text)}")

    async def _respond(
        self,
        state: WorkerState,
        ticket: Ticket,
        routed: Routed,
        resp: UpstreamResponse,
        arrival: float,
        deadline: float,
        attempt: Attempt,
        *,
        headers: dict[str, str] | None = None,
        predicted: int | None = 0,
    ) -> Response:
        """The client's answer from this worker's response, once it is sure to be one: a
        stream's first output, or the whole body. :class:`Failed` before that.
        ``predicted``: the cached prompt tokens the index said the worker holds, checked
        against its usage; None for a decode leg, whose cached prompt tokens are the blocks
        it pulled, not a cache hit (the prefill leg's usage was counted instead)."""
        headers = {
            **{k: v for k in PASSED_HEADERS if (v := resp.headers.get(k)) is not None},
            **(headers or {}),
        }
        headers["x-request-id"] = routed.request_id
        headers["x-kvpool-worker"] = state.id
        if routed.admitted is not None:
            headers.update(routed.admitted.headers)  # x-ratelimit-*
        if routed.stream and resp.status == 200:
            relay = Relay(
                state,
                ticket,
                routed.request_id,
                resp,
                arrival,
                SSEWatch(routed.strip_usage),
                self.metrics,
                self.settings.stream_idle_timeout_s,
                on_close=lambda relay: self._relay_closed(relay, routed, predicted),
            )
            try:
                await relay.first_output(deadline)
            except BaseException:
                resp.close()  # the worker sees it and aborts the request
                raise
            attempt.committed = True
            return RelayResponse(relay, headers)
        metrics = self.metrics
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                content = await resp.read()
        except TimeoutError:
            resp.close()
            state.breaker.on_failure(time.monotonic())
            raise Failed("timeout", "no answer before the request timeout", 504) from None
        except OSError as exc:
            # Nothing has reached the client yet: another worker may answer it.
            resp.close()
            state.breaker.on_failure(time.monotonic())
            raise Failed("connection", f"failed while answering ({type(exc).__name__})") from None
        except BaseException:  # cancelled: the worker's connection is closed, so it aborts
            resp.close()
            raise
        finally:
            resp.release()
        attempt.committed = True
        now = time.monotonic()
        ok = resp.status < 400
        answer = _answer_of(content) if ok else {}
        usage = answer.get("usage")
        usage = usage if isinstance(usage, dict) else None
        if ok:
            completion = (
                usage.get("completion_tokens", usage.get("output_tokens")) if usage else None
            )
            choices = answer.get("choices")
            if isinstance(completion, int) and isinstance(choices, list) and len(choices) > 1:
                completion //= len(choices)  # n choices decode side by side
            state.finish_whole(ticket, now, completion if isinstance(completion, int) else None)
            if routed.kind == "responses" and isinstance(answer.get("id"), str):
                self.pin("response", answer["id"], state.id)
        state.end(ticket)
        metrics.requests.labels("success" if ok else "client_error").inc()
        if routed.admitted is not None:
            routed.admitted.usage = usage  # settles its tokens when the request ends
        if ok:
            state.breaker.on_success()
            metrics.e2e.observe(now - arrival)
            if predicted is not None and usage:
                self._observe_usage(usage, state, predicted)
        return Response(content, status_code=resp.status, headers=headers)

    def _relay_closed(self, relay: Relay, routed: Routed, predicted: int | None) -> None:
        """A relayed stream ended: settle its admission, count its usage, and remember where
        its stored response is."""
        admitted = routed.admitted
        if admitted is not None:
            admitted.usage = relay.events.usage
            if relay.outcome != "success":
                admitted.error = relay.outcome
            self.gate.finish(admitted)
        if predicted is not None and relay.events.usage is not None:
            self._observe_usage(relay.events.usage, relay.state, predicted)
        if relay.events.response_id is not None:
            self.pin("response", relay.events.response_id, relay.state.id)

    def _observe_usage(self, usage: dict[str, Any], state: WorkerState, predicted: int) -> None:
        """Counts an answer's prompt tokens and the cached ones (chat and completions
        name them ``prompt_tokens``, the Responses API ``input_tokens``), and checks the
        cached ones against the ``predicted`` (:mod:`.agreement`)."""
        metrics = self.metrics
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(prompt, int):
            metrics.reported_prompt_tokens.inc(prompt)
            # A worker that does not report cached tokens (vLLM without
            # --enable-prompt-tokens-details) served none from cache as far as we know.
            metrics.realised_hit_tokens.inc(cached if isinstance(cached, int) else 0)
        valid = isinstance(cached, int) and not isinstance(cached, bool)
        self.pool.check_cache(state, predicted, cached if valid else None)


def _refused(response: Response) -> bool:
    """The worker answered the request by refusing it (a 4xx, streamed or not): it
    computed nothing of its prompt."""
    if isinstance(response, RelayResponse):
        events = response.relay.events
        return events.client_error and not events.started
    return response.status_code >= 400


def _answer_of(content: bytes) -> dict[str, Any]:
    """A whole answer's JSON object (empty when it is not one)."""
    try:
        answer = json.loads(content)
    except (ValueError, RecursionError):
        return {}
    return answer if isinstance(answer, dict) else {}
