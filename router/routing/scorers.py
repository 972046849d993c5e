"""Scorers: (request, workers) -> a score in [0, 1] per worker (1 is best), weighted by the
policy; the TTFT scorer prices each worker with the cost model (:mod:`kvpool.cost`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.cost import TTFTEstimate, predict_ttft, unaccounted_tokens

from .inputs import RouteRequest, WorkerView

__all__ = ["REASONS", "SCORERS", "Scorer", "busy_share", "estimate_ttft", "predicted_ttft"]


Scorer = Callable[[RouteRequest, list[WorkerView]], dict[str, float]]


def estimate_ttft(req: RouteRequest, w: WorkerView, cached: int | None = None) -> TTFTEstimate:
    """The cost model's prediction for ``req`` on ``w``, term by term (:mod:`kvpool.cost`):
    its uncached tokens, behind the worker's queue and the waiting requests no router
    accounts for, each as long as this router's there on average (or as this request, with
    none there). ``cached``: the request's cached tokens there, when the caller has them."""
    if cached is None:
        cached = req.cached_tokens(w)
    return predict_ttft(
        w.prefill,
        uncached_tokens=req.num_tokens - cached,
        queued_tokens=w.queued_tokens,
        waiting_tokens=unaccounted_tokens(
            w.unaccounted_waiting, w.kv_per_request or req.num_tokens
        ),
    )


def predicted_ttft(req: RouteRequest, w: WorkerView, cached: int | None = None) -> float:
    """:func:`estimate_ttft`'s total, in seconds."""
    return estimate_ttft(req, w, cached).total_s


def _ttft_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    """The best cost over each worker's: 1 for the cheapest, 0.5 for twice the cost. A
    worker's cost is its predicted TTFT plus the time it would spend computing again the
    prompt blocks another worker already holds (at its prefill rate), times the share of
    the pool that is busy: a spill copies a prefix at the pool's expense, which later
    requests pay in queueing, and a long prefix costs more than a short one; but a copy
    made by a worker that would otherwise idle costs nobody (the first second of a hot
    new prefix, when every follower would wait for its holder's first prefill). Among
    workers holding as much (nothing, say), it is the predicted TTFT alone."""
    known = req._ttft
    cached = {w.id: req.cached_tokens(w) for w in workers}
    most = max(cached.values())
    # a copy costs the pool the time its busy workers would have spent on other work: on
    # an idle pool a copy is free, on a busy one it is the whole recomputation
    busy = busy_share([w.in_flight for w in workers])
    cost = {}
    for w in workers:
        ttft = known.get(w.id)
        if ttft is None:
            ttft = predicted_ttft(req, w, cached[w.id])
        cost[w.id] = ttft + busy * (most - cached[w.id]) / w.prefill.rate
    best = min(cost.values())
    return {k: best / v if v > 0 else 1.0 for k, v in cost.items()}


def _prefix_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    """The share of the prompt the worker holds. Blocks a request there is still
    prefilling (the index has them from speculation) count by the share of the pool that
    is busy: a request sent now would wait for them, and on a pool with idle workers a
    copy is as quick and costs nothing (:func:`_ttft_score`); on a busy one, holding them
    is what keeps a burst with a new prefix together."""
    total = max(req.num_tokens - 1, 1)
    done = req.computed_blocks
    busy = busy_share([w.in_flight for w in workers]) if done else 0.0
    out = {}
    for w in workers:
        cached = req.cached_tokens(w)
        if w.id in done:
            computed = min(cached, done[w.id] * req.block_size)
            cached = computed + busy * (cached - computed)
        out[w.id] = cached / total
    return out


def busy_share(in_flight: Sequence[int]) -> float:
    """The share of the eligible workers (their requests in flight) that have one."""
    return sum(1 for n in in_flight if n) / len(in_flight)


def _in_flight_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    most = max(w.in_flight for w in workers)
    return {w.id: 1.0 - w.in_flight / (most + 1) for w in workers}


def _kv_usage_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    return {w.id: 1.0 - min(max(w.kv_usage or 0.0, 0.0), 1.0) for w in workers}


def _kv_load_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    """Decode load in KV terms: 1 for a worker whose requests in flight hold no KV, down to
    near 0 for the one holding the most. Among workers that would start the request as
    soon (equal TTFT scores), the one decoding least context wins: a step of a batch of
    long sequences is slower for every sequence in it, the new one too."""
    most = max(w.active_tokens for w in workers)
    return {w.id: 1.0 - w.active_tokens / (most + 1) for w in workers}


def _spread_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    """A new copy of a hot prefix: 1 for a worker without the prompt's deepest shared
    prefix while fewer workers hold it than its share of the traffic calls for
    (``spread_wanted``), else 0 for all. Its weight outweighs the holders' head start on
    TTFT, so the copy is made before their queues show the need, on the quickest
    non-holder (the other scores still order those)."""
    wanted, depth, matched = req.spread_wanted, req.spread_depth, req.matched_blocks
    holders = sum(1 for w in workers if matched.get(w.id, 0) >= depth) if wanted > 1 else 0
    if wanted <= 1 or holders >= wanted:
        return dict.fromkeys((w.id for w in workers), 0.0)
    return {w.id: 0.0 if matched.get(w.id, 0) >= depth else 1.0 for w in workers}


def _queue_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    most = max(w.queued_tokens for w in workers)
    return {w.id: 1.0 - w.queued_tokens / (most + 1) for w in workers}


def _affinity_score(req: RouteRequest, workers: list[WorkerView]) -> dict[str, float]:
    """1 for the worker the request's session was last sent to: it holds the conversation's
    cache, even the blocks whose events have not reached the index yet."""
    return {w.id: 1.0 if w.id == req.affinity else 0.0 for w in workers}


SCORERS: dict[str, Scorer] = {
    "ttft": _ttft_score,
    "prefix": _prefix_score,
    "in-flight": _in_flight_score,
    "kv-usage": _kv_usage_score,
    "kv-load": _kv_load_score,
    "spread": _spread_score,
    "queue": _queue_score,
    "affinity": _affinity_score,
}

#: why a worker was chosen (``kvpool_router_routing_decisions_total{reason}``), besides a
#: baseline policy's own name:
#:
#: * ``prefix``: it holds more of the prompt than another worker that could have taken it;
#: * ``spill``: another worker holds more, but was too busy (filtered, or slower);
#: * ``affinity``: the conversation stayed on its worker over a bigger prefix elsewhere;
#: * ``spread``: a new copy of a hot prefix, on a worker without it (the ``spread`` score);
#: * a scorer's name (``ttft``, ``in-flight``, ...): every eligible worker held as much of
#:   the prompt (nothing, or a prefix that is everywhere), and that score decided;
#: * ``tie``: that, and their totals were equal (the picker drew); ``single``: one
#:   eligible worker; ``no_worker``: none.
REASONS = ("prefix", "spill", "affinity", *SCORERS, "tie", "single", "no_worker")
# ("spread" is a scorer's name and a reason of its own: the scorer that copies a prefix)
