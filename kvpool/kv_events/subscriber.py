"""Subscribes to one worker's KV events, in order, with gap recovery.

The owner (the router's block index) iterates over a :class:`EventSubscriber` and receives
either :class:`Received` batches, strictly in sequence order, or :class:`ResyncNeeded`:
events were lost and cannot be recovered, so whatever the owner knows of this worker's
blocks may be wrong and must be dropped. It is never left silently wrong:

* a sequence gap is filled from the publisher's replay socket; what the replay buffer no
  longer holds is reported as :class:`ResyncNeeded`;
* a payload that does not decode is fetched again through replay (it may have been damaged
  on the way); if the publisher's own copy is bad too, that batch is lost: resync;
* a sequence number that goes backwards means the publisher restarted with an empty cache:
  resync, then the new stream is read from its start.

Bad messages (wrong frame count, bad sequence frame, undecodable payload, events of unknown
type) are logged and counted in :attr:`EventSubscriber.stats`; the loop goes on.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

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

__all__ = [
    "Delivery",
    "EventSubscriber",
    "Received",
    "ResyncNeeded",
    "SequenceTracker",
    "SubscriberStats",
    "Verdict",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """A batch, delivered in sequence order; ``replayed`` if it came through replay."""

    seq: int
    batch: EventBatch
    replayed: bool = False


@dataclass(frozen=True)
class ResyncNeeded:
    """Events from ``first_lost`` to ``last_lost`` (inclusive; ``None`` where unknown) are
    gone for good: drop this worker's index entries. Later deliveries are valid again."""

    reason: str
    first_lost: int | None = None
    last_lost: int | None = None


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
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str | bytes = b"",
        start_seq: int | None = None,
        replay_timeout: float = 2.0,
        recv_hwm: int = 100_000,
        name: str | None = None,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be positive, got {replay_timeout}")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.name = name or endpoint
        self.stats = SubscriberStats()
        self.tracker = SequenceTracker.starting_at(start_seq)
        self._start_seq = start_seq
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._recv_hwm = recv_hwm
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> EventSubscriber:
        if self._sub is not None:
            return self
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._recv_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub
        return self

    def close(self) -> None:
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None

    async def __aenter__(self) -> EventSubscriber:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self._iterate()

    # -- the loop -----------------------------------------------------------------------

    async def _iterate(self) -> AsyncIterator[Delivery]:
        self.start()
        assert self._sub is not None
        if self._start_seq is not None and self.replay_endpoint:
            # Catch up on what was published before we connected.
            async for item in self._replay_from(self._start_seq):
                yield item
        while self._sub is not None:
            frames = await self._sub.recv_multipart()
            try:
                _topic, seq, payload = parse_frames(frames)
            except MalformedMessage as exc:
                self.stats.malformed_messages += 1
                logger.warning("KV events from %s: dropped a bad message: %s", self.name, exc)
                continue
            async for item in self._on_live(seq, payload):
                yield item

    async def _on_live(self, seq: int, payload: bytes) -> AsyncIterator[Delivery]:
        tracker = self.tracker
        verdict = tracker.classify(seq, live=True)
        if verdict is Verdict.DUPLICATE:
            self.stats.duplicates += 1
            return
        if verdict is Verdict.RESTART:
            previous = tracker.last
            tracker.restart()
            yield self._resync(f"publisher restarted: sequence went from {previous} back to {seq}")
            verdict = tracker.classify(seq, live=True)
        if verdict is Verdict.NEXT:
            batch = self._decode(seq, payload)
            if batch is not None:
                yield self._deliver(seq, batch, replayed=False)
                return
            if not self.replay_endpoint or tracker.expected is None:
                tracker.consume(seq)
                yield self._resync(f"batch {seq} cannot be decoded", seq, seq)
                return
            # Damaged on the way, perhaps: the publisher's copy may still be good.
        else:
            self.stats.gaps += 1
            logger.info(
                "KV events from %s: sequence gap, expected %s got %s",
                self.name,
                tracker.expected,
                seq,
            )
        if self.replay_endpoint and tracker.expected is not None:
            async for item in self._replay_from(tracker.expected):
                yield item
        # Whatever the replay did not cover is lost; a duplicate now means it was covered.
        async for item in self._accept(seq, payload, replayed=False):
            yield item

    async def _accept(self, seq: int, payload: bytes, *, replayed: bool) -> AsyncIterator[Delivery]:
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
            yield self._resync(
                f"events {first}..{seq - 1} were lost and the replay buffer does not hold them",
                first,
                seq - 1,
            )
        batch = self._decode(seq, payload)
        if batch is None:
            tracker.consume(seq, replayed=replayed)
            yield self._resync(f"batch {seq} cannot be decoded, even from the publisher", seq, seq)
            return
        yield self._deliver(seq, batch, replayed=replayed)

    async def _replay_from(self, start: int) -> AsyncIterator[Delivery]:
        sock = self._replay_socket()
        await sock.send_multipart((b"", encode_seq(start)))
        while True:
            if not await sock.poll(self._replay_timeout_ms):
                self.stats.replay_failures += 1
                logger.warning(
                    "KV events from %s: no replay answer from %s", self.name, self.replay_endpoint
                )
                # Late answers to this request must not be read as answers to the next one.
                self._replay.close(linger=0)
                self._replay = None
                return
            frames = await sock.recv_multipart()
            if frames and not frames[0]:
                frames = frames[1:]  # the empty delimiter of the DEALER/ROUTER envelope
            try:
                if len(frames) != 2:
                    raise MalformedMessage(f"expected 2 replay frames, got {len(frames)}")
                seq = parse_seq(frames[0])
            except MalformedMessage as exc:
                self.stats.malformed_messages += 1
                logger.warning("KV events from %s: bad replay message: %s", self.name, exc)
                continue
            if seq == END_OF_REPLAY:
                return
            async for item in self._accept(seq, frames[1], replayed=True):
                yield item

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._replay is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.replay_endpoint)
            self._replay = sock
        return self._replay

    # -- helpers ------------------------------------------------------------------------

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        try:
            return decode_batch(payload)
        except MalformedPayload as exc:
            self.stats.malformed_payloads += 1
            logger.warning("KV events from %s: batch %d is malformed: %s", self.name, seq, exc)
            return None

    def _deliver(self, seq: int, batch: EventBatch, *, replayed: bool) -> Received:
        self.tracker.consume(seq, replayed=replayed)
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
