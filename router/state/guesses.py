"""The prefix index's speculative entries (:class:`.index.BlockIndex`): what the router
expects a worker to hold because it routed a request there, until the worker's own events
say so (see the index's text)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .blocks import _HELD_BYTES, _SHARDS, Hold, _Worker  # noqa: F401

__all__ = ["Guesses"]


class Guesses:
    """:class:`.index.BlockIndex`'s methods for speculative entries."""

    def speculate(self, worker_id: str, hashes: Sequence[int]) -> list[int]:
        """Count the chain as held by the worker for a while, with no request owning the
        guess: ``speculative_ttl`` unless the worker's events confirm it first (tracked),
        ``approx_ttl`` (untracked). What a replica of the release before holds came sends
        (:mod:`.peers`); the router's own requests :meth:`hold` their chains instead.

        Returns the keys this call added (not those already confirmed or already
        speculative, which are only refreshed): what :meth:`withdraw` takes back."""
        w = self._get(worker_id)
        now = self._clock()
        self._expire(now)
        expiry = now + w.ttl
        bit, spec, held, shards = w.bit, w.spec, w.held, self._shards
        n = _SHARDS
        added: list[int] = []
        # Back to front, so the chain's head is the most recently used: like vLLM freeing a
        # request's blocks tail first, eviction then shortens the prefix instead of killing it.
        for h in reversed(hashes):
            table = shards[h % n]
            m = table.get(h)
            if m is None:
                table[h] = bit
            elif not m & bit:
                table[h] = m | bit
            elif h in spec:  # a guess already: refreshed
                spec.move_to_end(h)
                spec[h] = expiry
                continue
            elif held and h in held:  # held: credited as well, for after its holds
                spec[h] = expiry
                continue
            else:
                continue  # confirmed
            added.append(h)
            spec[h] = expiry
        w.guesses += len(added)
        late = w.late
        w.speculated += len(added) - (sum(1 for h in added if h in late) if late else 0)
        if w.capacity is not None and w.guesses > w.capacity:
            self._evict(w)
        if expiry < self._next_expiry:
            self._next_expiry = expiry
        added.reverse()  # in chain order
        return added

    def hold(self, worker_id: str, hashes: Sequence[int]) -> Hold:
        """The router sends this chain to the worker for a request: count it as held there
        until the request is done with it (:meth:`release`: its first token, its end, its
        failure) or the worker's events confirm it, however long it queues there first.

        Every key of the chain not confirmed is held, whether this call made it a guess or
        another request (or an unowned guess) did: a key stays a guess while any request
        holds it. O(len(hashes)), whatever the number of requests in flight."""
        w = self._get(worker_id)
        now = self._clock()
        self._expire(now)
        self._holds += 1
        seq = self._holds
        deadline = now + self.hold_max
        bit, spec, held, shards = w.bit, w.spec, w.held, self._shards
        n = _SHARDS
        keys: list[int] = []
        fresh = 0
        late = w.late
        for h in reversed(hashes):  # back to front: the chain's head the last to evict
            table = shards[h % n]
            m = table.get(h)
            if m is None or not m & bit:
                table[h] = bit if m is None else m | bit
                held[h] = (1, deadline, seq)
                fresh += 1
                if not (late and h in late):
                    w.speculated += 1
            else:
                c = held.get(h)
                if c is not None:  # held by others too
                    held[h] = (c[0] + 1, deadline, c[2])
                    held.move_to_end(h)
                elif h in spec:  # an unowned guess, or a credit after its holds: held
                    held[h] = (1, deadline, seq)
                else:
                    continue  # confirmed: the worker's own word, nothing to hold
            keys.append(h)
        w.guesses += fresh
        if w.capacity is not None and w.guesses > w.capacity:
            self._evict(w)
        if deadline < self._next_expiry:
            self._next_expiry = deadline
        keys.reverse()  # in chain order
        return Hold(worker_id, keys, seq)

    def release(self, hold: Hold, *, failed: bool = False) -> None:
        """The request of ``hold`` is done waiting for the worker; once only (later calls,
        and a hold on a worker since removed, change nothing).

        Done (``failed`` false: its first token, or its end): the worker has computed the
        blocks and its ``BlockStored`` is on its way. Each key keeps ``speculative_ttl`` of
        credit (``approx_ttl`` for an untracked worker) beyond its holds, so that the event
        finds the guess to confirm and no request meanwhile finds the prefix missing.

        Failed (a 429, a refused connection, no first token in time: the worker computed
        nothing for it): each key that no other request holds, and that no earlier
        request's credit keeps, goes at once; the others stay, theirs."""
        if hold.done:
            return
        hold.done = True
        w = self._workers.get(hold.worker)
        if w is None or not hold.keys:
            return
        now = self._clock()
        self._expire(now)  # a key whose holds ran out meanwhile is no longer this hold's
        spec, held, seq = w.spec, w.held, hold.seq
        expiry = now + w.ttl
        for h in hold.keys:
            c = held.get(h)
            if c is None or c[2] > seq:  # confirmed, evicted or expired since (and held anew)
                continue
            left = c[0] - 1
            if left:
                held[h] = (left, c[1], c[2])
            else:
                del held[h]
            if not failed:
                spec[h] = expiry
                spec.move_to_end(h)
            elif not left and h not in spec:
                self._unset_bit(h, w.bit)
                w.guesses -= 1
                if h not in w.late:
                    w.speculated -= 1  # never sent after all
        if not failed and expiry < self._next_expiry:
            self._next_expiry = expiry

    def withdraw(self, worker_id: str, hashes: Iterable[int]) -> None:
        """Take back unowned guesses of the worker (keys :meth:`speculate` returned, for a
        request that failed before the worker computed anything). Otherwise an untracked
        worker would keep cache credit it never earned for ``approx_ttl``. Confirmed
        entries are the worker's own word and stay, and so do keys a request holds.

        Not an undo: entries the speculation evicted for capacity stay evicted. A request's
        own chain is taken back by ``release(hold, failed=True)``, which knows which keys
        are its alone."""
        w = self._get(worker_id)
        spec, held = w.spec, w.held
        if not spec:
            return
        bit = w.bit
        for h in hashes:
            if h in spec:
                del spec[h]
                if held and h in held:
                    continue
                self._unset_bit(h, bit)
                w.guesses -= 1
                if h not in w.late:
                    w.speculated -= 1  # never sent after all
