"""Filters: (request, workers) -> the workers that must not take it, each with why (down,
draining, wrong role or model, a decode load far above the pool's, a full batch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .inputs import RouteRequest, WorkerView

__all__ = ["FILTERS", "Filter", "GuardConfig", "batch_full"]


class GuardConfig(Protocol):
    """The bounds a policy's decode-load guard keeps (:class:`.policy.PolicyConfig`)."""

    guard_ratio: float
    guard_slack: float
    guard_kv_usage: float


Filter = Callable[[RouteRequest, list[WorkerView], "GuardConfig"], dict[str, str]]


def _healthy(req: RouteRequest, workers: list[WorkerView], cfg: GuardConfig) -> dict[str, str]:
    out = {}
    for w in workers:
        if not w.healthy:
            out[w.id] = "unhealthy"
        elif w.draining:
            out[w.id] = "draining"
        elif w.breaker_open:
            out[w.id] = "circuit_open"
    return out


def _role(req: RouteRequest, workers: list[WorkerView], cfg: GuardConfig) -> dict[str, str]:
    return {w.id: f"role {w.role}" for w in workers if w.role not in req.roles}


def _model(req: RouteRequest, workers: list[WorkerView], cfg: GuardConfig) -> dict[str, str]:
    """A worker that lists its models (base and LoRA adapters) must list the request's; one
    that does not is judged by its base model, and one of unknown model may take anything."""
    if req.model is None:
        return {}
    out = {}
    for w in workers:
        if w.models:
            if req.model not in w.models:
                out[w.id] = f"serves {_some(w.models)}"
        elif w.model not in (None, req.model):
            out[w.id] = f"serves {w.model}"
    return out


def _some(names: frozenset[str], shown: int = 3) -> str:
    """A few of a worker's model ids for an explanation (a worker may list many adapters)."""
    ordered = sorted(names)
    more = len(ordered) - shown
    return ", ".join(ordered[:shown]) + (f" (+{more} more)" if more > 0 else "")


def _decode_load(req: RouteRequest, workers: list[WorkerView], cfg: GuardConfig) -> dict[str, str]:
    """Keep each worker's in-flight requests within ``guard_ratio`` of the pool's mean (plus
    ``guard_slack``) and its KV cache below ``guard_kv_usage``: past those, decoding slows
    everyone on it, whatever the cache saves. Never drops every worker. (The same bound on
    the KV its requests hold, tried, dropped holders of long prompts too often: the
    ``kv-load`` scorer weighs it instead.)

    The in-flight bound yields to the cache: a worker may go over it by the share of the
    prompt it holds times the same bound taken over the other workers alone, so a prompt
    held whole gets about twice the bound, and a worker holding none of it meets the plain
    bound. A hot long prefix piles requests onto its holder, and a bound blind to the
    prompt sent an 8,000-token prefix elsewhere to be computed again for the sake of one
    more decode; the holder, which prefills only the tail, is still the cheaper place until
    it is about twice as loaded. The allowance leaves the worker's own load out: in a pool
    of two or three, twice a bound that counts it grows as fast as the load it bounds, and
    a hot prefix would pile onto its holder without end."""
    n = len(workers)
    if n < 2:
        return {}
    busy = sum(w.in_flight for w in workers)
    limit = cfg.guard_ratio * busy / n + cfg.guard_slack
    total = max(req.num_tokens - 1, 1)
    out = {}
    for w in workers:
        share = req.cached_tokens(w) / total
        others = cfg.guard_ratio * (busy - w.in_flight) / (n - 1) + cfg.guard_slack
        bound = limit + share * others
        if w.in_flight + 1 > bound:
            held = f" ({share:.0%} cached)" if share >= 0.005 else ""
            out[w.id] = f"in_flight {w.in_flight} over {bound:.1f}{held}"
        elif w.kv_usage is not None and w.kv_usage >= cfg.guard_kv_usage:
            out[w.id] = f"kv_usage {w.kv_usage:.2f}"
    if len(out) == len(workers):
        return {}
    return out


def _batch(req: RouteRequest, workers: list[WorkerView], cfg: GuardConfig) -> dict[str, str]:
    """Drop a worker whose batch is full (as many requests in flight as its announced
    max_num_seqs: the worker's own word, or its deployment's) while another has a free
    place: a request sent there waits in its queue for a running one to finish, however
    much of the prompt it holds. A learned capacity (the most seen running while others
    waited) is not trusted here: a moment of full KV cache can teach a low one, which a
    filter would then never let grow; it only counts toward saturation. Never drops every
    worker; when all are full the pool is saturated and the request waits in the router
    (:func:`saturation`)."""
    out = {
        w.id: f"batch full ({w.in_flight} in flight of {w.batch_capacity})"
        for w in workers
        if w.batch_announced and batch_full(w.in_flight, w.batch_capacity, True)
    }
    return {} if len(out) == len(workers) else out


FILTERS: dict[str, Filter] = {
    "healthy": _healthy,
    "role": _role,
    "model": _model,
    "decode-load": _decode_load,
    "batch-full": _batch,
}


def batch_full(in_flight: int, capacity: int | None, announced: bool) -> bool:
    """Whether a worker's batch has no place for one more request (a learned capacity gets
    an eighth more: see :func:`.policy.saturation`)."""
    if capacity is None:
        return False
    slack = 0 if announced else max(1, capacity // 8)
    return in_flight >= capacity + slack
