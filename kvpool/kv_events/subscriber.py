"""Subscribes to one worker's KV events, in order, with gap recovery.

The owner (the router's block index) iterates over a :class:`EventSubscriber` and receives
either :class:`Received` batches, strictly in sequence order, or :class:`ResyncNeeded`:
events were lost and cannot be recovered, so whatever the owner knows of this worker's
blocks may be wrong and must be dropped. It is never left silently wrong:

* a sequence gap is filled from the publisher's replay socket; what the replay buffer no
  longer holds is reported as :class:`ResyncNeeded`;
* a payload that does not decode is fetched again through replay (it may have been damaged
  on the way); if the publisher's own copy is bad too, that batch is lost: resync;
* a publisher that restarted has an empty cache and a new stream from sequence 0. Every
  replay that continues the stream starts at the last batch consumed and compares its
  bytes: a different or missing batch means a restart (resync, then the new stream is read
  from its start). Such a check also runs on every (re)connection, and after the stream
  has been idle a while, which finds a lost tail too. When a connection drops, the SUB
  socket is replaced, so nothing the old connection left queued is taken for the new one.

Bad messages (wrong frame count, bad sequence frame, undecodable payload, events of unknown
type) are logged and counted in :attr:`EventSubscriber.stats`; the loop goes on.

A ``credential`` (a kvpool pool's, see :mod:`kvpool.signing`) is presented on both sockets
through ZMQ's PLAIN mechanism, which a kvpool publisher with that credential requires. Give
it only for kvpool publishers: a vLLM publisher speaks the NULL mechanism, and a handshake
whose mechanisms differ fails (reported once, retried with a growing pause).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .events import (
    END_OF_REPLAY,
    EventBatch,
    MalformedMessage,
    MalformedPayload,
    decode_batch,
    encode_seq,
    parse_frames,
    parse_seq,
)
from .publisher import USERNAME

__all__ = [
    "Delivery",
    "EventSubscriber",
    "RankedSubscriber",
    "Received",
    "ResyncNeeded",
    "SequenceTracker",
    "SubscriberStats",
    "Verdict",
    "offset_endpoint",
]

logger = logging.getLogger(__name__)

#: the monitor events of a handshake that failed: the publisher wants another credential,
#: or none (a vLLM publisher), or one where we had none
_REFUSED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "wrong credential",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a credential on one side only",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


@dataclass(frozen=True)
class Received:
    """A batch, delivered in sequence order; ``replayed`` if it came through replay."""

    seq: int
    batch: EventBatch
    replayed: bool = False


@dataclass(frozen=True)
class ResyncNeeded:
    """Events from ``first_lost`` to ``last_lost`` (inclusive; ``None`` where unknown) are
    gone for good: drop this worker's index entries (``rank``: those of that data-parallel
    rank only, whose stream it was). Later deliveries are valid again."""

    reason: str
    first_lost: int | None = None
    last_lost: int | None = None
    rank: int | None = None


Delivery = Received | ResyncNeeded


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    replayed_batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    resyncs: int = 0
    malformed_messages: int = 0
    malformed_payloads: int = 0
    unknown_events: int = 0
    replay_failures: int = 0
    disconnects: int = 0
    continuity_checks: int = 0
    handshake_failures: int = 0  # the publisher refused us (credential or mechanism)
    #: messages out of sequence that the publisher's replay showed not to be its stream's
    #: (a damaged or stray copy): dropped, with no resync
    stale_messages: int = 0


#: how many recent batches' digests a subscriber keeps, to know a late copy of one
RECENT_DIGESTS = 1024
#: seconds of replayed batches delivered (and applied by the consumer) between two yields
#: of the event loop
REPLAY_SLICE_S = 0.002


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class Verdict(enum.Enum):
    NEXT = "next"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


@dataclass
class SequenceTracker:
    """Where a subscriber stands in a publisher's sequence; pure, so tested on its own.

    ``last`` is the highest sequence number consumed (delivered, or given up as lost);
    ``None`` until the first message when no starting point was asked for.
    """

    last: int | None = None
    _replay_low: int | None = None
    _replay_high: int | None = None

    @classmethod
    def starting_at(cls, start_seq: int | None) -> SequenceTracker:
        return cls(last=None if start_seq is None else start_seq - 1)

    @property
    def expected(self) -> int | None:
        return None if self.last is None else self.last + 1

    def classify(self, seq: int, *, live: bool = True) -> Verdict:
        if self.last is None or seq == self.last + 1:
            return Verdict.NEXT
        if seq > self.last + 1:
            return Verdict.GAP
        # At or below what was consumed. Replayed messages and live messages that queued up
        # while a replay ran overlap it; anything else means the publisher started again.
        if not live:
            return Verdict.DUPLICATE
        if self._replay_low is not None and self._replay_low <= seq <= self._replay_high:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def replaying_from(self, start: int) -> None:
        """A replay from ``start`` begins: live messages from there up to what it delivers
        were queued meanwhile and are duplicates (or, past a hole the replay could not
        fill, already given up as lost)."""
        if self._replay_low is None or start < self._replay_low:
            self._replay_low = start
        if self._replay_high is None:
            self._replay_high = start - 1

    def consume(self, seq: int, *, replayed: bool = False) -> None:
        self.last = seq
        if replayed:
            if self._replay_low is None:
                self._replay_low = seq
            self._replay_high = seq
        else:
            # Live messages come in order: once one is past the replayed range, no more
            # duplicates of it can follow, and a step backwards can only be a restart.
            self._replay_low = self._replay_high = None

    def restart(self) -> None:
        """The publisher restarted: its new stream begins at 0."""
        self.last = -1
        self._replay_low = self._replay_high = None


class EventSubscriber:
    """An async iterator of :data:`Delivery` items from one publisher.

    ``start_seq``: ``None`` takes the stream from the first message that arrives; a number
    (0 for "everything") makes the subscriber replay from there, reporting
    :class:`ResyncNeeded` for whatever the replay buffer no longer holds.
    ``idle_check``: seconds of silence after which the subscriber checks, through replay,
    that it has not missed the stream's tail or a restart (``None``: never).
    Stop it by cancelling the task that iterates, then :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str | bytes = b"",
        start_seq: int | None = None,
        replay_timeout: float = 2.0,
        idle_check: float | None = 5.0,
        recv_hwm: int = 100_000,
        name: str | None = None,
        credential: str | bytes | None = None,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be positive, got {replay_timeout}")
        if idle_check is not None and idle_check <= 0:
            raise ValueError(f"idle_check must be positive or None, got {idle_check}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.name = name or endpoint
        self.stats = SubscriberStats()
        self.tracker = SequenceTracker.starting_at(start_seq)
        self._start_seq = start_seq
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._idle_ms = None if idle_check is None else int(idle_check * 1000)
        self._recv_hwm = recv_hwm
        if isinstance(credential, str):
            credential = credential.encode()
        self._credential = credential or None
        self._refused_for = 0.0  # seconds of pause before the next try, while refused
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        # The payload consumed at tracker.last, to tell the same stream from a new one.
        self._last_payload: bytes | None = None
        self._catch_up_pending = start_seq is not None
        #: set once the catch-up that ``start_seq`` asks for has ended (every batch the
        #: replay buffer held delivered, or the replay failed), or at once without one; also
        #: on :meth:`close`. A consumer that waits on it knows the history is in.
        self.caught_up = asyncio.Event()
        self._replay_failing = False
        # Digests of the batches consumed lately, by sequence number: a copy of one that
        # comes again (a network or proxy duplicate) is known for what it is.
        self._recent: dict[int, bytes] = {}
        # What the last continuity check found: "same" (the stream consumed so far, whose
        # newest batch is _replay_newest), "restarted" or "resynced" (it said so, and read
        # the stream afresh), or None (it could not tell).
        self._check: str | None = None
        self._replay_newest: int | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> EventSubscriber:
        if self._sub is None:
            self._open_sub()
        return self

    def _open_sub(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._recv_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._authenticate(sub)
        # Connection events are read before messages: a (re)connection is checked before
        # anything it carries is believed.
        self._monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        sub.connect(self.endpoint)
        self._sub = sub

    def _authenticate(self, sock: zmq.asyncio.Socket) -> None:
        if self._credential is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._credential)

    def _close_sub(self) -> None:
        if self._sub is not None:
            self._sub.disable_monitor()
        for sock in (self._monitor, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._monitor = None

    def _drop_replay_socket(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def close(self) -> None:
        self.caught_up.set()  # nothing more will come: a waiter must not wait for it
        self._close_sub()
        self._drop_replay_socket()

    async def __aenter__(self) -> EventSubscriber:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    # -- the loop -----------------------------------------------------------------------

    async def _iterate(self) -> AsyncIterator[Delivery]:
        self.start()
        if self._catch_up_pending and self.replay_endpoint:
            # Catch up on what was published before we connected.
            async for item in self._fill_from(self._start_seq or 0):
                yield item
        self._catch_up_pending = False
        self.caught_up.set()
        while True:
            sub, monitor = self._sub, self._monitor
            assert sub is not None and monitor is not None
            poller = zmq.asyncio.Poller()
            poller.register(monitor, zmq.POLLIN)
            poller.register(sub, zmq.POLLIN)
            while sub is self._sub:
                ready = dict(await poller.poll(self._idle_ms))
                if not ready:
                    async for item in self._resume(strict=False):
                        yield item
                elif monitor in ready:
                    async for item in self._on_connection_event(await monitor.recv_multipart()):
                        yield item
                else:
                    async for item in self._on_message(await sub.recv_multipart()):
                        yield item

    async def _on_connection_event(self, frames: list[bytes]) -> AsyncIterator[Delivery]:
        event = parse_monitor_message(frames)["event"]
        if event in _REFUSED:
            self.stats.handshake_failures += 1
            if not self._refused_for:
                logger.warning(
                    "KV events from %s: the publisher refused the connection (%s): the "
                    "router and the worker must share one pool secret, or neither have one",
                    self.name,
                    _REFUSED[event],
                )
            self._refused_for = min(max(2 * self._refused_for, 0.5), 10.0)
        elif event == zmq.EVENT_DISCONNECTED:
            # What the dead connection left queued could be mistaken for the stream of
            # whatever answers next: start afresh; replay recovers what was really missed.
            self.stats.disconnects += 1
            if self._refused_for:  # refused again: no hurry, and no line per try
                pause = self._refused_for
                logger.debug("KV events from %s: refused; next try in %.1f s", self.name, pause)
                await asyncio.sleep(self._refused_for)
            else:
                logger.info("KV events from %s: connection lost", self.name)
            self._close_sub()
            self._open_sub()
            # The replay connection most likely broke too; a fresh one asks at once rather
            # than after the old one's reconnect back-off.
            self._drop_replay_socket()
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refused_for = 0.0
            async for item in self._resume(strict=True):
                yield item

    async def _on_message(self, frames: list[bytes]) -> AsyncIterator[Delivery]:
        try:
            _topic, seq, payload = parse_frames(frames)
        except MalformedMessage as exc:
            self.stats.malformed_messages += 1
            logger.warning("KV events from %s: dropped a bad message: %s", self.name, exc)
            return
        tracker = self.tracker
        verdict = tracker.classify(seq, live=True)
        if verdict is Verdict.DUPLICATE:
            self.stats.duplicates += 1
            return
        if verdict is Verdict.RESTART:
            if self._recent.get(seq) == _digest(payload):
                self.stats.duplicates += 1  # a copy of a batch consumed lately
                return
            # A step back with bytes not seen there: a damaged or stray copy, or a publisher
            # that started again. Its replay buffer tells which, where it has one.
            previous = tracker.last
            async for item in self._resume(strict=False):
                yield item
            if self._check == "same":
                self._stale(seq, "it is behind the stream, which has not restarted")
                return
            if self._check is None:  # it cannot be told: what is known may be wrong
                self._restart()
                yield self._resync(
                    f"publisher restarted: sequence went from {previous} back to {seq}"
                )
            async for item in self._accept(seq, payload, replayed=False):
                yield item
            return
        known_bad = False
        if verdict is Verdict.NEXT:
            batch = self._decode(seq, payload)
            if batch is not None:
                yield self._deliver(seq, payload, batch, replayed=False)
                return
            known_bad = True  # damaged on the way, perhaps: the publisher's copy may be good
        else:
            self.stats.gaps += 1
            logger.info(
                "KV events from %s: sequence gap, expected %s got %s",
                self.name,
                tracker.expected,
                seq,
            )
        async for item in self._resume(strict=False):
            yield item
        newest = self._replay_newest
        if self._check == "same" and newest is not None and seq > newest:
            # The publisher sends a batch only once it is in its buffer: this number was
            # never sent by it (a damaged sequence frame). Nothing was lost.
            self._stale(seq, f"the publisher's newest batch is {newest}")
            return
        # Whatever the replay did not cover is lost; a duplicate now means it was covered.
        async for item in self._accept(seq, payload, replayed=False, known_bad=known_bad):
            yield item

    def _stale(self, seq: int, why: str) -> None:
        self.stats.stale_messages += 1
        logger.warning(
            "KV events from %s: dropped a stray batch numbered %d: %s", self.name, seq, why
        )

    async def _accept(
        self, seq: int, payload: bytes, *, replayed: bool, known_bad: bool = False
    ) -> AsyncIterator[Delivery]:
        """Take one message whose gap, if any, can no longer be filled."""
        tracker = self.tracker
        verdict = tracker.classify(seq, live=False)
        if verdict is Verdict.DUPLICATE:
            if not replayed:
                self.stats.duplicates += 1
            return
        if verdict is Verdict.GAP:
            first = tracker.expected
            tracker.consume(seq - 1, replayed=replayed)
            self._last_payload = None
            yield self._resync(
                f"events {first}..{seq - 1} were lost and the replay buffer does not hold them",
                first,
                seq - 1,
            )
        batch = None if known_bad else self._decode(seq, payload)
        if batch is None:
            tracker.consume(seq, replayed=replayed)
            self._last_payload = None  # its true bytes are unknown: nothing to compare with
            yield self._resync(
                f"batch {seq} cannot be decoded and no good copy of it could be fetched", seq, seq
            )
            return
        yield self._deliver(seq, payload, batch, replayed=replayed)

    async def _fill_from(self, start: int) -> AsyncIterator[Delivery]:
        """Deliver what the replay buffer holds from ``start`` on, with nothing to check it
        against (the stream's beginning, or the point a caller asked to start from)."""
        self.tracker.replaying_from(start)
        async for item in self._accept_replayed(await self._fetch_replay(start) or ()):
            yield item

    async def _accept_replayed(
        self, messages: Iterable[tuple[int, bytes]]
    ) -> AsyncIterator[Delivery]:
        # A full buffer (vLLM keeps 10,000 batches) takes its consumer seconds to apply:
        # the rest of the event loop runs between slices of it.
        since = time.perf_counter()
        for seq, payload in messages:
            async for item in self._accept(seq, payload, replayed=True):
                yield item
            if time.perf_counter() - since >= REPLAY_SLICE_S:
                await asyncio.sleep(0)
                since = time.perf_counter()

    async def _resume(self, *, strict: bool) -> AsyncIterator[Delivery]:
        """Bring the subscriber up to date from the replay buffer, first making sure that
        the publisher is still the stream consumed so far: the replay starts at the last
        batch consumed, whose bytes must be the ones consumed.

        ``strict``: after a (re)connection, where not being able to check is itself a
        reason to resync; otherwise (a gap, an idle stream) the caller copes with a failure.
        """
        self._check = self._replay_newest = None
        last = self.tracker.last
        if last is None:
            return  # nothing consumed yet: nothing to be wrong about
        if last < 0:  # a new stream (started, or restarted): all of it, from 0
            if self.replay_endpoint:
                async for item in self._fill_from(0):
                    yield item
            return
        if not self.replay_endpoint:
            if strict:
                yield self._resync(
                    "connected to the publisher again and, with no replay endpoint, what "
                    "happened meanwhile cannot be checked"
                )
            return
        self.stats.continuity_checks += 1
        self.tracker.replaying_from(last + 1)
        messages = await self._fetch_replay(last)
        if messages is None:
            # A connection event that came meanwhile (the publisher went away again) makes
            # this check moot: the next handshake runs its own.
            if strict and not await self._monitor_pending():
                yield self._resync("connected to the publisher again, but it answers no replay")
            return
        head = messages[0] if messages else None
        if head is not None and head[0] == last:
            if self._last_payload is None or head[1] == self._last_payload:
                self._check, self._replay_newest = "same", messages[-1][0]
                # What came after: missed, or not read yet.
                async for item in self._accept_replayed(messages[1:]):
                    yield item
                return
        elif head is not None and head[0] > last:
            # The buffer moved past our position: same stream or not, it cannot be told.
            lost = (last + 1, head[0] - 1) if head[0] > last + 1 else (None, None)
            yield self._resync(
                f"cannot check the stream: the replay buffer no longer holds batch {last}", *lost
            )
            self.tracker.consume(head[0] - 1, replayed=True)
            self._last_payload = None
            self._check = "resynced"
            async for item in self._accept_replayed(messages):
                yield item
            return
        newest = messages[-1][0] if messages else "nothing"
        self._restart()
        self._check = "restarted"
        yield self._resync(
            f"publisher restarted: it holds {newest} where batch {last} was consumed"
        )
        async for item in self._fill_from(0):
            yield item

    async def _fetch_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Everything the publisher's replay buffer holds from ``start`` on, or ``None`` if
        it does not answer properly. A request not read to its end leaves its answers in
        the socket, so such a socket is thrown away (cancellation included)."""
        sock = self._replay_socket()
        finished = False
        try:
            try:
                # A DEALER queues a request at once while it has a connection, made or being
                # made. A publisher's refusal (another credential, another mechanism) ends
                # that connection for good, and on a loaded machine it can come between
                # connect and send: a send that waited would wait for ever, and the loop
                # would never read why.
                await sock.send_multipart((b"", encode_seq(start)), flags=zmq.NOBLOCK)
            except zmq.Again:
                self._replay_failed("the publisher refused the connection")
                return None
            messages: list[tuple[int, bytes]] = []
            while True:
                if not await sock.poll(self._replay_timeout_ms):
                    self._replay_failed("no answer")
                    return None
                frames = await sock.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]  # the empty delimiter of the DEALER/ROUTER envelope
                try:
                    # (topic, sequence, payload) from vLLM 0.32 and kvpool since, the end
                    # with an empty topic; (sequence, payload) from older ones.
                    if len(frames) not in (2, 3):
                        raise MalformedMessage(f"expected 2 or 3 replay frames, got {len(frames)}")
                    frames = frames[-2:]
                    seq = parse_seq(frames[0])
                except MalformedMessage as exc:
                    # A publisher never sends these: whatever answers is not one.
                    self.stats.malformed_messages += 1
                    self.stats.replay_failures += 1
                    logger.warning("KV events from %s: bad replay message: %s", self.name, exc)
                    return None
                if seq == END_OF_REPLAY:
                    finished = True
                    self._replay_failing = False
                    return messages
                messages.append((seq, frames[1]))
        finally:
            if not finished and self._replay is sock:
                self._drop_replay_socket()

    def _replay_failed(self, why: str) -> None:
        self.stats.replay_failures += 1
        # Said once while it lasts: a worker that is down is the health check's news.
        log = logger.debug if self._replay_failing else logger.warning
        log("KV events from %s: no replay from %s: %s", self.name, self.replay_endpoint, why)
        self._replay_failing = True

    async def _monitor_pending(self) -> bool:
        monitor = self._monitor
        return monitor is not None and bool(await monitor.poll(0))

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self._authenticate(sock)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        return self._replay

    # -- helpers ------------------------------------------------------------------------

    def _restart(self) -> None:
        self.tracker.restart()
        self._last_payload = None
        self._recent.clear()

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except MalformedPayload as exc:
            reason = str(exc)
        except Exception as exc:  # whatever a damaged payload provokes, the loop goes on
            reason = f"{type(exc).__name__}: {exc}"
        self.stats.malformed_payloads += 1
        logger.warning("KV events from %s: batch %d is malformed: %s", self.name, seq, reason)
        return None

    def _deliver(self, seq: int, payload: bytes, batch: EventBatch, *, replayed: bool) -> Received:
        self.tracker.consume(seq, replayed=replayed)
        self._last_payload = payload
        recent = self._recent
        recent[seq] = _digest(payload)
        if len(recent) > RECENT_DIGESTS:
            del recent[next(iter(recent))]
        stats = self.stats
        stats.batches += 1
        stats.events += len(batch.events)
        if replayed:
            stats.replayed_batches += 1
        for event in batch.unknown_events:
            stats.unknown_events += 1
            logger.warning(
                "KV events from %s: skipped an event of unknown type %r", self.name, event.tag
            )
        return Received(seq=seq, batch=batch, replayed=replayed)

    def _resync(
        self, reason: str, first: int | None = None, last: int | None = None
    ) -> ResyncNeeded:
        self.stats.resyncs += 1
        logger.warning("KV events from %s: resync needed: %s", self.name, reason)
        return ResyncNeeded(reason=reason, first_lost=first, last_lost=last)


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` of a vLLM publishes what rank 0 publishes at
    ``endpoint``, as vLLM places it: a TCP port plus the rank (port 0 stays 0), an
    ``inproc`` name with ``_dp<rank>`` after it. vLLM refuses other addresses (``ipc``)
    for a rank above 0, and so does this (ValueError)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        if port.isdecimal() and int(port):
            return f"{head}:{int(port) + rank}"
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"{endpoint}: vLLM places a data-parallel rank's events only on tcp://")


class RankedSubscriber:
    """A data-parallel vLLM's KV events: each rank's engine publishes its own stream (at
    :func:`offset_endpoint` of the events and replay addresses), with its own sequence
    numbers and replay buffer. One :class:`EventSubscriber` per rank, read as one stream:
    batches in each rank's order, a :class:`ResyncNeeded` naming the rank that lost
    events; :attr:`caught_up` once every rank's history is in. Its interface is
    :class:`EventSubscriber`'s; a rank's stream that fails fails the whole."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        ranks: Iterable[int],
        *,
        name: str | None = None,
        **options: Any,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.ranks = tuple(sorted(set(ranks)))
        if not self.ranks:
            raise ValueError("a ranked subscriber needs at least one rank")
        name = name or endpoint
        self.subscribers = {
            r: EventSubscriber(
                offset_endpoint(endpoint, r),
                offset_endpoint(replay_endpoint, r) if replay_endpoint else None,
                name=f"{name}@dp{r}" if r else name,
                **options,
            )
            for r in self.ranks
        }
        self.topic = self.subscribers[self.ranks[0]].topic
        self.caught_up = asyncio.Event()

    @property
    def stats(self) -> SubscriberStats:
        """Every rank's counts, added up."""
        total = SubscriberStats()
        for sub in self.subscribers.values():
            for f in fields(SubscriberStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(sub.stats, f.name))
        return total

    def start(self) -> RankedSubscriber:
        for sub in self.subscribers.values():
            sub.start()
        return self

    def close(self) -> None:
        self.caught_up.set()
        for sub in self.subscribers.values():
            sub.close()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Delivery]:
        # (rank, a delivery | _CAUGHT_UP | the error that ended its stream | None: it ended)
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(rank: int, sub: EventSubscriber) -> None:
            ended: Any = None
            try:
                async for item in sub:
                    await queue.put((rank, item))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                ended = exc
            finally:  # whatever ends it, the reader hears of it (cancelled: nobody reads)
                queue.put_nowait((rank, ended))

        async def caught_up(rank: int, sub: EventSubscriber) -> None:
            # set after its history's last batch is queued: the marker comes after it
            await sub.caught_up.wait()
            await queue.put((rank, _CAUGHT_UP))

        tasks = [asyncio.create_task(pump(r, s)) for r, s in self.subscribers.items()]
        tasks += [asyncio.create_task(caught_up(r, s)) for r, s in self.subscribers.items()]
        behind = set(self.ranks)
        try:
            while True:
                rank, item = await queue.get()
                if item is _CAUGHT_UP:
                    behind.discard(rank)
                    if not behind:  # every rank's history has been taken by the reader
                        self.caught_up.set()
                    continue
                if item is None:
                    raise ConnectionError(f"rank {rank}'s KV event stream ended")
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, ResyncNeeded):
                    item = replace(item, rank=rank)
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


#: a rank's history is all in the queue (:class:`RankedSubscriber`)
_CAUGHT_UP = object()
