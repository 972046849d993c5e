"""The router's admin surface: health, models, metrics and the debug endpoints
(:class:`AdminEndpoints`, a part of :class:`.server.Router`), and what ``/debug/workers``
and ``/debug/route`` answer, built from the routing state (the pool's workers) and a plan.
The admin surface only reads the routing state; the data path (:mod:`.forward`) claims
load, and the feed (:mod:`.feed`) writes the index."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ..proxy.request import Kind, parse_body
from ..routing.heat import SESSION_PER_HOLDER, PrefixHeat
from ..routing.scorers import busy_share
from ..state.load import Ticket, common_prefix

if TYPE_CHECKING:
    from ..admission.gate import Gate
    from ..processes import ProcessSlot
    from ..proxy.routed import Routed
    from ..routing.inputs import RouteRequest
    from ..routing.planner import Plan
    from ..settings import RouterSettings
    from ..state.index import BlockIndex
    from ..state.peers import PeerLink
    from ..state.pool import WorkerPool
    from .metrics import RouterMetrics

__all__ = ["AdminEndpoints", "prefix_wait", "route_answer", "worker_rows"]


class AdminEndpoints:
    """The router's endpoints that serve people and probes, not prompts. Mixed into
    :class:`.server.Router`, whose state and parsing they read."""

    draining: bool
    _warm: bool  # every worker known at start was registered and replayed (see health)
    _first_up: float  # when /health first saw a worker in rotation (0: not yet)
    settings: RouterSettings
    slot: ProcessSlot
    index: BlockIndex
    peers: PeerLink | None
    heat: PrefixHeat

    if TYPE_CHECKING:

        def _pool(self) -> WorkerPool: ...
        def _gate(self) -> Gate: ...
        def _metrics(self) -> RouterMetrics: ...
        async def _body(self, request: Request) -> bytes: ...
        async def _parse(
            self, request: Request, body: bytes, kind: Kind, *, check_model: bool
        ) -> Routed: ...
        def _plan(self, routed: Routed, *, dry_run: bool = False) -> Plan: ...
        def _route_request(self, routed: Routed, *, observe: bool = True) -> RouteRequest: ...

    async def health(self, request: Request) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        pool = self._pool()
        up = len(pool.routable())
        # Workers whose KV event history is still being replayed into the index are out of
        # rotation until it is in. A router that has just started is not ready until every
        # worker it knows has been registered and replayed (or found down): ready with the
        # first one, it would send all its traffic there. Later, one worker coming back
        # does not make it unready.
        statuses = Counter(s.status for s in pool.workers.values())
        syncing, registering = statuses["syncing"], statuses["registering"]
        if up and not self._warm:
            now = time.monotonic()
            self._first_up = self._first_up or now
            # bounded: a worker that never settles keeps no router out of service for long
            late = now - self._first_up > self.settings.index_sync_timeout_s
            self._warm = late or not (syncing or registering)
        ready = up > 0 and self._warm
        body = {
            "status": "ok" if ready else "syncing" if syncing or up else "no_workers",
            "workers_up": up,
            "workers_syncing": syncing,
            "workers_registering": registering,
            "process": self.slot.index,
            "requests": self._gate().admitted,  # this process's, since it started
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def models(self, request: Request) -> JSONResponse:
        """Every model and LoRA adapter some worker in rotation lists, as it lists them."""
        self._gate().tenant_of(request.headers)  # /v1/* takes a key, as OpenAI's and vLLM's
        return JSONResponse({"object": "list", "data": self._pool().model_cards()})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self._metrics().render(), media_type="text/plain; version=0.0.4")

    async def debug_workers(self, request: Request) -> JSONResponse:
        self._gate().require_admin(request.headers)
        return JSONResponse({"workers": worker_rows(self._pool(), time.monotonic())})

    async def debug_peers(self, request: Request) -> JSONResponse:
        """The other router replicas: what each was last heard to have on each worker."""
        self._gate().require_admin(request.headers)
        return JSONResponse(self.peers.summary() if self.peers is not None else {"peers": []})

    async def debug_index(self, request: Request) -> JSONResponse:
        self._gate().require_admin(request.headers)
        return JSONResponse(self.index.summary())

    async def debug_route(self, request: Request) -> JSONResponse:
        """A dry run: what the policy would do with this body (a completion, a chat or a
        Responses request), every worker's line included. Nothing is claimed or sent."""
        self._gate().require_admin(request.headers)
        body = await self._body(request)
        obj = parse_body(body)
        kind: Kind = (
            "chat" if "messages" in obj else "responses" if "input" in obj else "completion"
        )
        routed = await self._parse(request, body, kind, check_model=False)
        answer = route_answer(routed, self._plan(routed, dry_run=True))
        # the spread score's grounds: how many workers the prompt's hottest shared prefix
        # should be on (its share of the traffic), by what load, and how many of its blocks
        # make a holder
        req = self._route_request(routed, observe=False)
        answer["spread"] = {
            "wanted_holders": req.spread_wanted,
            "sized_by": (
                f"requests in flight, {SESSION_PER_HOLDER:g} a holder (a session's first request)"
                if req.starts_session
                else f"requests waiting for a first token, {self.heat.per_holder:g} a holder"
            ),
            "depth_blocks": req.spread_depth,
        }
        # the prefix score's: per worker whose blocks of the prompt a request there is still
        # prefilling, how many are computed (the rest earn credit by the pool's busy share)
        answer["computed_blocks"] = req.computed_blocks
        # ... and, with the ttft score's copy charge, scaled by the share of the eligible
        # workers with a request in flight
        eligible = [c for c in answer["candidates"] if c["filtered"] is None]
        answer["busy_share"] = (
            round(busy_share([c["in_flight"] for c in eligible]), 4) if eligible else None
        )
        answer["prefix_wait"] = prefix_wait(
            self._pool(), routed, answer, self.settings.leader_blocks(), self.settings.block_size
        )
        answer["process"] = self.slot.index  # which of --processes N answered
        return JSONResponse(answer)


