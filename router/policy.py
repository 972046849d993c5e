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
from :class:`~kvpool.router.affinity.SessionAffinity`), 0 for the others. A conversation's
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvpool.cost import COST, PrefillModel, TTFTEstimate, predict_ttft, unaccounted_tokens

from .agreement import UNJUDGED

__all__ = [
    "FILTERS",
    "PD_REASONS",
    "POLICIES",
    "REASONS",
    "SCORERS",
    "BatchCredit",
    "Candidate",
    "Decision",
    "Plan",
    "Planner",
    "Policy",
    "PolicyConfig",
    "PrefillModel",
    "RouteRequest",
    "SplitConfig",
    "WorkerView",
    "busy_share",
]

Role = Literal["both", "prefill", "decode"]
SplitMode = Literal["Aggregated", "Disaggregated", "Auto"]


# -- inputs ------------------------------------------------------------------------------


@dataclass(slots=True)
class WorkerView:
    """What the policy knows of one worker at decision time (a snapshot, no I/O)."""

    id: str
    role: Role = "both"
    model: str | None = None
    # Every model id the worker lists in /v1/models: its base model and its LoRA adapters.
    # Empty: not known, and ``model`` alone decides.
    models: frozenset[str] = frozenset()
    healthy: bool = True
    draining: bool = False
    breaker_open: bool = False
    compatible: bool = True  # same block size, hash seed and model: its blocks are credit
    in_flight: int = 0  # requests this router has sent it that have not finished
    #: prompt tokens sent to it whose first token has not come back, less what it has
    #: prefilled of them since it began on them (at the rate routing judges it by)
    queued_tokens: int = 0
    kv_usage: float | None = None  # scraped vllm:kv_cache_usage_perc, 0..1
    #: requests it reported waiting (vllm:num_requests_waiting) that no router knew to be
    #: waiting there: the cost model's ``waiting`` term (:mod:`kvpool.cost`)
    unaccounted_waiting: int = 0
    prefill: PrefillModel = field(default_factory=PrefillModel)
    batch_capacity: int | None = None  # requests it runs at once: announced, or seen queueing
    batch_announced: bool = False  # the worker said it (its max_num_seqs): exact, not learned
    #: KV its requests in flight take, in tokens (their prompts and most output): decode
    #: load weighed by what each sequence holds, not counted
    active_tokens: int = 0
    #: what each of this router's requests in flight there holds on average (tokens)
    kv_per_request: float = 0.0


