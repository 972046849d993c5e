"""The SLO autoscaler: how many replicas each role of a pool should run, and why.

A pure function of (policy, signals, state), so that every decision can be replayed and
tested over simulated time; the operator's loop only gathers the signals, calls
:func:`decide` and writes ``spec.replicas``.

Each signal is turned into a *pressure*: observed value over its target, where 1 means
"exactly at target". A role's proposal follows the Horizontal Pod Autoscaler:
``ceil(current * highest pressure)``, unless the highest pressure is within the tolerance
of 1. Proposals are then stabilised the way the HPA's ``behavior`` does it: a scale-up goes
only as far as the *lowest* proposal of the scale-up window (the pressure was sustained),
a scale-down only as far as the *highest* proposal of the scale-down window (the calm
was sustained), after which step limits, a cooldown and a readiness check apply.

Evidence must span its window, in both directions alike: a change waits until the current
unbroken run of proposals began at least the window ago *and* the window holds at least
:data:`MIN_PROPOSALS` of them. So a new pool, a restarted operator or metrics that come
back after a gap change nothing on a single sample. A window of 0 means no stabilisation
(as in the HPA): the current proposal alone decides. A round without any metric, or a gap
between rounds longer than ``max_gap_s``, breaks the run: what came before is dropped.

The history is compact, so that it fits in the pool's status and a new leader resumes it
(:mod:`.scaling`): of the proposals within the longest window only those that can still
decide are kept (the last three, and each one lower or higher than every later one:
the minimum and maximum of any window ending now are among them), at most
:data:`MAX_PROPOSALS`; compacting changes no decision.

Which signals a role reads:

* **prefill** (or, in an aggregated pool, the decode role, which prefills too): TTFT at the
  SLO quantile over its target, and the prefill backlog. The backlog pressure is the
  seconds of prefill work queued per ready replica (queued tokens / learned prefill rate)
  over the TTFT target: above 1, the queue alone would break the SLO for a new request,
  before TTFT itself shows it.
* **decode**: ITL over its target, mean KV-cache usage over ``kv_usage_target``, and
  waiting requests per ready replica over ``waiting_per_replica_target``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.cost import backlog_seconds

logger = logging.getLogger(__name__)

DECODE = "decode"
PREFILL = "prefill"

# ceil() of a product like 3 * (2/3) must not round 2.0000000000000004 up to 3.
_EPS = 1e-9

# A change needs at least this many proposals in its stabilisation window (when > 0).
MIN_PROPOSALS = 3
# Proposals kept per role, at most (the oldest go first, and the run's start moves with
# them, so dropping one can only delay a change, never hasten it).
MAX_PROPOSALS = 64


# -- policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        # No scale to zero: a role without replicas shows no load, so nothing would ever
        # bring it back.
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )

    def clamp(self, n: int) -> int:
        return min(max(n, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Behavior:
    stabilization_window_s: float
    max_step: int  # replicas added or removed per decision, at most

    def __post_init__(self) -> None:
        if not self.stabilization_window_s >= 0:
            raise ValueError(
                f"stabilization_window_s must be >= 0, got {self.stabilization_window_s}"
            )
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")


DEFAULT_SCALE_UP = Behavior(stabilization_window_s=60.0, max_step=2)
DEFAULT_SCALE_DOWN = Behavior(stabilization_window_s=300.0, max_step=1)


@dataclass(frozen=True)
class ScalingPolicy:
    decode: Bounds
    prefill: Bounds | None = None  # None: aggregated pool, "decode" serves whole requests
    ttft_target_s: float | None = None  # at ttft_quantile; None: no TTFT SLO
    itl_target_s: float | None = None  # at itl_quantile; None: no ITL SLO
    scale_up: Behavior = DEFAULT_SCALE_UP
    scale_down: Behavior = DEFAULT_SCALE_DOWN
    cooldown_s: float = 60.0  # after a change of a role, no other change of it for this long
    kv_usage_target: float = 0.85
    waiting_per_replica_target: float = 2.0
    tolerance: float = 0.1  # |pressure - 1| within this: no change (as the HPA's)
    # Rounds further apart than this do not make one run of evidence (an operator down for
    # longer, rounds that failed): the proposals before the gap are dropped. None: no limit.
    max_gap_s: float | None = None
    # The quantiles the signals were measured at: named in reasons, and what the operator
    # asks of its MetricsWindow.
    ttft_quantile: float = 0.9
    itl_quantile: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_target_s", "itl_target_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if not 0 < self.kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target must be in (0, 1], got {self.kv_usage_target}")
        if not self.waiting_per_replica_target > 0:
            raise ValueError(
                f"waiting_per_replica_target must be > 0, got {self.waiting_per_replica_target}"
            )
        if not self.cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.max_gap_s is not None and not self.max_gap_s > 0:
            raise ValueError(f"max_gap_s must be > 0 or None, got {self.max_gap_s}")
        for name in ("ttft_quantile", "itl_quantile"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    def roles(self) -> dict[str, Bounds]:
        if self.prefill is None:
            return {DECODE: self.decode}
        return {PREFILL: self.prefill, DECODE: self.decode}


# -- signals -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSignals:
    replicas: int  # the Deployment's current spec.replicas
    ready_replicas: int
    waiting_requests: float | None = None  # sum over the role's pods
    kv_usage: float | None = None  # mean over the role's pods, 0..1
    queued_prefill_tokens: float | None = None  # sum over the role's workers, at the router
    prefill_rate_tokens_per_s: float | None = None  # median learned rate of its workers


@dataclass(frozen=True)
class Signals:
    time: float
    ttft_s: float | None  # TTFT at the SLO quantile over the window; None: no data
    itl_s: float | None
    decode: RoleSignals
    prefill: RoleSignals | None = None


# -- decisions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    role: str
    current: int
    desired: int
    raw: int  # the proposal before stabilisation and bounds
    reason: str  # a short sentence for status and logs
    time: float


@dataclass(frozen=True)
class RoleHistory:
    """What stabilisation needs to remember of one role."""

    proposals: tuple[tuple[float, int], ...] = ()  # (time, bounded proposal), oldest first,
    # compacted (see compact)
    since: float | None = None  # first proposal of the current unbroken run of proposals
    last_change: float | None = None  # when desired last differed from current


@dataclass(frozen=True)
class AutoscalerState:
    """Frozen, and replaced rather than changed: a caller's old state stays as it was."""

    roles: Mapping[str, RoleHistory] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pressure:
    ratio: float  # observed / target
    observed: str  # "TTFT p90 0.82s"
    target: str  # "0.50s"

    def compared(self) -> str:
        sign = ">" if self.ratio > 1 else "<" if self.ratio < 1 else "="
        return f"{self.observed} {sign} target {self.target}"


