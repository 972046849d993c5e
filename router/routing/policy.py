"""Which worker gets a request: a pipeline of filters, scorers and a picker (pure).

Every piece is small and named, so a decision can be explained worker by worker
(``/debug/route`` shows the table) and a policy is only a choice of pieces and weights:

* **filters** drop workers that must not get the request (down, draining, wrong role,
  not serving the requested model or LoRA adapter, an open circuit breaker, a decode load
  far above the pool's);
* **scorers** each give every remaining worker a number in [0, 1] (1 is best), weighted;
* the **picker** takes the highest total, breaking ties at random, or ignores the scores
  (round-robin, random) for the cache-blind baselines.

The default policy, ``kvpool``, weighs two things first: the predicted time to first token
(the prompt tokens a worker still has to prefill before this request, its queue, plus this
request's uncached tokens, over the worker's prefill rate learned from observed TTFTs, plus
its fixed overhead), charged with the time it would spend computing again blocks another
worker holds, scored against the cheapest worker's (weight 1); and the share of the prompt
the worker holds (weight 0.5). The prediction alone is greedy for this one request:
a holder with a little queue ties with an idle worker that must recompute the prefix, and
sending it there costs the pool that recomputation and a second copy of the prefix in
cache, which later requests of the group then split between. The cache share keeps a
prefix on its holder until the holder is clearly slower (for a prompt 90% cached, until its
predicted TTFT is 1.8 times the best); then the prefix spills to a second worker, which
caches it too. The decode-load guard keeps any one worker's in-flight requests within 1.5x
of the pool's mean (+4), a bound that grows with the share of the prompt the worker holds
(to about twice it for a prompt held whole). And a worker whose batch is full (as many
requests in flight as its max_num_seqs) is passed over while another has a place: a
request sent there would wait for a slot whatever it holds (a first burst on a prefix
held by one vLLM worker overfilled it before this).

Session affinity, when the router is configured with a weight for it, adds a third score:
1 for the worker the request's conversation was last sent to (``RouteRequest.affinity``,
from :class:`~kvpool.router.routing.affinity.SessionAffinity`), 0 for the others. A conversation's
next turn repeats its history, which that worker holds, often before its blocks reach the
index; the score keeps the conversation there until load says otherwise: it is a score,
not a filter, so the decode-load guard still drops an overloaded worker and the TTFT score
still outweighs it when the worker's queue grows (a decision made for affinity against a
worker holding more of the prompt is labelled ``affinity``, not ``spill``).

The :class:`Planner` puts three such policies together for the prefill/decode split: the
aggregated choice decides whether a request is split (by the prompt tokens that worker
would still have to prefill), the same policy over prefill workers picks the prefill leg,
and a load-first one over decode workers picks the decode leg (keeping the affinity score,
as a conversation's decode worker is where its cache is).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.cost import COST

from ..state.agreement import UNJUDGED
from .filters import FILTERS, batch_full
from .inputs import Candidate, Decision, RouteRequest, WorkerView
from .scorers import SCORERS, estimate_ttft

__all__ = ["BASELINES", "POLICIES", "Policy", "PolicyConfig", "saturation"]


# -- policies ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "kvpool"
    filters: tuple[str, ...] = ("healthy", "role", "model", "decode-load", "batch-full")
    scorers: tuple[tuple[str, float], ...] = (
        ("ttft", 1.0),
        ("prefix", 0.5),
        ("kv-load", 0.3),
        ("spread", 1.5),
    )
    picker: Literal["max", "round-robin", "random"] = "max"
    guard_ratio: float = COST.guard_ratio
    guard_slack: float = COST.guard_slack
    guard_kv_usage: float = COST.guard_kv_usage

    def __post_init__(self) -> None:
        unknown = [f for f in self.filters if f not in FILTERS]
        unknown += [s for s, _ in self.scorers if s not in SCORERS]
        if unknown:
            raise ValueError(
                f"unknown policy pieces {unknown}: filters are {sorted(FILTERS)}, "
                f"scorers are {sorted(SCORERS)}"
            )
        names = [s for s, _ in self.scorers]
        if len(set(names)) != len(names):
            raise ValueError(f"each scorer may appear once, got {names}")
        if any(not (math.isfinite(weight) and weight >= 0) for _, weight in self.scorers):
            raise ValueError("scorer weights must be finite numbers, not negative")
        if self.picker == "max" and not self.scorers:
            raise ValueError("the max picker needs at least one scorer")


_BASIC = ("healthy", "role", "model")

#: the named policies; ``kvpool`` is the default, the others are baselines
POLICIES: dict[str, PolicyConfig] = {
    "kvpool": PolicyConfig(),
    "round-robin": PolicyConfig("round-robin", _BASIC, (), "round-robin"),
    "random": PolicyConfig("random", _BASIC, (), "random"),
    "least-loaded": PolicyConfig("least-loaded", _BASIC, (("in-flight", 1.0),)),
    "prefix-only": PolicyConfig("prefix-only", _BASIC, (("prefix", 1.0),)),
}


#: the cache-blind or load-blind policies kept for comparison
BASELINES = frozenset(POLICIES) - {"kvpool"}


class Policy:
    """A policy's pieces put together. :meth:`decide` is pure but for the picker's random
    tie-breaks and the round-robin position (seed ``rng`` for repeatable decisions)."""

    def __init__(self, config: PolicyConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._filters = [(name, FILTERS[name]) for name in config.filters]
        self._scorers = [(name, SCORERS[name], weight) for name, weight in config.scorers]
        self._rng = rng or random.Random()
        self._next = 0

    @classmethod
    def named(cls, name: str, rng: random.Random | None = None, **overrides: object) -> Policy:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}: choose one of {', '.join(POLICIES)}")
        base = POLICIES[name]
        if overrides:
            from dataclasses import replace

            base = replace(base, **overrides)  # type: ignore[arg-type]
        return cls(base, rng)

    def decide(
        self, req: RouteRequest, workers: Sequence[WorkerView], *, dry_run: bool = False
    ) -> Decision:
        """The choice and its explanation. ``dry_run``: the round-robin position stays."""
        rows = {}
        ttft = req._ttft = {}
        for w in workers:  # every worker, every decision: positional, each figure once
            cached = req.cached_tokens(w)
            estimate = estimate_ttft(req, w, cached)
            predicted = ttft[w.id] = estimate.total_s
            rows[w.id] = Candidate(
                w.id,
                None,
                cached,
                w.queued_tokens,
                w.in_flight,
                w.kv_usage,
                predicted,
                w.batch_capacity,
                w.batch_announced,
                w.active_tokens,
                ttft_terms=estimate,
            )
        try:
            return self._decide(req, workers, rows, dry_run)
        finally:
            req._ttft = {}

    def _decide(
        self,
        req: RouteRequest,
        workers: Sequence[WorkerView],
        rows: dict[str, Candidate],
        dry_run: bool,
    ) -> Decision:
        cfg = self.config
        alive = list(workers)
        for name, check in self._filters:
            dropped = check(req, alive, cfg)
            for wid, why in dropped.items():
                rows[wid].filtered = f"{name}: {why}"
            alive = [w for w in alive if w.id not in dropped]
            if not alive:
                return Decision(None, "no_worker", cfg.name, list(rows.values()))
        chosen = self._pick(req, alive, rows, dry_run)
        row = rows[chosen.id]
        return Decision(
            chosen.id,
            self._reason(req, chosen, alive, workers, rows),
            cfg.name,
            list(rows.values()),
            cached_tokens=row.cached_tokens,
            predicted_ttft_s=row.predicted_ttft_s,
            matched_tokens=min(
                req.matched_blocks.get(chosen.id, 0) * req.block_size, req._most_cached
            )
            if req.judged
            else UNJUDGED,
            queued_tokens=row.queued_tokens,
        )

    def _pick(
        self,
        req: RouteRequest,
        alive: list[WorkerView],
        rows: dict[str, Candidate],
        dry_run: bool = False,
    ) -> WorkerView:
        picker = self.config.picker
        if picker == "round-robin":
            ordered = sorted(alive, key=lambda w: w.id)
            chosen = ordered[self._next % len(ordered)]
            self._next += 0 if dry_run else 1
            return chosen
        if picker == "random":
            return self._rng.choice(alive)
        totals = {w.id: 0.0 for w in alive}
        for name, scorer, weight in self._scorers:
            for wid, score in scorer(req, alive).items():
                rows[wid].scores[name] = score
                totals[wid] += weight * score
        for wid, total in totals.items():
            rows[wid].total = total
        best = max(totals.values())
        tied = [w for w in alive if totals[w.id] >= best - 1e-9]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _reason(
        self,
        req: RouteRequest,
        chosen: WorkerView,
        alive: list[WorkerView],
        workers: Sequence[WorkerView],
        rows: dict[str, Candidate],
    ) -> str:
        """Why ``chosen``, in one bounded label (see :data:`REASONS`). ``prefix`` only
        when it holds more of the prompt than another worker that could have taken it: a
        prefix every eligible worker holds (a system prompt everywhere) decided nothing, and
        the scorer that did is named instead."""
        if self.config.name in BASELINES:
            return self.config.name  # a baseline's choice has one reason: its rule
        if len(alive) == 1:
            return "single"
        # each worker's cached tokens, as its explanation row already has them
        cached = rows[chosen.id].cached_tokens
        best_anywhere = max(
            (rows[w.id].cached_tokens for w in workers if w.healthy and not w.draining),
            default=0,
        )
        if cached < best_anywhere:
            if req.affinity is not None and chosen.id == req.affinity:
                return "affinity"  # the conversation stayed on its worker over a bigger prefix
            if rows[chosen.id].scores.get("spread", 0.0) > 0:
                return "spread"  # a new copy of a hot prefix
            return "spill"  # a worker with more of the prefix was too busy
        if any(rows[w.id].cached_tokens < cached for w in alive):
            return "prefix"
        return self._decider(chosen, alive, rows)

    def _decider(
        self, chosen: WorkerView, alive: list[WorkerView], rows: dict[str, Candidate]
    ) -> str:
        """The scorer that put ``chosen`` ahead of the runner-up (the most weighted score it
        won by), or ``tie`` when their totals were equal and the picker drew."""
        mine = rows[chosen.id]
        others = [rows[w.id] for w in alive if w.id != chosen.id]
        runner = max(others, key=lambda c: c.total if c.total is not None else -math.inf)
        if (mine.total or 0.0) - (runner.total or 0.0) <= 1e-9:
            return "tie"  # however the scores split it, the totals were equal
        best, margin = "tie", 1e-9
        for name, _, weight in self._scorers:
            lead = weight * (mine.scores.get(name, 0.0) - runner.scores.get(name, 0.0))
            if lead > margin:
                best, margin = name, lead
        return best


def saturation(
    decision: Decision, bound_s: float, guard_kv_usage: float = PolicyConfig.guard_kv_usage
) -> str | None:
    """Why the pool cannot take this request now without queueing it at a worker, or None.

    Saturated means every worker that could serve it (healthy, of its role and model)
    would make it wait: its decode guard trips (``guard``: over the pool's in-flight bound,
    or its KV cache at ``guard_kv_usage``; the filter itself never drops every worker, so
    this asks it directly), or it predicts a time to first token over ``bound_s`` with
    prompt tokens of earlier requests still queued, or its batch is full (``ttft``).
    Sending it anyway only lengthens a worker's queue, where it would wait behind
    everything already there, whatever its priority. A request no worker could serve at
    all is not saturation (it gets its 503 at once)."""
    why = []
    for c in decision.candidates:
        if c.filtered is not None and not c.filtered.startswith(("decode-load", "batch-full")):
            continue  # not eligible
        if c.filtered is not None and c.filtered.startswith("batch-full"):
            why.append("ttft")
        elif c.filtered is not None or (c.kv_usage is not None and c.kv_usage >= guard_kv_usage):
            why.append("guard")
        elif _full(c, bound_s):
            why.append("ttft")
        else:
            return None  # this one can take it now
    if not why:
        return None
    return "guard" if all(w == "guard" for w in why) else "ttft"


def _full(c: Candidate, bound_s: float) -> bool:
    """Whether a request sent to this worker now would wait there: behind prompt work
    (routers' queued tokens, or requests the worker reports waiting that no router sent)
    predicted to take over ``bound_s``, or for a place in its batch. The prediction sees
    prefill work only; a worker whose batch is full queues a request however short its
    prompt. A worker with nothing queued takes it whatever its prediction: a long prompt on
    an idle pool predicts a long TTFT that no amount of waiting would shorten.

    An announced batch size is exact: the router sends no more than it, so a request that
    comes later with a higher priority never waits at a worker behind one already sent.
    A learned one (the most it was seen running while others waited) may be low (a KV
    cache full of long prompts): an eighth more keeps the worker queueing a little, which
    is how a larger batch, when it can run one, is seen."""
    terms = c.ttft_terms
    ahead = c.queued_tokens > 0 or (terms is not None and terms.waiting_s > 0)
    if ahead and (c.predicted_ttft_s or 0.0) > bound_s:
        return True
    return batch_full(c.in_flight, c.batch_capacity, c.batch_announced)
