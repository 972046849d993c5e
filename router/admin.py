"""The router's admin surface: what ``/debug/workers`` and ``/debug/route`` answer, built
from the routing state (the pool's workers) and a plan, with no I/O of its own."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .forward import Routed
    from .policy import Plan
    from .pool import WorkerPool

__all__ = ["route_answer", "worker_rows"]


def worker_rows(pool: WorkerPool, now: float) -> list[dict[str, Any]]:
    """Each worker as the router sees it: health, load (its own and the peers'), learned
    prefill model, compatibility and index figures."""
    rows = []
    for s in pool.workers.values():
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
                "in_flight": s.in_flight,
                "queued_prefill_tokens": s.queued_tokens(now),
                "peers_in_flight": s.peer_in_flight,
                "peers_queued_prefill_tokens": s.peer_queued,
                "prefill_rate_tokens_per_s": round(s.prefill.rate, 1),
                "prefill_overhead_s": round(s.prefill.overhead, 4),
                "itl_s": s.itl,
                "kv_usage": s.kv_usage,
                "waiting": s.waiting,
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