def _pct(q: float) -> str:
    return f"p{q * 100:g}"


def _pressures(
    policy: ScalingPolicy, signals: Signals, rs: RoleSignals, *, prefills: bool, decodes: bool
) -> tuple[list[_Pressure], list[str]]:
    """The role's pressures, and the names of the signals it wanted but had no data for."""
    out: list[_Pressure] = []
    missing: list[str] = []
    per_replica = max(rs.ready_replicas, 1)
    if prefills and policy.ttft_target_s is not None:
        target = policy.ttft_target_s
        if signals.ttft_s is None:
            missing.append("TTFT")
        else:
            out.append(
                _Pressure(
                    signals.ttft_s / target,
                    f"TTFT {_pct(policy.ttft_quantile)} {signals.ttft_s:.2f}s",
                    f"{target:.2f}s",
                )
            )
        rate = rs.prefill_rate_tokens_per_s
        if rs.queued_prefill_tokens is None or rate is None or not rate > 0:
            missing.append("backlog")
        else:
            tokens = rs.queued_prefill_tokens / per_replica
            seconds = backlog_seconds(tokens, rate)  # the cost model's queue term
            out.append(
                _Pressure(
                    seconds / target,
                    f"prefill backlog {tokens:.0f} tokens/replica ({seconds:.2f}s)",
                    f"{target:.2f}s",
                )
            )
    if decodes:
        if policy.itl_target_s is not None:
            if signals.itl_s is None:
                missing.append("ITL")
            else:
                out.append(
                    _Pressure(
                        signals.itl_s / policy.itl_target_s,
                        f"ITL {_pct(policy.itl_quantile)} {signals.itl_s * 1000:.0f}ms",
                        f"{policy.itl_target_s * 1000:.0f}ms",
                    )
                )
        if rs.kv_usage is None:
            missing.append("KV usage")
        else:
            out.append(
                _Pressure(
                    rs.kv_usage / policy.kv_usage_target,
                    f"KV usage {rs.kv_usage:.2f}",
                    f"{policy.kv_usage_target:.2f}",
                )
            )
        if rs.waiting_requests is None:
            missing.append("waiting requests")
        else:
            waiting = rs.waiting_requests / per_replica
            out.append(
                _Pressure(
                    waiting / policy.waiting_per_replica_target,
                    f"waiting {waiting:.1f} requests/replica",
                    f"{policy.waiting_per_replica_target:g}",
                )
            )
    return out, missing


