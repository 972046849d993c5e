"""The prefill/decode split: three policies put together (:class:`Planner`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .inputs import Decision, RouteRequest, SplitMode, WorkerView
from .policy import BASELINES, Policy, PolicyConfig

__all__ = ["PD_REASONS", "Plan", "Planner", "SplitConfig", "decode_policy_config"]


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

        return self.prefill.decide(replace(req, roles=("prefill",)), workers, dry_run=dry_run)

    def decode_decision(
        self, req: RouteRequest, workers: Sequence[WorkerView], *, dry_run: bool = False
    ) -> Decision:
        return self.decode.decide(req, workers, dry_run=dry_run)
