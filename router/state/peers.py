"""Router replicas tell each other what they send, so that two route as well as one.

Each replica sees only its own requests. Alone, two replicas both find the same worker
idle and both send it a burst; both send a new prefix to different workers before either
worker's KV events say where it went. So each replica publishes the facts it alone owns:

* **its load on each worker**: the requests it sent there that have not ended (in flight)
  and the prompt tokens of those that have not shown a first token yet (queued). A row per
  (replica, worker), written only by that replica, sent whenever it changes and all of
  them every :data:`HEARTBEAT_S`;
* **its speculative index entries**: the block keys it just sent to a worker for a request,
  which every replica counts as held there as the sender itself does: while that request
  waits for its first token (each chain has an id, and the sender says when its request
  saw its first token or ended, ``released``, or failed, ``withdrawn``), then for the short
  grace the worker's own KV events need to confirm it. A replica that goes (its rows
  expire, or it says goodbye) has its holds released with it, and every heartbeat names
  the sender's chains still held, so a lost message costs at most a heartbeat;
* **where it sent a conversation**: a session key's worker (a soft score) and a stored
  response's worker (a hard pin: ``previous_response_id`` continues only where the response
  is stored), so that a conversation's next turn finds its worker whichever replica or
  process it reaches. Keys travel as the client sent them, over the pool's own link.

The workers stay the owners of what they hold and of their own queues (KV events, scraped
gauges); the replicas share only what each has in flight, which is what the workers'
word lags behind. A worker's load as a replica's policy sees it is its own row plus the
other replicas' rows heard within :data:`ROW_TTL_S`.

Transport: ZMQ PUB/SUB, no broker and nothing agreed. Each replica binds a PUB socket and
subscribes to every other's; a lost message is corrected by the next change or heartbeat.
A replica cut off from the others routes as if it were alone: the rows it last heard
expire, and it has lost nothing of its own. With the pool's secret, every message carries
a keyed BLAKE2b tag of the credential derived from it; an untagged or wrongly tagged one
is dropped (and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool.signing import derive_credential

__all__ = ["FLUSH_S", "HEARTBEAT_S", "ROW_TTL_S", "Load", "PeerLink"]

log = logging.getLogger(__name__)

#: every row of a replica is sent again this often, changed or not
HEARTBEAT_S = 0.5
#: changes go out together, at most this long after the first of them: a message costs
#: its sender and every receiver tens of microseconds, so one per change (three or four a
#: request) cost a router of two processes more than the second process gave it
FLUSH_S = 0.005
#: a peer's row not heard of for this long is dropped (the peer is gone or cut off)
ROW_TTL_S = 3.0
_TAG = 16  # bytes of the message's tag


class Load(msgspec.Struct, tag="load", array_like=True, omit_defaults=True):
    """A replica's rows: worker id -> (requests in flight, prompt tokens queued), the
    chains of blocks it just sent: (worker, data-parallel rank, block keys), the
    conversations it just placed: (table, key, worker), table ``session`` or ``response``,
    per worker its requests there still waiting for their first token (none: not
    named), and what became of its chains: their ids, those whose requests are done
    (``released``) or failed (``withdrawn``), and, on a full message, those still held.
    Fields left at their defaults are not sent: a replica of the release before a
    field was added still reads every message that does not carry it, and one of that
    release reads the fields it knows of a message that does (msgpack arrays: the new
    fields come last, and are skipped). A chain without an id (from the release before
    holds) is a guess for the receiver's short ``speculative_ttl``, as that release meant;
    the chains tuples themselves keep their shape, which that release checks."""

    sender: str
    rows: dict[str, tuple[int, int]]
    #: every row the sender has: a worker it no longer names has none of its load
    full: bool = False
    chains: list[tuple[str, int | None, list[int]]] = []
    pins: list[tuple[str, str, str]] = []
    prefilling: dict[str, int] = {}
    #: the id of each of ``chains``, in order: each is held until its id comes back below
    chain_ids: list[int] = []
    #: chains whose requests saw their first token or ended
    released: list[int] = []
    #: chains whose requests failed before the worker computed anything
    withdrawn: list[int] = []
    #: on a full message: every chain the sender still holds (None: it does not say)
    live: list[int] | None = None


#: what a replica has on a worker: requests in flight, prompt tokens queued, requests
#: still waiting for their first token (prefilling)
Row = tuple[int, int, int]


def _load(sender: str, rows: dict[str, Row], **kw: Any) -> Load:
    return Load(
        sender,
        {w: (n, q) for w, (n, q, _) in rows.items()},
        prefilling={w: p for w, (_, _, p) in rows.items() if p},
        **kw,
    )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Load)


class PeerLink:
    """One replica's side: publish its own rows and speculations, keep the peers' rows.

    ``on_load(worker_id, in_flight, queued_tokens, prefilling)`` is called with the peers'
    sums for a worker whenever they change; ``on_held(worker_id, rank, keys)`` for each
    chain a peer's request sent, returning a handle that ``on_ended(handle, failed)`` gets
    back once that request is done with it (or the peer is gone: not failed);
    ``on_speculated(worker_id, rank, keys)`` for a chain without an id (a peer of the
    release before, or every chain when ``on_held`` is not given);
    ``on_pinned(table, key, worker_id)`` for each conversation a peer placed.
    ``rows()`` gives this replica's own rows (for heartbeats).
    """

    def __init__(
        self,
        bind: str,
        peers: Iterable[str],
        *,
        rows: Callable[[], dict[str, Row]],
        on_load: Callable[[str, int, int, int], None],
        on_speculated: Callable[[str, int | None, list[int]], None],
        on_pinned: Callable[[str, str, str], None] | None = None,
        on_held: Callable[[str, int | None, list[int]], Any] | None = None,
        on_ended: Callable[[Any, bool], None] | None = None,
        secret: str | None = None,
        name: str | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        row_ttl_s: float = ROW_TTL_S,
        flush_s: float = FLUSH_S,
        hold_max_s: float = 600.0,
    ) -> None:
        self.bind_endpoint = bind
        self.hold_max_s = hold_max_s
        self.heartbeat_s, self.row_ttl_s, self.flush_s = heartbeat_s, row_ttl_s, flush_s
        # what changed since the last message: rows by worker, chains sent
        self._dirty: dict[str, Row] = {}
        self._chains: list[tuple[str, int | None, list[int]]] = []
        self._chain_ids: list[int] = []
        self._released: list[int] = []
        self._withdrawn: list[int] = []
        self._pins: list[tuple[str, str, str]] = []
        self._last_chain = 0
        # this replica's chains still held -> when sent (oldest first)
        self._live: dict[int, float] = {}
        self._flush_at: asyncio.TimerHandle | None = None
        self.peers = sorted(set(peers))
        self.name = name or uuid.uuid4().hex[:12]
        self._rows = rows
        self._on_load = on_load
        self._on_speculated = on_speculated
        self._on_pinned = on_pinned
        self._on_held = on_held
        self._on_ended = on_ended
        self._key = derive_credential(secret, "router-peers").encode() if secret else None
        self._ctx = zmq.asyncio.Context.instance()
        # sends never wait (NOBLOCK, dropped when full), so a plain socket: an asyncio
        # one wraps every send in a future
        self._pub: zmq.Socket[bytes] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # peer -> worker -> (in flight, queued, prefilling, heard at)
        self._heard: dict[str, dict[str, tuple[int, int, int, float]]] = {}
        self._sums: dict[str, Row] = {}
        # peer -> chain id -> what on_held made of it; and when each peer was last heard
        self._holds: dict[str, dict[int, Any]] = {}
        self._heard_at: dict[str, float] = {}
        self.endpoint: str | None = None  # where the PUB socket is bound (a port 0 resolved)
        self.received = 0
        self.rejected = 0
        self.pins_received = 0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        pub.bind(self.bind_endpoint)
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for peer in self.peers:
            sub.connect(peer)
        self._pub, self._sub = pub, sub
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._heartbeat()),
        ]
        log.info(
            "router %s shares its load on %s with %d peer(s)%s",
            self.name,
            self.endpoint,
            len(self.peers),
            "" if self._key else " (messages untagged: no pool secret)",
        )

    def set_peers(self, peers: Iterable[str]) -> None:
        """The peers' endpoints now (discovery): connect to new ones, drop the gone."""
        wanted = set(peers)
        if self._sub is not None:
            for gone in set(self.peers) - wanted:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disconnect(gone)
            for new in wanted - set(self.peers):
                self._sub.connect(new)
        self.peers = sorted(wanted)

    async def close(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        self._dirty, self._chains, self._pins = {}, [], []
        self._chain_ids, self._released, self._withdrawn = [], [], []
        self._live.clear()
        # Nothing of this replica's is in flight any more: its peers need not wait for
        # its rows to expire, nor for its holds to.
        self._send(Load(self.name, {}, full=True, live=[]))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None

    # -- what this replica says -----------------------------------------------------------

    def load_changed(
        self, worker_id: str, in_flight: int, queued_tokens: int, prefilling: int = 0
    ) -> None:
        self._dirty[worker_id] = (in_flight, queued_tokens, prefilling)
        self._soon()

    def speculated(self, worker_id: str, rank: int | None, keys: list[int]) -> int | None:
        """A request of this replica's sends this chain to the worker: the others hold it
        until :meth:`ended` with the id this returns (None: nothing to tell)."""
        if not keys:
            return None
        self._last_chain += 1
        chain = self._last_chain
        self._chains.append((worker_id, rank, keys))
        self._chain_ids.append(chain)
        self._live[chain] = time.monotonic()
        self._soon()
        return chain

    def ended(self, chain: int, *, failed: bool = False) -> None:
        """The request of ``chain`` saw its first token or ended (``failed``: it failed
        before the worker computed anything): the others end their hold on it too."""
        if self._live.pop(chain, None) is not None:
            (self._withdrawn if failed else self._released).append(chain)
            self._soon()

    def pinned(self, table: str, key: str, worker_id: str) -> None:
        """This replica sent a conversation (``table``: ``session`` or ``response``) to
        the worker: the others remember it too."""
        self._pins.append((table, key, worker_id))
        self._soon()

    def _soon(self) -> None:
        if self._flush_at is None and self._pub is not None:
            self._flush_at = asyncio.get_running_loop().call_later(self.flush_s, self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        rows, chains, pins = self._dirty, self._chains, self._pins
        ids, released, withdrawn = self._chain_ids, self._released, self._withdrawn
        self._dirty, self._chains, self._pins = {}, [], []
        self._chain_ids, self._released, self._withdrawn = [], [], []
        if rows or chains or pins or released or withdrawn:
            self._send(
                _load(
                    self.name,
                    rows,
                    chains=chains,
                    pins=pins,
                    chain_ids=ids,
                    released=released,
                    withdrawn=withdrawn,
                )
            )

    def _send(self, message: Load) -> None:
        if self._pub is None:
            return
        payload = _encoder.encode(message)
        tag = self._tag(payload) if self._key else b""
        with contextlib.suppress(zmq.Again):  # a full queue: the next heartbeat says it
            self._pub.send_multipart((tag, payload), flags=zmq.NOBLOCK, copy=False)

    def _tag(self, payload: bytes) -> bytes:
        assert self._key is not None
        return hashlib.blake2b(payload, key=self._key, digest_size=_TAG).digest()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                if self._flush_at is not None:  # what changed first: then ``live`` is exact
                    self._flush_at.cancel()
                    self._flush()
                self._send(_load(self.name, self._rows(), full=True, live=self._held_chains()))
                self._expire(time.monotonic())
            except Exception:  # the link must outlive a bad moment
                log.exception("router peers: heartbeat failed")

    def _held_chains(self) -> list[int]:
        """This replica's chains still held, less any held longer than ``hold_max_s``
        (a request whose end this link never heard: the index drops its hold then too)."""
        live = self._live
        cutoff = time.monotonic() - self.hold_max_s
        while live:
            chain, at = next(iter(live.items()))
            if at > cutoff:
                break
            del live[chain]
        return list(live)

    # -- what the peers say ---------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._sub is not None
        sub = self._sub
        while True:
            frames = await sub.recv_multipart(copy=True)
            try:
                self._take(frames)
            except Exception:
                log.exception("router peers: a message could not be applied")

    def _take(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.rejected += 1
            return
        tag, payload = frames
        if self._key is not None and not hmac.compare_digest(tag, self._tag(payload)):
            self.rejected += 1
            return
        try:
            message = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.rejected += 1
            return
        if message.sender == self.name:
            return
        self.received += 1
        now = time.monotonic()
        self._heard_at[message.sender] = now
        self._take_chains(message)
        if self._on_pinned is not None:
            for table, key, worker in message.pins:
                self._on_pinned(table, key, worker)
        self.pins_received += len(message.pins)
        rows = self._heard.setdefault(message.sender, {})
        touched = set(message.rows)
        if message.full:
            touched |= set(rows)
            for worker in set(rows) - set(message.rows):
                del rows[worker]
        prefilling = message.prefilling
        for worker, (in_flight, queued) in message.rows.items():
            waiting = max(0, prefilling.get(worker, 0))
            rows[worker] = (max(0, in_flight), max(0, queued), waiting, now)
        for worker in touched:
            self._resum(worker)

    def _take_chains(self, message: Load) -> None:
        """A peer's chains held, and its holds ended, as the message says."""
        ids = message.chain_ids
        on_held, on_ended = self._on_held, self._on_ended
        if on_held is None or on_ended is None or len(ids) != len(message.chains):
            for worker, rank, keys in message.chains:
                self._on_speculated(worker, rank, keys)
            return
        holds = self._holds.get(message.sender)
        if holds is None:
            if not message.chains:  # nothing of the sender's is held here to end
                return
            holds = self._holds[message.sender] = {}
        for chain, (worker, rank, keys) in zip(ids, message.chains, strict=True):
            old = holds.pop(chain, None)
            if old is not None:  # the id again: a sender started afresh under its name
                on_ended(old, False)
            handle = on_held(worker, rank, keys)
            if handle is not None:
                holds[chain] = handle
        for ended, failed in ((message.released, False), (message.withdrawn, True)):
            for chain in ended:
                handle = holds.pop(chain, None)
                if handle is not None:
                    on_ended(handle, failed)
        if message.live is not None and holds:
            # a release lost on the way (or sent before this replica listened)
            for chain in holds.keys() - set(message.live):
                on_ended(holds.pop(chain), False)
        if not holds:
            del self._holds[message.sender]

    def _drop_holds(self, peer: str) -> None:
        """The peer is gone: its requests' chains are no longer held (its requests may
        have reached their workers, so a hold ends as done, not failed)."""
        holds = self._holds.pop(peer, None)
        if holds and self._on_ended is not None:
            for handle in holds.values():
                self._on_ended(handle, False)

    def _expire(self, now: float) -> None:
        for peer in list(self._holds):
            if now - self._heard_at.get(peer, now) > self.row_ttl_s:
                self._drop_holds(peer)
        for peer in list(self._heard_at):
            if now - self._heard_at[peer] > self.row_ttl_s and peer not in self._holds:
                del self._heard_at[peer]
        for peer in list(self._heard):
            rows = self._heard[peer]
            stale = [w for w, (*_, at) in rows.items() if now - at > self.row_ttl_s]
            for worker in stale:
                del rows[worker]
                self._resum(worker)
            if not rows:
                del self._heard[peer]

    def _resum(self, worker: str) -> None:
        in_flight = queued = prefilling = 0
        for rows in self._heard.values():
            row = rows.get(worker)
            if row is not None:
                in_flight += row[0]
                queued += row[1]
                prefilling += row[2]
        if self._sums.get(worker, (0, 0, 0)) != (in_flight, queued, prefilling):
            self._sums[worker] = (in_flight, queued, prefilling)
            self._on_load(worker, in_flight, queued, prefilling)

    def summary(self) -> dict[str, Any]:
        """For ``/debug/peers``: who was heard, and what they have on each worker."""
        now = time.monotonic()
        return {
            "name": self.name,
            "endpoint": self.endpoint,
            "peers": self.peers,
            "received": self.received,
            "rejected": self.rejected,
            "pins_received": self.pins_received,
            "holds": {peer: len(holds) for peer, holds in self._holds.items()},
            "heard": {
                peer: {
                    w: {
                        "in_flight": r[0],
                        "queued_tokens": r[1],
                        "prefilling": r[2],
                        "age_s": round(now - r[3], 3),
                    }
                    for w, r in rows.items()
                }
                for peer, rows in self._heard.items()
            },
        }