def _or_list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def compact(proposals: tuple[tuple[float, int], ...]) -> tuple[tuple[float, int], ...]:
    """The proposals that can still decide, oldest first.

    Every window is a suffix of the history (the proposals since some time, up to now), and
    a scale-up reads its minimum, a scale-down its maximum, the count rule its last
    :data:`MIN_PROPOSALS`. The latest proposal holding a suffix's minimum is lower than
    every later one, so keeping those, the ones higher than every later one and the last
    few answers every window as the whole history would, now and after any later rounds.
    """
    kept: list[tuple[float, int]] = []
    low = high = 0  # of the proposals after the one looked at
    for age, (t, p) in enumerate(reversed(proposals)):
        if age < MIN_PROPOSALS or p < low or p > high:
            kept.append((t, p))
        low, high = (p, p) if age == 0 else (min(low, p), max(high, p))
    kept.reverse()
    return tuple(kept[-MAX_PROPOSALS:])


def _evidence(h: RoleHistory, now: float, window: float) -> tuple[list[int], str | None]:
    """The proposals a change with this stabilisation window rests on, or what it waits
    for: a run of proposals begun at least ``window`` ago, with MIN_PROPOSALS inside it."""
    if window == 0:
        return [h.proposals[-1][1]], None
    assert h.since is not None
    have = now - h.since
    if have < window:
        return [], f"waits for {window:g}s of proposals (have {have:g}s)"
    inside = [p for t, p in h.proposals if t >= now - window]
    if len(inside) < MIN_PROPOSALS:
        return [], f"waits for {MIN_PROPOSALS} proposals in {window:g}s (have {len(inside)})"
    return inside, None