@dataclass(frozen=True, slots=True)
class BatchCredit:
    """The cache a batch's later prompts find (a completion's list of prompts: vLLM prefills
    each as a request of its own), added to what its first prompt is credited. Of the
    router's making (``tokens.Batch.credit``): the index's lookups of each prompt."""

    #: the first prompt's tokens: its own credit stops at the whole blocks before its last
    first_tokens: int
    #: the later prompts' tokens cached wherever the batch goes: blocks an earlier prompt
    #: of the batch computes before them
    shared: int = 0
    #: worker -> the later prompts' tokens cached there besides: blocks it holds
    held: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RouteRequest:
    #: the prompt tokens the worker prefills, cache aside (a batch's every prompt)
    num_tokens: int
    block_size: int
    #: worker -> leading blocks of the prompt (a batch's first) it holds
    matched_blocks: dict[str, int]
    model: str | None = None
    roles: tuple[Role, ...] = ("both", "decode")
    affinity: str | None = None  # the worker this request's session was last sent to
    #: how many workers should hold the prompt's deepest shared prefix, by its share of the
    #: traffic (router/heat.py; 0: no opinion), and how many of its blocks make a holder
    spread_wanted: int = 0
    spread_depth: int = 0
    #: a session's first request: its holders were sized by the requests in flight, not
    #: by those waiting for a first token (for ``/debug/route``)
    starts_session: bool = False
    #: worker -> how many of the prompt's leading blocks are computed there at most (a
    #: request still prefilling the rest); absent: all it holds
    computed_blocks: dict[str, int] = field(default_factory=dict)
    #: False: the worker reads no prefix cache for it (vLLM, when it computes the prompt's
    #: logprobs): no cache credit anywhere, and its answer's cached tokens say nothing of
    #: the worker's cache
    reads_cache: bool = True
    #: a batch of prompts: what its later prompts find cached
    batch: BatchCredit | None = None
    #: False: the worker's prompt begins with more than the request carries (a Responses
    #: request continuing a stored response: vLLM puts that conversation first)
    whole_prompt: bool = True
    # The last token is always computed, so a fully cached prompt still prefills one; and
    # a worker looks up whole blocks of the tokens before it (vLLM's and kvpool's
    # schedulers alike): a prompt of whole blocks finds at most all but its last block.
    _most_cached: int = field(init=False, repr=False, compare=False)
    # Within one :meth:`Policy.decide`: each worker's predicted TTFT, computed once for its
    # explanation row and read by the scorers (empty outside a decision)
    _ttft: dict[str, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = self.batch.first_tokens if self.batch is not None else self.num_tokens
        self._most_cached = most_cached(first, self.block_size)
        self._ttft = {}

    @property
    def judged(self) -> bool:
        """Whether its answer's cached tokens measure the prediction: not when it reads no
        cache, nor for a batch (vLLM's usage names one prompt's cached tokens, not all),
        nor when the worker's prompt is more than the router matched."""
        return self.reads_cache and self.batch is None and self.whole_prompt

    def cached_tokens(self, worker: WorkerView) -> int:
        # asked of every worker by several scorers in each decision: kept lean
        if not worker.compatible or not self.reads_cache:
            return 0
        hit = self.matched_blocks.get(worker.id, 0) * self.block_size
        if hit > self._most_cached:
            hit = self._most_cached
        batch = self.batch
        if batch is not None:
            hit += batch.shared + batch.held.get(worker.id, 0)
        return hit


def most_cached(num_tokens: int, block_size: int) -> int:
    """The most of a prompt a worker serves from its prefix cache: whole blocks of the
    tokens before its last, which is always computed (vLLM's scheduler and kvpool's look
    up no further)."""
    before_last = max(num_tokens - 1, 0)
    return before_last - before_last % block_size


@dataclass(slots=True)
class Candidate:
    """One worker's line in a decision's explanation."""

    worker: str
    filtered: str | None = None  # the filter that dropped it
    cached_tokens: int = 0
    queued_tokens: int = 0
    in_flight: int = 0
    kv_usage: float | None = None
    predicted_ttft_s: float | None = None
    batch_capacity: int | None = None
    batch_announced: bool = False
    active_tokens: int = 0
    scores: dict[str, float] = field(default_factory=dict)  # scorer -> score in [0, 1]
    total: float | None = None
    #: its predicted TTFT term by term (the cost model, :mod:`kvpool.cost`)
    ttft_terms: TTFTEstimate | None = None


@dataclass(slots=True)
class Decision:
    worker: str | None  # None: no worker can take it
    reason: str  # one of REASONS, or a baseline policy's name
    policy: str
    candidates: list[Candidate]
    cached_tokens: int = 0
    predicted_ttft_s: float | None = None
    #: what the index says the chosen worker holds of the prompt, in tokens, whether or not
    #: it is credited (a worker whose cache disagrees with the index gets no credit, but
    #: its answers are still checked against this); ``agreement.UNJUDGED`` when its
    #: answer cannot be checked (:attr:`RouteRequest.judged`)
    matched_tokens: int = 0
    #: the prompt tokens routing judged queued ahead of it there
    queued_tokens: int = 0

    def explain(self) -> str:
        """``w1: cached 512, queue 0, ttft 41ms, ttft 1.00x1 load 0.80x0.1 = 1.080``..."""
        parts = []
        for c in self.candidates:
            if c.filtered:
                parts.append(f"{c.worker}: filtered ({c.filtered})")
                continue
            scores = " ".join(f"{k} {v:.2f}" for k, v in c.scores.items())
            total = "" if c.total is None else f" = {c.total:.3f}"
            parts.append(
                f"{c.worker}: cached {c.cached_tokens}, queue {c.queued_tokens}, {scores}{total}"
            )
        return f"{self.worker} ({self.reason}); " + "; ".join(parts)


# -- filters: (request, workers) -> the workers that may take it, with why the others not --

Filter = Callable[[RouteRequest, list[WorkerView], "PolicyConfig"], dict[str, str]]


def _healthy(req: RouteRequest, workers: list[WorkerView], cfg: PolicyConfig) -> dict[str, str]:
    out = {}
    for w in workers:
        if not w.healthy:
            out[w.id] = "unhealthy"
        elif w.draining:
            out[w.id] = "draining"
        elif w.breaker_open:
            out[w.id] = "circuit_open"
    return out


def _role(req: RouteRequest, workers: list[WorkerView], cfg: PolicyConfig) -> dict[str, str]:
    return {w.id: f"role {w.role}" for w in workers if w.role not in req.roles}


def _model(req: RouteRequest, workers: list[WorkerView], cfg: PolicyConfig) -> dict[str, str]:
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


def _decode_load(req: RouteRequest, workers: list[WorkerView], cfg: PolicyConfig) -> dict[str, str]:
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


def _batch(req: RouteRequest, workers: list[WorkerView], cfg: PolicyConfig) -> dict[str, str]:
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
        if w.batch_announced and _batch_full(w.in_flight, w.batch_capacity, True)
    }
    return {} if len(out) == len(workers) else out


