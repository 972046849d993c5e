"""The cost model: a request's predicted time to first token on a worker, in one place.

Every part of kvpool that weighs a worker's load asks this module, so that they cannot
disagree: the router's decisions and their explanation (``/debug/route``), flow control's
test of whether the pool can take a request now, the wait of a request held behind the
prefill of a shared prefix, and the operator's prefill-backlog signal. It is pure: numbers
in, numbers out, no clock and no I/O.

A worker's TTFT for a request is predicted as the sum of four named terms
(:class:`TTFTEstimate`), each in seconds at the worker's prefill rate ``r`` (prompt tokens a
second, learned online from observed TTFTs: :class:`PrefillModel`):

* ``overhead``: what every request pays whatever its length (HTTP, scheduling, the first
  decode step), the intercept of the same fit;
* ``queue``: the prompt tokens routers have sent the worker and it has not prefilled yet,
  this router's and its peers', less what it has prefilled of them since it began on them,
  over ``r``: the request waits for them;
* ``waiting``: the requests the worker itself reports waiting (``vllm:num_requests_waiting``
  at the last scrape) beyond those the routers knew to be waiting for a first token then:
  requests sent by someone else, or requests preempted when its KV cache filled, which
  compute their context again. Each is taken to be as long as the worker's requests in
  flight are on average (their prompts and outputs: what a preempted request recomputes),
  over ``r``. This is the one place where KV pressure delays a first token;
* ``prefill``: the request's own prompt tokens that are not cached there, over ``r``.

The constants the router's choices rest on live in :class:`CostSettings` (``COST``), each
with what it means and the evidence for its value. Where the only evidence is a cell of the
simulated benchmark, the settings say so: those are the heuristics still to become terms of
the model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COST",
    "CostSettings",
    "PrefillModel",
    "TTFTEstimate",
    "backlog_seconds",
    "predict_ttft",
    "unaccounted_tokens",
]


@dataclass(frozen=True, slots=True)
class CostSettings:
    """The cost model's constants. Evidence: *measured* (fitted to a run that is named),
    *derived* (follows from how the engines work), or *tuned* (only a benchmark cell of
    ``bench/routing.py`` justifies it; kept until it becomes a term of the model)."""

    #: prefill rate assumed before any TTFT is seen, prompt tokens a second. *Derived*: it
    #: only ranks workers until the pool's first TTFT (then the pool's fit, and each
    #: worker's own, replace it), and every worker starts with it, so only its order of
    #: magnitude matters: an 8B model on one H100 prefills ~27,700 tokens a second
    #: (SGLang's published figure, ``bench/results/sim_calibration.md``), a CPU worker far
    #: fewer; 8,000 keeps a queue of a few thousand tokens visible either way.
    prior_rate_tokens_per_s: float = 8000.0
    #: fixed part of a TTFT assumed before any is seen, seconds. *Derived*: a prefill
    #: step's fixed cost on that GPU is 16.5 ms (the simulator's calibration, same file),
    #: plus HTTP and tokenizing; like the rate, replaced by the first fit.
    prior_overhead_s: float = 0.03
    #: weight of each new TTFT in the prefill fit (exponential forgetting): about the last
    #: twenty requests count. *Derived*: a worker's rate changes with its batch, which
    #: turns over in seconds; twenty TTFTs at a few requests a second is that long.
    fit_decay: float = 0.05
    #: spread of prompt sizes, in tokens (standard deviation), before a slope is fitted:
    #: with every prompt alike, the fit cannot tell rate from overhead. *Derived*.
    fit_min_spread_tokens: float = 64.0
    #: TTFTs of its own a worker needs before its fit is trusted over its peers' median.
    #: *Derived*: four observations fit a slope at all; twice that keeps one outlier (a
    #: request behind a long one) from setting the rate.
    learned_after: int = 8
    #: how long the peers' median prefill model is reused, seconds. *Derived*: it moves
    #: with tens of TTFTs, far slower than this.
    typical_every_s: float = 0.25
    #: weight of each new time-per-output-token reading in a worker's average. *Derived*:
    #: ten readings (a scrape interval's gaps) make the average.
    itl_weight: float = 0.1
    #: a request held behind another's prefill of the blocks they share waits up to this
    #: many times that prefill's predicted time. *Tuned*: the prediction's error has not
    #: been measured on its own; the margin bounds what a wrong one costs the follower (half
    #: again the predicted wait), and the follower is let go at the leader's first token
    #: whichever comes first.
    leader_margin: float = 1.5
    #: a worker's requests in flight stay under this many times the pool's mean
    #: (``guard_slack`` more), the bound growing with the share of the prompt it holds.
    #: *Tuned*: a decode batch slows every sequence in it, which TTFT does not see; this
    #: bound stands in for a decode-time term (``--guard-ratio``).
    guard_ratio: float = 1.5
    #: requests in flight a worker may carry over that bound. *Tuned* (``--guard-slack``).
    guard_slack: float = 4.0
    #: KV-cache usage at which a worker takes no new request while another can. *Derived*:
    #: vLLM preempts running requests when a step finds no free block; at 97% a step of a
    #: full batch does.
    guard_kv_usage: float = 0.97
    #: requests still waiting for a first token that each holder of a hot prefix may have
    #: before the prefix is copied to another worker. *Tuned* (``routing.py``'s
    #: one-system-prompt cell).
    heat_per_holder: float = 3.0
    #: requests in flight each holder of a prefix that sessions start with may carry.
    #: *Tuned* (the agentic cell).
    heat_session_per_holder: float = 2.0
    #: a prefix seen fewer times than this (decayed) is not judged hot. *Derived*: fewer
    #: requests than workers' worth of a burst say nothing of a share.
    heat_min_requests: float = 4.0
    #: half-life of a prefix's request count, seconds. *Derived*: a share follows the
    #: traffic of the last tens of seconds, the time a copy takes to pay back.
    heat_half_life_s: float = 10.0
    #: a prompt's prefix is named for its heat at a power of two of blocks at most this
    #: share of its deepest match, so that what follows a shared system prompt does not
    #: split its heat. *Tuned*.
    heat_depth_share: float = 0.8
    #: a shared prefix is judged for spreading from this many blocks on. *Derived*: below
    #: it a copy is cheaper than any queue.
    spread_min_blocks: int = 4

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must not be negative, got {value!r}")
        if not (self.prior_rate_tokens_per_s > 0 and 0 < self.fit_decay <= 1):
            raise ValueError("prior_rate_tokens_per_s must be positive, fit_decay in (0, 1]")


#: the settings every part of kvpool uses
COST = CostSettings()


@dataclass(slots=True)
class PrefillModel:
    """A worker's time to first token as ``overhead + tokens / rate``, learned online.

    An exponentially weighted least-squares fit of observed TTFTs against the prompt
    tokens the worker had to prefill for them (its queue at routing time plus the
    request's uncached tokens). Until the observations spread enough to fit a slope, the
    prior rate stands, so a fresh worker is neither feared nor favoured.
    """

    rate: float = COST.prior_rate_tokens_per_s  # prompt tokens per second
    overhead: float = COST.prior_overhead_s  # seconds
    decay: float = COST.fit_decay  # weight of each new observation
    _n: float = 0.0
    _mx: float = 0.0
    _my: float = 0.0
    _vxx: float = 0.0
    _vxy: float = 0.0

    @property
    def observations(self) -> int:
        return int(self._n)

    def predict(self, tokens: float) -> float:
        return self.overhead + tokens / self.rate

    def observe(self, tokens: float, ttft: float) -> None:
        if ttft <= 0 or tokens < 0:
            return
        a = self.decay if self._n >= 1 / self.decay else 1 / (self._n + 1)
        self._n += 1
        dx, dy = tokens - self._mx, ttft - self._my
        self._mx += a * dx
        self._my += a * dy
        self._vxx = (1 - a) * (self._vxx + a * dx * dx)
        self._vxy = (1 - a) * (self._vxy + a * dx * dy)
        if self._n >= 4 and self._vxx > COST.fit_min_spread_tokens**2:
            slope = self._vxy / self._vxx
            if slope > 0:
                self.rate = min(max(1 / slope, 50.0), 5e6)
        self.overhead = min(max(self._my - self._mx / self.rate, 0.0), 10.0)


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """A predicted time to first token, term by term (seconds; see the module's text)."""

    overhead_s: float
    queue_s: float
    waiting_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.queue_s + self.waiting_s + self.prefill_s

    def terms(self) -> dict[str, float]:
        return {
            "overhead_s": self.overhead_s,
            "queue_s": self.queue_s,
            "waiting_s": self.waiting_s,
            "prefill_s": self.prefill_s,
        }


def predict_ttft(
    model: PrefillModel,
    *,
    uncached_tokens: float,
    queued_tokens: float = 0.0,
    waiting_tokens: float = 0.0,
) -> TTFTEstimate:
    """A request's predicted TTFT on a worker judged by ``model``: ``uncached_tokens`` of
    its prompt to prefill there, behind ``queued_tokens`` that routers sent and the worker
    has not prefilled yet, and ``waiting_tokens`` of requests it reports waiting that no
    router accounts for (:func:`unaccounted_tokens`)."""
    rate = model.rate
    return TTFTEstimate(
        model.overhead,
        queued_tokens / rate,
        waiting_tokens / rate,
        max(uncached_tokens, 0.0) / rate,
    )


def unaccounted_tokens(unaccounted: int, tokens_each: float) -> float:
    """The prompt work of a worker's waiting requests that no router accounts for:
    ``unaccounted`` of them, ``tokens_each`` each (the router passes what its requests in
    flight there hold on average, or, with none there, the request being routed)."""
    return unaccounted * tokens_each if unaccounted > 0 else 0.0


def backlog_seconds(queued_tokens: float, rate: float) -> float:
    """The ``queue`` term alone: seconds of prefill work ``queued_tokens`` are at ``rate``
    (the operator's prefill-backlog signal, per replica)."""
    return queued_tokens / rate