def _decide_role(
    role: str,
    bounds: Bounds,
    policy: ScalingPolicy,
    signals: Signals,
    rs: RoleSignals,
    history: RoleHistory,
    *,
    prefills: bool,
    decodes: bool,
) -> tuple[Recommendation, RoleHistory]:
    now = signals.time
    current = rs.replicas

    def result(
        desired: int, raw: int, reason: str, h: RoleHistory
    ) -> tuple[Recommendation, RoleHistory]:
        if desired != current:
            h = RoleHistory(h.proposals, h.since, now)
        return Recommendation(role, current, desired, raw, reason, now), h

    if (
        policy.max_gap_s is not None
        and history.proposals
        and now - history.proposals[-1][0] > policy.max_gap_s
    ):
        # Nobody looked for a while: what was seen before the gap does not vouch for now.
        history = RoleHistory((), None, history.last_change)

    pressures, missing = _pressures(policy, signals, rs, prefills=prefills, decodes=decodes)
    outside = bounds.clamp(current) != current
    if outside:
        where = "below min" if current < bounds.min_replicas else "above max"
        limit = bounds.min_replicas if current < bounds.min_replicas else bounds.max_replicas
        bounds_reason = f"bounds: {current} replicas, {where} {limit}"

    if not pressures:
        # Nothing to go on: keep what runs, and start the stabilisation windows afresh when
        # data comes back, so a scale-down needs a whole window of new evidence.
        fresh = RoleHistory((), None, history.last_change)
        if outside:
            return result(bounds.clamp(current), current, bounds_reason, fresh)
        if missing:
            reason = f"hold: no {_or_list(missing)} metrics"
        else:
            reason = "hold: no SLO target or metric applies to this role"
        return result(current, current, reason, fresh)

    top = max(pressures, key=lambda p: p.ratio)
    within = abs(top.ratio - 1) <= policy.tolerance
    if within:
        raw = current
    elif not math.isfinite(current * top.ratio):
        raw = bounds.max_replicas  # a near-zero rate or target: as much as allowed
    else:
        raw = math.ceil(current * top.ratio - _EPS)
    proposal = bounds.clamp(raw)

    horizon = now - max(
        policy.scale_up.stabilization_window_s, policy.scale_down.stabilization_window_s
    )
    kept = tuple(p for p in history.proposals if p[0] >= horizon)
    # With nothing left inside the longest window, nothing vouches that the run went on.
    since = history.since if kept and history.since is not None else now
    proposals = compact((*kept, (now, proposal)))
    # Proposals dropped for MAX_PROPOSALS take the run's start with them: no window can
    # count as covered while one of them would have been inside it.
    since = max(since, proposals[0][0]) if len(proposals) == MAX_PROPOSALS else since
    h = RoleHistory(proposals, since, history.last_change)

    if outside:
        return result(bounds.clamp(current), raw, bounds_reason, h)

    up_window = policy.scale_up.stabilization_window_s
    down_window = policy.scale_down.stabilization_window_s

    if proposal == current:
        if within:
            return result(current, raw, f"hold: within tolerance: {top.compared()}", h)
        if raw == current:  # e.g. 0.8 of 3 replicas still rounds up to 3
            reason = f"hold: {top.compared()} rounds to {current} replicas"
            return result(current, raw, reason, h)
        limit = "max" if raw > current else "min"
        return result(current, raw, f"hold: at {limit} {current}: {top.compared()}", h)

    if proposal > current:
        evidence, wait = _evidence(h, now, up_window)
        if wait is not None:
            return result(current, raw, f"hold: scale-up to {proposal} {wait}: {top.compared()}", h)
        up_rec = min(evidence)
        if up_rec <= current:
            reason = f"hold: scale-up to {proposal} not yet sustained for {up_window:g}s"
            return result(current, raw, f"{reason}: {top.compared()}", h)
        desired = min(up_rec, current + policy.scale_up.max_step)
        note = f" (step limit {policy.scale_up.max_step})" if desired < up_rec else ""
        if rs.ready_replicas < current:
            reason = (
                f"hold: {current - rs.ready_replicas} of {current} replicas not ready yet; "
                f"no scale-up until they are: {top.compared()}"
            )
            return result(current, raw, reason, h)
        action = f"scale up: {top.compared()}{note}"
    else:
        evidence, wait = _evidence(h, now, down_window)
        if wait is not None:
            reason = f"hold: scale-down to {proposal} {wait}"
            return result(current, raw, f"{reason}: {top.compared()}", h)
        down_rec = max(evidence)
        if down_rec >= current:
            reason = f"hold: scale-down to {proposal} not yet sustained for {down_window:g}s"
            return result(current, raw, f"{reason}: {top.compared()}", h)
        desired = max(down_rec, current - policy.scale_down.max_step)
        note = f" (step limit {policy.scale_down.max_step})" if desired > down_rec else ""
        action = f"scale down: {top.compared()}{note}"

    if history.last_change is not None and now - history.last_change < policy.cooldown_s:
        ago = now - history.last_change
        reason = f"hold: cooldown, last change {ago:g}s ago (< {policy.cooldown_s:g}s): {action}"
        return result(current, raw, reason, h)
    return result(desired, raw, action, h)


def decide(
    policy: ScalingPolicy, signals: Signals, state: AutoscalerState
) -> tuple[dict[str, Recommendation], AutoscalerState]:
    """Each role's desired replicas at ``signals.time``, and the state to pass next time.

    A role of the policy without signals (a prefill Deployment not created yet) gets no
    recommendation and keeps its history.
    """
    recs: dict[str, Recommendation] = {}
    histories = dict(state.roles)
    aggregated = policy.prefill is None
    for role, bounds in policy.roles().items():
        rs = signals.decode if role == DECODE else signals.prefill
        if rs is None:
            logger.debug("no signals for role %s: no recommendation", role)
            continue
        rec, histories[role] = _decide_role(
            role,
            bounds,
            policy,
            signals,
            rs,
            histories.get(role, RoleHistory()),
            prefills=role == PREFILL or aggregated,
            decodes=role == DECODE,
        )
        logger.debug(
            "%s: %d -> %d (raw %d): %s", role, rec.current, rec.desired, rec.raw, rec.reason
        )
        recs[role] = rec
    return recs, AutoscalerState(histories)