FILTERS: dict[str, Filter] = {
    "healthy": _healthy,
    "role": _role,
    "model": _model,
    "decode-load": _decode_load,
    "batch-full": _batch,
}


# -- scorers: (request, workers) -> score in [0, 1] per worker ----------------------------

Scorer = Callable[[RouteRequest, list[WorkerView]], dict[str, float]]


def estimate_ttft(req: RouteRequest, w: WorkerView, cached: int | None = None) -> TTFTEstimate:
    """The cost model's prediction for ``req`` on ``w``, term by term (:mod:`kvpool.cost`):
    its uncached tokens, behind the worker's queue and the waiting requests no router
    accounts for, each as long as this router's there on average (or as this request, with
    none there). ``cached``: the request's cached tokens there, when the caller has them."""
    if cached is None:
        cached = req.cached_tokens(w)
    waiting = w.unaccounted_waiting
    return predict_ttft(
        w.prefill,
        uncached_tokens=req.num_tokens - cached,
        queued_tokens=w.queued_tokens,
        waiting_tokens=unaccounted_tokens(waiting, w.kv_per_request or req.num_tokens)
        if waiting
        else 0.0,
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
    return _batch_full(c.in_flight, c.batch_capacity, c.batch_announced)


def _batch_full(in_flight: int, capacity: int | None, announced: bool) -> bool:
    """Whether a worker's batch has no place for one more request (see :func:`_full`)."""
    if capacity is None:
        return False
    slack = 0 if announced else max(1, capacity // 8)
    return in_flight >= capacity + slack


# -- prefill/decode split ----------------------------------------------------------------

#: why a request went one way or the other (``kvpool_router_pd_decisions_total{reason}``)
PD_REASONS = (
    "above_threshold",  # Auto: more uncached prompt tokens than the threshold: split
    "mode_disaggregated",  # Disaggregated: split whenever a prefill leg has blocks to move
    "mode_aggregated",  # Aggregated: never split
    "below_threshold",  # Auto: few enough uncached tokens for the decode worker to compute
    "no_blocks_to_move",  # no full prompt block is missing where it would be decoded
    "batch",  # several prompts or choices (n) in one request: the hand-off carries one
    "prompt_logprobs",  # its prompt's logprobs are asked for: computed where it is answered
    "no_prefill_worker",  # no prefill worker can take it now: served whole
    "no_worker",  # no worker at all
    "pinned",  # continues a stored response (previous_response_id): served by its worker
)


@dataclass(frozen=True)
class SplitConfig:
    """When a request is prefilled on a prefill worker and decoded on another, mirroring
    the ``InferencePool``'s ``disaggregation``: ``Aggregated`` never; ``Disaggregated``
    whenever a prefill leg has at least one full block to hand over; ``Auto`` when,
    besides, the prompt tokens the decode side lacks are more than ``threshold_tokens``."""

    mode: SplitMode = "Auto"
    threshold_tokens: int = 512


@dataclass(slots=True)
class Plan:
    """A request's route: one worker (``aggregated``), or a prefill worker whose blocks a
    decode worker pulls (``disaggregated``). ``decode`` is the worker that answers."""

    path: Literal["aggregated", "disaggregated"]
    reason: str  # one of PD_REASONS
    uncached_tokens: int  # what serving it whole would prefill on the aggregated choice
    decode: Decision
    prefill: Decision | None = None

    @property
    def worker(self) -> str | None:
        return self.decode.worker

    def explain(self) -> str:
        if self.prefill is None:
            return f"aggregated ({self.reason}): {self.decode.explain()}"
        return (
            f"disaggregated ({self.reason}, {self.uncached_tokens} uncached): "
            f"prefill {self.prefill.explain()} | decode {self.decode.explain()}"
        )


def decode_policy_config(base: PolicyConfig) -> PolicyConfig:
    """The decode leg's pieces. Its prefill is done elsewhere, so what matters on the decode
    worker is how many sequences it already decodes and how full its cache is (the cache's
    contents only break ties); a baseline stays itself, so comparisons stay fair. Session
    affinity keeps its weight: the worker that decoded a conversation's last turn holds the
    history its next turn repeats."""
    if base.name in BASELINES:
        return base
    from dataclasses import replace

    scorers = (("in-flight", 1.0), ("kv-load", 0.5), ("kv-usage", 0.1), ("prefix", 0.01))
    scorers += tuple((name, w) for name, w in base.scorers if name == "affinity")
    return replace(base, scorers=scorers)


class Planner:
    """Chooses between serving a request whole and splitting it (pure but for the pickers'
    tie-breaks and round-robin positions, as :class:`Policy`).

    The aggregated choice comes first: the configured policy over ``both`` and ``decode``
    workers, as without a split. What that worker would still have to prefill (the prompt
    minus the prefix it holds) decides: a split pays a second hop and a block transfer, so
    it is worth it only for a long uncached prefill, which would otherwise stall the decode
    batch it joins. A split's prefill worker is the same policy over ``prefill`` workers
    (predicted TTFT: their cache and backlog); its decode worker is chosen by decode load
    (the caller asks again when the prefill leg is done: :meth:`decode_decision`).
    """

    def __init__(
        self, config: PolicyConfig, split: SplitConfig, rng: random.Random | None = None
    ) -> None:
        self.split = split
        rng = rng or random.Random()
        self.aggregated = Policy(config, rng)
        self.prefill = Policy(config, rng)  # its own round-robin position
        self.decode = Policy(decode_policy_config(config), rng)

    def plan(
        self,
        req: RouteRequest,
        workers: Sequence[WorkerView],
        *,
        splittable: bool = True,
        dry_run: bool = False,
    ) -> Plan:
        split = self.split
        agg = self.aggregated.decide(req, workers, dry_run=dry_run)
        uncached = req.num_tokens - agg.cached_tokens

        def whole(reason: str) -> Plan:
            return Plan("aggregated", reason, uncached, agg)

        if agg.worker is None:
            return whole("no_worker")
        if split.mode == "Aggregated":
            return whole("mode_aggregated")
        if not splittable:
            return whole("batch")
        if not req.reads_cache:
            # The worker that answers computes the prompt's logprobs, so the whole prompt:
            # a decode leg would have its blocks pulled instead, and no logits for them.
            return whole("prompt_logprobs")
        chosen = next(w for w in workers if w.id == agg.worker)
        held = req.matched_blocks.get(chosen.id, 0) if chosen.compatible else 0
        if held >= req.num_tokens // req.block_size:
            return whole("no_blocks_to_move")  # the decode side computes less than a block
        if split.mode == "Auto" and uncached <= split.threshold_tokens:
            return whole("below_threshold")
        if not any(w.role == "prefill" for w in workers):  # a pool without: no table to build
            return whole("no_prefill_worker")
        prefill = self.prefill_decision(req, workers, dry_run=dry_run)
        if prefill.worker is None:
            return whole("no_prefill_worker")
        # The decode worker is chosen again once the prefill is done (by its load then):
        # this one shows where it would go now, and moves no round-robin position.
        decode = self.decode_decision(req, workers, dry_run=True)
        if decode.worker is None:  # the same filters let the aggregated choice through
            return whole("no_worker")
        reason = "mode_disaggregated" if split.mode == "Disaggregated" else "above_threshold"
        return Plan("disaggregated", reason, uncached, decode, prefill)

    def prefill_decision(
        self, req: RouteRequest, workers: Sequence[WorkerView], *, dry_run: bool = False
    ) -> Decision:
        from dataclasses import replace

        return self.prefill.decide(replace(req, roles=("prefill",)), workers, dry_run=dry_run)

    def decode_decision(
        self, req: RouteRequest, workers: Sequence[WorkerView], *, dry_run: bool = False
    ) -> Decision:
        return self.decode.decide(req, workers, dry_run=dry_run)
