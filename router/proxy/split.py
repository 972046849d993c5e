"""The prefill leg of a split request (:class:`.forward.Forwarder`'s part): a prefill
worker computes the prompt and hands its blocks to the decode worker; a failed leg is
tried on another prefill worker, and with none left the request is served whole."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse
from typing import Any

import aiohttp

from kvpool import tracing

from ..routing.inputs import Decision
from ..state.worker import WorkerState
from .relay import Failed, error_message
from .routed import DecodeLeg, Routed
from .tries import Tries

__all__ = ["PrefillLeg", "prefill_body"]

log = logging.getLogger("kvpool.router.server")


class PrefillLeg:
    """:class:`.forward.Forwarder`'s prefill legs."""

    async def _prefill(self, routed: Routed, first: Decision, deadline: float) -> DecodeLeg | None:
        """Run the prefill leg on the worker of ``first``, or on other prefill workers in
        turn if it fails; the decode leg that follows, or None if no prefill worker did it
        (the caller then serves the request whole)."""
        s = self.settings
        metrics = self.metrics
        request = json.loads(routed.body)
        body = prefill_body(request)
        tries = Tries(
            s,
            self.pool,
            metrics,
            routed.request_id,
            routed.keys,
            lambda tried: self.decide(routed, tried, leg="prefill"),
            first=first,
            stop_at=deadline,
            what="prefill ",
        )
        while (t := await tries.next()) is not None:
            state, decision = t.state, t.decision
            now = time.monotonic()
            ticket = state.begin(
                routed.num_tokens - decision.cached_tokens,
                decision.predicted_ttft_s or 0.0,
                now,
                shows_first_token=True,  # the leg's answer is its first token
                kv_tokens=routed.num_tokens,
                keys=routed.keys,
                credited_blocks=decision.cached_tokens // s.block_size,
                queued_ahead=decision.queued_tokens,
            )
            leg_deadline = min(deadline, now + s.pd_prefill_timeout_s)
            try:
                await self._follow(state, ticket, leg_deadline)
                answer = await self._prefill_leg(state, routed, body, leg_deadline)
                state.first_token(ticket, time.monotonic())  # the leg's TTFT: a prefill's
            except Failed as exc:
                tries.failed(t, exc, suspect=exc.reason == "5xx")
                metrics.prefill_failures.labels(exc.reason).inc()
                log.warning(
                    "request %s: prefill leg on %s failed: %s", routed.request_id, state.id, exc
                )
                if exc.reason in ("refused", "no_params"):
                    break  # a refusal of the split itself: another prefill worker would too
                continue
            finally:
                state.end(ticket)
                tries.reached(t)  # the leg's answer is its first token (a failure: no-op)
            tries.succeeded()
            metrics.prefill_leg.observe(time.monotonic() - now)
            usage = answer.get("usage")
            if isinstance(usage, dict):  # the prefill worker's cache is the one that counts
                self._observe_usage(usage, state, decision.matched_tokens)
            params = answer["kv_transfer_params"]
            full = routed.num_tokens // self.settings.block_size * self.settings.block_size
            return DecodeLeg(
                body=json.dumps({**request, "kv_transfer_params": params}).encode(),
                params=params,
                prefill=state,
                tail_tokens=max(routed.num_tokens - full, 1),
            )
        log.warning(
            "request %s: no prefill leg succeeded (%s); serving it whole",
            routed.request_id,
            tries.last or "no prefill worker",
        )
        return None

    async def _prefill_leg(
        self, state: WorkerState, routed: Routed, body: bytes, deadline: float
    ) -> dict[str, Any]:
        """The prefill worker's answer, with its ``kv_transfer_params``, or :class:`Failed`."""
        if routed.admitted is not None:
            routed.admitted.on_worker()
        with tracing.span("kvpool.router.prefill_leg", {"kvpool.worker": state.id}):
            headers: dict[str, str] = {}
            tracing.inject(headers)
            resp = await self._send(state, routed, deadline, body=body, headers=headers)
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    content = await resp.read()
            except TimeoutError:
                state.breaker.on_failure(time.monotonic())
                raise Failed("timeout", "no answer before the prefill timeout", 504) from None
            except OSError as exc:
                state.breaker.on_failure(time.monotonic())
                raise Failed("connection", f"connection lost ({type(exc).__name__})") from None
            finally:
                resp.release()  # kept if read to its end, closed if not
        text = content.decode(errors="replace")
        if resp.status != 200:
            raise Failed("refused", f"{resp.status} {error_message(text)[:300]}")
        try:
            answer = json.loads(content)
            params = answer.get("kv_transfer_params")
        except (ValueError, AttributeError):
            answer, params = None, None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise Failed("no_params", f"the answer has no kv_transfer_params: {text[:200]}")
        state.breaker.on_success()
        return answer

    def _release_prefill(self, leg: DecodeLeg) -> None:
        """Free blocks pinned for a decode leg that no worker got (a kvpool prefill worker's
        ``DELETE /kv/{id}``; any other's pin times out on its own)."""
        rid = leg.params.get("remote_request_id")
        if leg.prefill.info is None or not isinstance(rid, str) or self.upstream is None:
            return
        url = f"{leg.prefill.url}/kv/{urllib.parse.quote(rid, safe='')}"
        upstream = self.upstream
        token = leg.params.get("kvpool_token")  # the hand-off's own one-time credential
        headers = {"Authorization": f"Bearer {token}"} if isinstance(token, str) else None

        async def delete() -> None:
            with contextlib.suppress(Exception):  # best effort: the pin times out anyway
                async with upstream.delete(
                    url, headers=headers, timeout=aiohttp.ClientTimeout(total=5.0)
                ):
                    pass

        task = asyncio.ensure_future(delete())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def prefill_body(request: dict[str, Any]) -> bytes:
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
