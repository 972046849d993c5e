"""What the policy decides on (its inputs: each worker's view and the request, pure
snapshots with no I/O) and what it answers (a decision, with one explanation row per
worker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpool.cost import PrefillModel, TTFTEstimate

__all__ = ["BatchCredit", "Candidate", "Decision", "RouteRequest", "WorkerView", "most_cached"]

Role = Literal["both", "prefill", "decode"]
SplitMode = Literal["Aggregated", "Disaggregated", "Auto"]


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
    #: traffic (router/routing/heat.py; 0: no opinion), and how many of its blocks make a holder
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
