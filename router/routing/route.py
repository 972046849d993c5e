"""A request's routing inputs and plan (:class:`.server.Router`'s part): the index's
matches, the prefix's heat, the session's worker and what is still being computed, made
into a :class:`.inputs.RouteRequest`; then the planner's decision, and where a
conversation was placed, remembered and told to the peers."""

from __future__ import annotations

from fractions import Fraction

from kvpool.cost import COST

from ..proxy.routed import Routed
from ..state.pool import WorkerPool
from .inputs import Decision, RouteRequest
from .planner import Plan

__all__ = ["SPREAD_MIN_BLOCKS", "Decisions"]

#: a prompt's deepest shared prefix is judged for spreading from this many blocks on
SPREAD_MIN_BLOCKS = COST.spread_min_blocks
#: the share as an exact fraction (4/5): a block count times it, rounded down, in integers
_DEPTH = Fraction(COST.heat_depth_share).limit_denominator(100)


class Decisions:
    """:class:`.server.Router`'s routing: inputs, plan and pins."""

    def _route_request(self, routed: Routed, *, observe: bool = True) -> RouteRequest:
        """The policy's input. ``observe``: the request is being routed (not a dry run): its
        deepest shared prefix counts in the heat, once."""
        pool = self._pool()
        matched = pool.feed.match(routed.keys)
        routed.ranks = {w: r for w, (_, r) in matched.items() if r is not None}
        blocks = {w: b for w, (b, _) in matched.items()}
        # The prefix is named at a power of two of blocks, at most four fifths of the
        # deepest match (COST.heat_depth_share): the blocks after it (where a question
        # starts) differ from request to request, and would split one system prompt's heat
        # over many names.
        most = max(blocks.values(), default=0) * _DEPTH.numerator // _DEPTH.denominator
        depth = 1 << (most.bit_length() - 1) if most else 0
        key = routed.keys[depth - 1] if depth >= SPREAD_MIN_BLOCKS else None
        if observe and not routed.heat_seen:
            routed.heat_seen = True
            self.heat.observe(key)
        affinity = self.sessions.get(routed.session) if routed.session else None
        starts = routed.session is not None and affinity is None  # a session's first request
        return RouteRequest(
            num_tokens=routed.num_tokens,
            block_size=self.settings.block_size,
            matched_blocks=blocks,
            model=routed.model,
            affinity=affinity,
            spread_wanted=self._spread_wanted(key, pool, starts_session=starts),
            starts_session=starts,
            spread_depth=depth,
            computed_blocks=self._computed(routed.keys, blocks, pool),
            reads_cache=routed.reads_cache,
            whole_prompt=routed.pin is None,
            batch=routed.batch.credit(pool.feed.match, self.settings.block_size)
            if routed.batch is not None
            else None,
        )

    @staticmethod
    def _computed(keys: list[int], blocks: dict[str, int], pool: WorkerPool) -> dict[str, int]:
        """Per worker whose matched blocks a request there is still prefilling: how many of
        them are computed (the ``prefix`` score credits the rest by how busy the pool is)."""
        out = {}
        for wid, n in blocks.items():
            state = pool.workers.get(wid)
            if state is not None and n:
                done = state.computing(keys[:n])
                if done < n:
                    out[wid] = done
        return out

    def _spread_wanted(self, key: int | None, pool: WorkerPool, *, starts_session: bool) -> int:
        """How many workers should hold the prefix ``key`` (0: no opinion), for a request
        that ``starts_session`` or not (:meth:`PrefixHeat.holders`)."""
        if key is None:
            return 0
        share = self.heat.share(key)
        if share == 0.0:
            return 0
        states = pool.workers.values()
        if starts_session:
            load = sum(s.in_flight + s.peer_in_flight for s in states)
        else:  # the requests still waiting for a first token, the other replicas' too
            load = sum(s.prefilling + s.peer_prefilling for s in states)
        workers = len(pool.workers)
        return self.heat.holders(share, workers, load + 1, session=starts_session)  # +1: this one

    def _plan(self, routed: Routed, *, dry_run: bool = False) -> Plan:
        return self.planner.plan(
            self._route_request(routed, observe=not dry_run),
            self._pool().views(),
            splittable=routed.splittable,
            dry_run=dry_run,
        )

    def _pinned(self, routed: Routed) -> Plan:
        """A request continuing a stored response goes to the worker that stored it (the
        others do not have it), whole, while that worker can take it."""
        views = [v for v in self._pool().views() if v.id == routed.pin]
        decision = self.planner.aggregated.decide(self._route_request(routed), views)
        if decision.worker is None:  # gone: another worker answers (404, most likely)
            return self._plan(routed)
        decision.reason = "pinned"
        return Plan("aggregated", "pinned", routed.num_tokens - decision.cached_tokens, decision)

    def _decide(
        self, routed: Routed, exclude: set[str], *, leg: str = "aggregated", dry_run: bool = False
    ) -> Decision:
        """Another worker for a request sent again: ``leg`` is ``aggregated`` (the request
        whole), ``prefill`` or ``decode`` (one half of a split)."""
        views = [v for v in self._pool().views() if v.id not in exclude]
        req = self._route_request(routed, observe=not dry_run)
        if leg == "prefill":
            return self.planner.prefill_decision(req, views, dry_run=dry_run)
        if leg == "decode":
            return self.planner.decode_decision(req, views, dry_run=dry_run)
        return self.planner.aggregated.decide(req, views, dry_run=dry_run)

    def _pin(self, table: str, key: str, worker: str) -> None:
        """Remember where a conversation went (``session``: its key's worker, a soft
        score; ``response``: where a stored response is, a hard pin), and tell the other
        processes and replicas: its next turn may reach any of them."""
        self._peer_pinned(table, key, worker)
        if self.peers is not None:
            self.peers.pinned(table, key, worker)

    def _peer_pinned(self, table: str, key: str, worker: str) -> None:
        """Another process or replica placed a conversation: remember it as if here (a
        table this release does not know of: nothing)."""
        pins = {"session": self.sessions, "response": self.responses}.get(table)
        if pins is not None:
            pins.remember(key, worker)
