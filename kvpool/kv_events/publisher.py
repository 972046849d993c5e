"""Publishes a worker's KV events on a ZMQ PUB socket, with a replay buffer.

Every batch goes out as three frames ``[topic, sequence, payload]`` with a sequence number
that grows by one per batch from 0. The last ``buffer_size`` messages are kept; a ROUTER
socket answers a request holding an 8-byte start sequence with every buffered message from
there on, each as ``[sequence, payload]``, then ``[-1, b""]``. The layout is vLLM's, so a
subscriber written for vLLM's publisher works against ours and the other way round.

ZMQ sockets are not thread-safe, so one background thread owns both sockets; the engine
thread only enqueues (:meth:`EventPublisher.publish` never blocks on the network).

Events carry prompt token ids, so with a ``credential`` (the pool's, derived from its
secret) both sockets admit only subscribers that present it: ZMQ's PLAIN mechanism, user
:data:`USERNAME`, the credential as password, checked in constant time by a ZAP handler in
the same thread. Anyone else's connection fails its handshake before it can subscribe or
ask for a replay. The frames stay vLLM's; without a credential nothing changes.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvpool.signing import constant_time_equal

from .events import (
    END_OF_REPLAY,
    Encoding,
    EventBatch,
    KVCacheEvent,
    MalformedMessage,
    encode_batch,
    encode_seq,
    parse_seq,
)

__all__ = ["USERNAME", "EventPublisher"]

logger = logging.getLogger(__name__)

_STOP = object()

#: the PLAIN user name of a subscriber; the credential is its password
USERNAME = b"kvpool"
#: where libzmq asks a socket's ZAP handler (one per context: each publisher has its own)
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: at most one warning about refused subscribers per this many seconds
_REFUSAL_LOG_S = 60.0


class EventPublisher:
    """Publish KV event batches over ZMQ; serve replays of recent ones.

    ``endpoint`` and ``replay_endpoint`` are ZMQ bind addresses; a port of ``*``
    (``tcp://127.0.0.1:*``) binds a free port, and the bound addresses are available as
    :attr:`endpoint` and :attr:`replay_endpoint` once :meth:`start` returns.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = "tcp://*:5558",
        *,
        topic: str | bytes = b"",
        buffer_size: int = 10_000,
        encoding: Encoding = "array",
        data_parallel_rank: int | None = 0,
        send_hwm: int = 100_000,
        credential: str | bytes | None = None,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if encoding not in ("array", "map"):
            raise ValueError(f"encoding must be 'array' or 'map', got {encoding!r}")
        self._bind = endpoint
        self._replay_bind = replay_endpoint
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.encoding: Encoding = encoding
        self.data_parallel_rank = data_parallel_rank
        self._send_hwm = send_hwm
        if isinstance(credential, str):
            credential = credential.encode()
        self._credential = credential or None
        self.refused = 0  # connections refused for a missing or wrong credential
        self._refusals_logged_at = -_REFUSAL_LOG_S
        self._refusals_unlogged = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._queue: queue.SimpleQueue[bytes | object] = queue.SimpleQueue()
        self._next_seq = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        # Wakes the sending thread; made by start() and closed by that thread when it ends.
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> EventPublisher:
        if self._closed:
            raise RuntimeError("publisher was closed: make a new one")
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ready.clear()
        self._start_error = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None  # the thread closed the wake sockets: start() may be retried
            raise self._start_error
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets and free the ports."""
        self._closed = True
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV event publisher did not stop within %.1f s", timeout)
        self._thread = None

    def __enter__(self) -> EventPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publishing -------------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent] | EventBatch) -> None:
        """Queue one batch; thread-safe and non-blocking.

        The batch is encoded here, in the caller's thread, so that a batch that cannot be
        encoded fails this call with a clear error instead of the sending thread."""
        thread = self._thread  # read once: close() may clear it from another thread
        if self._closed:
            raise RuntimeError("publisher is closed")
        if thread is None:
            raise RuntimeError("publisher is not started")
        if not thread.is_alive():
            raise RuntimeError(
                "KV event publisher thread has stopped (see the log); nothing is sent"
            )
        if isinstance(events, EventBatch):
            batch = events
        else:
            batch = EventBatch(
                events=list(events), ts=time.time(), data_parallel_rank=self.data_parallel_rank
            )
        try:
            payload = encode_batch(batch, self.encoding)
        except (TypeError, OverflowError) as exc:
            raise ValueError(f"KV event batch cannot be encoded: {exc}") from None
        self._queue.put(payload)
        self._wake()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch sent will carry."""
        return self._next_seq

    def _wake(self) -> None:
        wake = self._wake_w
        if wake is None:
            return
        try:
            wake.send(b"\0")
        except OSError:
            pass  # buffer full (the thread drains the whole queue anyway) or already closed

    # -- the thread that owns the sockets ----------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            for wake in (self._wake_r, self._wake_w):
                if wake is not None:
                    wake.close()

    def _serve(self) -> None:
        # A context of its own, terminated on close: when close() returns, the ports are
        # free again (a restarted worker can bind them at once).
        ctx = zmq.Context()
        zap = ctx.socket(zmq.REP) if self._credential else None
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER) if self._replay_bind else None
        try:
            if zap is not None:
                # Bound before the sockets it guards accept anyone.
                zap.setsockopt(zmq.LINGER, 0)
                zap.bind(_ZAP_ENDPOINT)
                for guarded in (pub, replay):
                    if guarded is not None:
                        guarded.setsockopt(zmq.PLAIN_SERVER, 1)
            pub.setsockopt(zmq.SNDHWM, self._send_hwm)
            pub.setsockopt(zmq.LINGER, 1000)
            pub.bind(self._bind)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None:
                replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER silently drops what exceeds its high-water mark, and libzmq learns
                # late that a reader drained its pipe: no mark; a replay is bounded by the
                # buffer anyway.
                replay.setsockopt(zmq.SNDHWM, 0)
                replay.bind(self._replay_bind)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._start_error = OSError(f"cannot bind KV event sockets: {exc}")
            for sock in (pub, replay, zap):
                if sock is not None:
                    sock.close(0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        logger.info(
            "publishing KV events on %s (replay on %s)%s",
            self.endpoint,
            self.replay_endpoint,
            ", to holders of the pool's credential only" if zap is not None else "",
        )

        poller = zmq.Poller()
        wake_fd = self._wake_r.fileno()  # zmq's poller reports plain sockets by descriptor
        poller.register(wake_fd, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        if zap is not None:
            poller.register(zap, zmq.POLLIN)
        try:
            running = True
            while running:
                ready = dict(poller.poll())
                if zap is not None and zap in ready:
                    self._answer_zap(zap)
                if wake_fd in ready:
                    try:
                        self._wake_r.recv(65536)
                    except BlockingIOError:
                        pass
                    running = self._drain(pub)
                if replay is not None and replay in ready:
                    self._serve_replays(replay)
        except Exception:  # the publisher must never take the engine down with it
            logger.exception("KV event publisher thread failed")
        finally:
            pub.close()
            if replay is not None:
                replay.close()
            if zap is not None:
                zap.close()
            ctx.term()  # waits for queued messages (up to the PUB's linger), frees the ports

    def _answer_zap(self, zap: zmq.Socket) -> None:
        """Answer libzmq's authentication requests (ZAP, RFC 27): a PLAIN handshake with
        the pool's credential passes; anything else fails before the peer reads a byte."""
        while True:
            try:
                frames = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request_id = frames[1] if len(frames) > 1 else b""
            mechanism = frames[5] if len(frames) > 5 else b""
            credentials = frames[6:]
            ok = (
                mechanism == b"PLAIN"
                and len(credentials) == 2
                and constant_time_equal(credentials[0], USERNAME)
                and constant_time_equal(credentials[1], self._credential)
            )
            if ok:
                zap.send_multipart((b"1.0", request_id, b"200", b"OK", USERNAME, b""))
                continue
            zap.send_multipart((b"1.0", request_id, b"400", b"no or wrong credential", b"", b""))
            self._refusal(frames[3].decode(errors="replace") if len(frames) > 3 else "?")

    def _refusal(self, address: str) -> None:
        self.refused += 1
        self._refusals_unlogged += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= _REFUSAL_LOG_S:
            logger.warning(
                "KV event sockets: refused %d connection(s) with a wrong credential "
                "(the latest from %s): is its pool secret another one?",
                self._refusals_unlogged,
                address or "?",
            )
            self._refusals_logged_at = now
            self._refusals_unlogged = 0

    def _drain(self, pub: zmq.Socket) -> bool:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            assert isinstance(item, bytes)
            payload = item
            seq = self._next_seq
            self._next_seq = seq + 1  # before sending: no reader may see a sent seq as next
            pub.send_multipart((self.topic, encode_seq(seq), payload), copy=False)
            self._buffer.append((seq, payload))

    def _serve_replays(self, replay: zmq.Socket) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [identity, (empty delimiter from REQ/DEALER,) start sequence]
            envelope, request = frames[:-1], frames[-1]
            if len(envelope) < 1:
                continue
            try:
                start = parse_seq(request)
            except MalformedMessage as exc:
                logger.warning("bad KV event replay request: %s", exc)
                start = None
            if start is not None and self._buffer:
                # Buffered sequence numbers are contiguous: skip straight to the start.
                skip = max(0, start - self._buffer[0][0])
                # vLLM 0.32's framing: each batch with its topic, the end with an empty one
                # (older vLLMs and kvpools sent no topic frame; subscribers read both).
                for seq, payload in itertools.islice(self._buffer, skip, None):
                    replay.send_multipart((*envelope, self.topic, encode_seq(seq), payload))
            replay.send_multipart((*envelope, b"", encode_seq(END_OF_REPLAY), b""))