def prefix_wait(
    pool: WorkerPool, routed: Routed, answer: dict[str, Any], min_blocks: int, block_size: int
) -> dict[str, Any] | None:
    """Whether the request, sent now, would be held until a request already on its worker
    has prefilled blocks they share (:meth:`~.load.WorkerLoad.leader`; the prefill leg's
    worker when split): that request's age, the shared blocks it computes itself, and the
    longest the wait could last. None: it would be sent at once."""
    answered = answer["prefill"] or answer
    state = pool.workers.get(answered["worker"] or "")
    if state is None:
        return None
    now = time.monotonic()
    probe = Ticket(0, 0, now, now, keys=routed.keys)
    found = state.leader(probe, min_blocks, block_size, lambda: pool.prefill_model(state))
    if found is None:
        return None
    leader, until = found
    return {
        "worker": state.id,
        "leader_age_s": round(now - leader.routed_at, 4),
        "shared_blocks_computing": common_prefix(leader.keys, routed.keys) - leader.credited_blocks,
        # None: no TTFT seen yet, so no bound but the leader's first token
        "at_most_s": round(max(until - now, 0.0), 4) if math.isfinite(until) else None,
    }


def worker_rows(pool: WorkerPool, now: float) -> list[dict[str, Any]]:
    """Each worker as the router sees it: health, load (its own and the peers'), learned
    prefill model, compatibility and index figures."""
    rows = []
    models = pool.prefill_models(now)
    for s in pool.workers.values():
        model, source = models[s.id]
        rows.append(
            {
                "id": s.id,
                "url": s.url,
                "role": s.endpoint.role,
                "status": s.status,
                "draining": s.endpoint.draining,
                "model": s.model,
                "models": sorted(s.models),
                "compatible": s.compatible,
                "mismatch": s.mismatch,
                "cache_credit": s.credited,
                "cache_check": s.agreement.summary() if s.agreement is not None else None,
                "in_flight": s.in_flight,
                "queued_prefill_tokens": s.queued_tokens(now),
                "peers_in_flight": s.peer_in_flight,
                "peers_queued_prefill_tokens": s.peer_queued,
                # requests waiting for their first token: what sizes a hot prefix's holders
                "prefilling": s.prefilling,
                "peers_prefilling": s.peer_prefilling,
                # the model routing judges it by, and where that comes from (its own
                # TTFTs, its peers', or the prior while none was seen)
                "prefill_rate_tokens_per_s": round(model.rate, 1),
                "prefill_overhead_s": round(model.overhead, 4),
                "prefill_model": source,
                "prefill_observations": s.prefill.observations,
                "itl_s": s.itl,
                "kv_usage": s.kv_usage,
                "waiting": s.waiting,
                "unaccounted_waiting": s.unaccounted_waiting,
                "running": s.running,
                "batch_capacity": s.batch_capacity,
                "circuit_open": s.breaker.is_open(now),
                "kv_events": s.subscriber.endpoint if s.subscriber else None,
                "events_seen": s.events_seen,
                "indexed_blocks": pool.feed.indexed_blocks(s.id),
                "data_parallel_ranks": pool.feed.ranks(s.id),
            }
        )
    return rows


def route_answer(routed: Routed, plan: Plan) -> dict[str, Any]:
    """A dry run's answer: the decision, every candidate's line, and the split."""
    decision = plan.decode
    prefill = plan.prefill
    reason = decision.reason
    if routed.credit_note:
        reason += f"; {routed.credit_note}"
    return {
        "worker": decision.worker,
        "reason": reason,
        "policy": decision.policy,
        "num_tokens": routed.num_tokens,
        "num_blocks": len(routed.keys),
        "cached_tokens": decision.cached_tokens,
        "predicted_ttft_s": decision.predicted_ttft_s,
        "data_parallel_rank": routed.ranks.get(decision.worker or ""),
        "session": routed.session,
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
        "explanation": plan.explain() + (f" ({routed.credit_note})" if routed.credit_note else ""),
    }
